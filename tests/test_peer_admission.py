"""The peer's pure policies against hostile clients: admission to its KV cache budget, what a hop
relays upstream, and where it may dial a next hop."""

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from p2pfusion.dht.records import PeerState
from p2pfusion.net import messages as m
from p2pfusion.peer.admission import (
    ROOM_RETRY,
    SHARE_RETRY,
    Budget,
    Reservation,
    kv_bytes_per_token,
    refusal,
    vouched_origin,
)
from p2pfusion.peer.directory import HopDirectory, dial_addrs
from p2pfusion.net.penalties import (
    FIRST_PAUSE, FREE_REFUSALS, LONGEST_PAUSE, REFUSAL_HALF_LIFE, SOURCES_KEPT, Refusals, pause_for,
)
from p2pfusion.peer.memory import QUANTIZED_TRIM_EVERY, TRIM_AFTER, TRIM_EVERY, quantized_trim_due, trim_due
from p2pfusion.peer.relay import screen
from tests.policy_records import rec

MIB = 1 << 20


def test_sessions_reserve_their_whole_cache_within_the_budget_and_each_sources_share():
    # the default model's 30 layers, 3 KV heads of 64, float32: 46 KiB a token
    assert kv_bytes_per_token(30, 3, 64, 4) == 2 * 30 * 3 * 64 * 4
    budget = Budget(total=100 * MIB, source_share=0.5, source_sessions=3, sessions=5)
    held = [Reservation("ip:a", 30 * MIB), Reservation("ip:b", 40 * MIB)]
    assert refusal(budget, held, Reservation("ip:c", 30 * MIB)) is None
    full = refusal(budget, held, Reservation("ip:c", 31 * MIB))
    assert "no room" in full.reason and full.retry_after == ROOM_RETRY
    own = refusal(budget, held, Reservation("ip:b", 11 * MIB))
    assert "one client may hold at most 50 MiB" in own.reason and own.retry_after == SHARE_RETRY
    assert refusal(budget, held, Reservation("ip:b", 10 * MIB)) is None
    never = refusal(budget, [], Reservation("ip:a", 51 * MIB))
    assert "never fits here" in never.reason and never.retry_after is None  # not busy: no wait helps
    many = [Reservation("ip:a", MIB)] * 3
    assert "already has 3 sessions" in refusal(budget, many, Reservation("ip:a", MIB)).reason
    assert refusal(budget, many, Reservation("ip:b", MIB)) is None  # others are not held back
    capped = refusal(budget, many + [Reservation("ip:b", MIB)] * 2, Reservation("ip:c", MIB))
    assert "5 sessions open, at most 5" in capped.reason and capped.retry_after == ROOM_RETRY


@given(
    st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 40)), max_size=12),
    st.sampled_from("abcd"), st.integers(1, 80),
)
def test_admitted_sessions_never_pass_the_budget_the_cap_or_a_share(held, source, mib):
    budget = Budget(total=100 * MIB, source_share=0.5, source_sessions=4, sessions=8)
    admitted: list[Reservation] = []
    for src, size in held:  # admitted one by one, as a peer would
        if refusal(budget, admitted, Reservation(src, size * MIB)) is None:
            admitted.append(Reservation(src, size * MIB))
    request = Reservation(source, mib * MIB)
    refused = refusal(budget, admitted, request)
    after = admitted + ([request] if refused is None else [])
    assert sum(r.nbytes for r in after) <= budget.total and len(after) <= budget.sessions
    for src in "abcd":
        own = [r for r in after if r.source == src]
        assert sum(r.nbytes for r in own) <= 50 * MIB and len(own) <= budget.source_sessions
    # busy means a wait may help; a refusal without a hint means no wait ever does
    assert refused is None or (refused.retry_after is None) == (mib > 50)


def test_a_listed_peer_relaying_the_layers_before_speaks_for_its_client():
    client = "ip:198.51.100.7"
    assert vouched_origin(client, (0, 10), 10) == client  # the hop just before this one
    assert vouched_origin(client, (4, 12), 10) == client  # it overlaps this hop's layers
    assert vouched_origin("circuit:QmR", (0, 10), 10) == "circuit:QmR"  # behind a libp2p relay
    assert vouched_origin("peer:QmC", (0, 10), 10) is None  # an identity is no address
    assert vouched_origin(None, (0, 10), 10) is None  # its own session
    assert vouched_origin(client, None, 10) is None  # not listed: a client's claim, ignored
    assert vouched_origin(client, (0, 8), 10) is None  # not the layers before this hop
    assert vouched_origin(client, (10, 20), 10) is None  # a peer of this hop's own layers
    assert vouched_origin("relay:QmX", (0, 10), 10) is None  # not a client's address


def test_a_relay_passes_only_claims_about_the_hops_after_it():
    after = {"B", "C"}
    for honest in (m.Error("bad step", step=3), m.Error("C died", failed_peer="C"), m.Leaving("B"),
                   m.Error("busy", failed_peer="B", code=m.ErrorCode.BUSY), m.ParamGrads(1, [])):
        assert screen(honest, after, "B") is honest
    for forged in (m.Result(step=1), m.Step(step=1), m.Ack(), m.Error("x", failed_peer="A"), m.Leaving("Z")):
        replaced = screen(forged, after, "B")
        assert isinstance(replaced, m.Error) and replaced.failed_peer == "B" and replaced.code is None


def test_a_next_hop_is_dialled_only_where_its_record_says():
    announced = ["10.0.0.2:7000", "127.0.0.1:7000"]
    assert dial_addrs(["127.0.0.1:7000", "10.9.9.9:22"], announced) == ["127.0.0.1:7000"]
    assert dial_addrs([f"10.9.9.9:{p}" for p in range(8)], announced) == announced  # none listed: the record's own
    assert dial_addrs([], [f"h:{p}" for p in range(6)]) == ["h:0", "h:1", "h:2"]  # at most MAX_DIALED


def test_the_directory_looks_a_missing_next_hop_up_again_at_most_once_a_second():
    """A next hop missing from the last lookup may have announced since (the client saw its record
    first): the directory waits for the next lookup allowed and finds it there, one lookup for
    any number of misses at once."""
    now = [0.0]
    lookups = []
    announced = [rec(0, 2, name="B", data_addrs=["b:1"]), rec(2, 4, name="C", state=PeerState.OFFLINE)]

    async def lookup():
        lookups.append(now[0])
        return list(announced)

    async def sleep(seconds):
        now[0] = max(now[0], called[0] + seconds)

    called = [0.0]

    async def scenario():
        directory = HopDirectory(lookup, clock=lambda: now[0], sleep=sleep)
        assert await directory("B") == ["b:1"]
        assert await directory("C") is None  # offline: not dialled, and not looked up again
        assert await directory.serves("B") == (0, 2) and directory.listed("B") and not directory.listed("C")
        assert lookups == [0.0]
        misses = await asyncio.gather(*(directory(f"X{i}") for i in range(50)))
        assert lookups == [0.0, 1.0]  # the 50 misses waited for one lookup, a second after the first
        announced.append(rec(2, 4, name="N", data_addrs=["n:1"]))  # N announces after that lookup
        now[0] = called[0] = 1.5
        assert await directory("N") == ["n:1"]
        assert lookups == [0.0, 1.0, 2.0]
        now[0] = called[0] = 9.0
        assert await directory("B") == ["b:1"]
        return misses

    assert asyncio.run(scenario()) == [None] * 50
    assert lookups == [0.0, 1.0, 2.0, 9.0]


def test_the_heap_is_trimmed_once_in_a_while_as_sessions_end():
    """A trim holds up the compute thread's allocations: sessions expiring together set off one
    trim, not one each, while others are open; the last one to close always trims."""
    big = TRIM_AFTER
    assert not trim_due(0, 0, 100.0)
    assert trim_due(1, 0, 0.0)  # none left open
    assert trim_due(big, 3, TRIM_EVERY) and not trim_due(big, 3, TRIM_EVERY / 2)
    assert not trim_due(big - 1, 3, 100.0)


def test_a_quantized_stage_on_cpu_trims_its_forwards_temporaries_only_while_idle():
    """A trim (10-20 ms) would hold up a step running beside it; a float32 stage frees nothing it must give back."""
    assert quantized_trim_due(True, True, QUANTIZED_TRIM_EVERY)
    assert not quantized_trim_due(True, True, QUANTIZED_TRIM_EVERY / 2)
    assert not quantized_trim_due(True, False, 100.0)
    assert not quantized_trim_due(False, True, 100.0)


def test_refusals_earn_pauses_that_double_then_cap_and_fade():
    assert [pause_for(n) for n in range(1, FREE_REFUSALS + 1)] == [0.0] * FREE_REFUSALS
    assert [pause_for(FREE_REFUSALS + k) for k in (1, 2, 3)] == [FIRST_PAUSE, 2 * FIRST_PAUSE, 4 * FIRST_PAUSE]
    assert pause_for(100) == LONGEST_PAUSE
    refusals = Refusals()
    pauses = [refusals.add("ip:a", 0.0) for _ in range(FREE_REFUSALS + 2)]
    assert pauses[-2:] == [FIRST_PAUSE, 2 * FIRST_PAUSE] and refusals.pause("ip:a", 0.0) == 2 * FIRST_PAUSE
    assert refusals.pause("ip:b", 0.0) == refusals.add("ip:b", 0.0) == 0.0  # one source's pauses are its own
    # two half-lives later its count (5) is 1.25: free again, and one more makes 2.25
    assert refusals.pause("ip:a", 2 * REFUSAL_HALF_LIFE) == refusals.add("ip:a", 2 * REFUSAL_HALF_LIFE) == 0.0
    for i in range(SOURCES_KEPT + 10):
        refusals.add(f"ip:{i}", 1.0)
    assert len(refusals._counts) == SOURCES_KEPT
