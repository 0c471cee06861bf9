"""Pure policies, without a network: routing, client health, DHT record parsing."""

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pfusion.client.route.health import BAN_MAX, HINT_MAX, PeerHealth
from p2pfusion.client.generate.local_layers import local_boundary
from p2pfusion.client.route.planner import find_route, gaps_closing, longest_session, missing_layers
from p2pfusion.client.route.pieces import MIN_CHUNK_TOKENS, chunk_sizes
from p2pfusion.client.route.watch import MIN_SUSPECT, SUSPECT_FACTOR, frozen_hop, suspect_after
from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.net.silence import MIN_GRACE, SETTLED_GRACE, ask_all, ask_until_enough, deadline, grace
from p2pfusion.errors import RequestError, RouteError
from tests.policy_records import rec


def test_route_covers_all_layers_with_fewest_hops():
    records = [rec(0, 10), rec(10, 20), rec(20, 30), rec(0, 20), rec(10, 30, PeerState.OFFLINE)]
    route = find_route(records, 30)
    assert [(r.start, r.end) for r in route] == [(0, 20), (20, 30)]


def test_route_prefers_faster_peer_among_equal_hops():
    records = [rec(0, 5, throughput=1.0), rec(0, 5, throughput=9.0), rec(5, 10)]
    assert find_route(records, 10)[0].throughput == 9.0


def test_route_trusts_what_the_client_observed_over_what_peers_claim():
    liar, honest = rec(0, 5, throughput=100.0, name="liar"), rec(0, 5, throughput=2.0, name="honest")
    records = [liar, honest, rec(5, 10)]
    assert find_route(records, 10)[0].peer_id == "liar"
    # observed rates are per layer: the liar really did 1 token/s through its 5 layers
    assert find_route(records, 10, observed={"liar": 5.0})[0].peer_id == "honest"


def test_route_skips_banned_peers_and_uses_backups_only_when_failing_over():
    records = [rec(0, 5, name="a"), rec(0, 5, PeerState.BACKUP, name="spare"), rec(5, 10)]
    assert find_route(records, 10)[0].peer_id == "a"
    with pytest.raises(RouteError, match="layers 0:5"):
        find_route(records, 10, banned={"a"})
    assert find_route(records, 10, banned={"a"}, backups=True)[0].peer_id == "spare"
    # an online peer is still preferred to a backup when both are usable
    assert find_route(records, 10, backups=True)[0].peer_id == "a"


def test_route_names_missing_layers():
    with pytest.raises(RouteError, match="layers 10:20, 25:30"):
        find_route([rec(0, 10), rec(20, 25), rec(10, 20, PeerState.JOINING)], 30)


def test_a_route_may_leave_a_peer_before_its_last_layer_where_another_hop_starts():
    long, rest = rec(0, 6, name="long"), rec(4, 10, name="rest")
    route = find_route([long, rest], 10)
    assert [(r.peer_id, r.start, r.end) for r in route] == [("long", 0, 4), ("rest", 4, 10)]
    # the shortened hop runs 4 of its 6 layers: its throughput is that of 4 layers
    assert route[0].throughput == pytest.approx(long.throughput * 6 / 4)
    # never cut short where a whole range chains as fast: its other layers stay free for routes that need them
    whole = rec(0, 4, throughput=1.5, name="whole")
    assert [(r.peer_id, r.end) for r in find_route([long, whole, rest], 10)] == [("whole", 4), ("rest", 10)]
    # but a faster peer is taken for part of its range
    fast = rec(0, 8, throughput=3.0, name="fast")
    assert [(r.peer_id, r.end) for r in find_route([whole, fast, rest], 10)] == [("fast", 4), ("rest", 10)]


def test_route_rejects_ranges_that_do_not_chain():
    # from layer 3 on, only 0:6 serves layers 4:6, and a route from 3 cannot enter it after its first layer
    with pytest.raises(RouteError, match="do not chain from layer 3"):
        find_route([rec(0, 6), rec(3, 4)], 6, first=3)


def test_a_route_from_a_first_layer_ignores_the_layers_before_it():
    records = [rec(0, 2, session_limit=8), rec(2, 4), rec(4, 10)]
    assert [(r.start, r.end) for r in find_route(records, 10, first=2)] == [(2, 4), (4, 10)]
    assert [(r.start, r.end) for r in find_route(records, 10, first=4)] == [(4, 10)]
    assert missing_layers([rec(4, 6)], 10, first=3) == [(3, 4), (6, 10)]
    with pytest.raises(RouteError, match="do not chain from layer 3"):
        find_route(records, 10, first=3)
    # the peer accepting 8 tokens serves only layers a session from layer 2 runs itself
    assert longest_session(records, 10, 4096) == 8 and longest_session(records, 10, 4096, first=2) == 2048


def test_a_session_waits_for_a_gap_only_while_peers_are_loading_its_layers():
    served = [rec(0, 4), rec(4, 8)]
    assert not gaps_closing(served, 8)  # no gap: nothing to wait for
    assert not gaps_closing([rec(0, 4)], 8)  # nobody comes for 4:8: fail at once
    assert gaps_closing([rec(0, 4), rec(4, 8, PeerState.JOINING)], 8)
    assert gaps_closing([rec(0, 4), rec(4, 8, PeerState.BACKUP)], 8)
    assert gaps_closing([rec(0, 4), rec(0, 4, name="mover", moving_to=(4, 8))], 8)
    assert not gaps_closing([rec(0, 4), rec(4, 6, PeerState.JOINING)], 8)  # 6:8 still nobody's
    assert not gaps_closing([rec(0, 4), rec(4, 8, PeerState.JOINING, name="x")], 8, banned={"x"})
    assert gaps_closing([rec(0, 2), rec(4, 8, PeerState.JOINING)], 8, first=4)  # layers before 4 run locally


def test_the_local_boundary_is_the_first_stage_start_at_or_after_k_with_a_route():
    records = [rec(0, 1), rec(1, 2), rec(1, 3), rec(0, 2), rec(2, 4), rec(3, 4, PeerState.JOINING)]
    assert [local_boundary(records, 4, k) for k in (0, 1, 2)] == [0, 1, 2]
    assert local_boundary(records, 4, 1, avoid={"p1x2x1online"}) == 1  # 1:3 leaves for 2:4 at layer 2
    with pytest.raises(RequestError, match=r"starts at layer 3 or later \(the model has 4 layers; .* start at 0, 1, 2\)"):
        local_boundary(records, 4, 3)
    with pytest.raises(RouteError, match="no peer serves layers 3:4"):
        local_boundary([rec(0, 1), rec(1, 3)], 4, 1)


@given(st.lists(st.tuples(st.integers(0, 11), st.integers(1, 12)), max_size=8))
def test_route_is_contiguous_whenever_it_exists(spans):
    records = [rec(a, b) for a, b in spans if a < b]
    try:
        route = find_route(records, 12)
    except RouteError:
        return
    assert route[0].start == 0 and route[-1].end == 12
    assert all(x.end == y.start for x, y in zip(route, route[1:]))
    # each hop runs the first layers of a peer's range
    assert all(any(r.peer_id == hop.peer_id and r.start == hop.start and hop.end <= r.end for r in records) for hop in route)


@given(st.lists(st.tuples(st.integers(0, 11), st.integers(1, 12)), max_size=8))
def test_from_layer_0_a_route_exists_whenever_peers_serve_every_layer(spans):
    records = [rec(a, b) for a, b in spans if a < b]
    if missing_layers(records, 12):
        return
    find_route(records, 12)  # a hop may leave a peer wherever another starts


def test_record_parsing_rejects_malformed_values():
    good = rec(0, 4, moving_to=(4, 8), rtt=0.01).to_value()
    assert PeerRecord.from_value(good) == rec(0, 4, moving_to=(4, 8), rtt=0.01)
    bad_values = (
        None, 3, {}, {**good, "state": "dancing"}, {**good, "start": 5}, {**good, "maddrs": 7},
        {**good, "compute_rate": float("nan")}, {**good, "compute_rate": 0}, {**good, "network_rate": -1.0},
        {**good, "moving_to": [3]}, {**good, "moving_to": [5, 2]}, {**good, "load": "x"},
        {**good, "sessions": -1}, {**good, "queued": 1.5}, {**good, "sessions": True}, {**good, "queued": 1 << 60},
        {**good, "cache_used": 2, "cache_total": 1}, {**good, "token_bytes": "x"},
    )
    for bad in bad_values:
        assert PeerRecord.from_value(bad) is None
    loaded = rec(0, 4, sessions=3, queued=2, cache_used=10, cache_total=20, token_bytes=1)
    assert PeerRecord.from_value(loaded.to_value()) == loaded
    older = {k: v for k, v in good.items() if k not in ("sessions", "queued", "cache_used", "cache_total", "token_bytes")}
    assert PeerRecord.from_value(older) == PeerRecord.from_value(good)  # a peer announcing no load carries none


def test_failing_peers_are_banned_with_growing_back_off():
    health = PeerHealth()
    assert [health.failed("p", now=0.0) for _ in range(4)] == [5.0, 10.0, 20.0, 40.0]
    assert health.banned(now=30.0) == {"p"} and health.banned(now=41.0) == set()
    for _ in range(20):
        health.failed("p", now=0.0)
    assert health.banned(now=BAN_MAX - 1) == {"p"} and health.banned(now=BAN_MAX + 1) == set()
    health.succeeded("p")
    assert health.failed("p", now=0.0) == 5.0


def test_busy_peers_are_skipped_as_long_as_they_hint_with_back_off():
    health = PeerHealth()
    assert [health.was_busy("p", now=0.0) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 16.0, 16.0]  # no hint
    assert health.was_busy("q", retry_after=3.0, now=0.0) == 3.0
    assert health.was_busy("q", retry_after=3.0, now=3.5) == 6.0  # busy again in a row: backs off
    assert health.was_busy("r", retry_after=1e6, now=0.0) == HINT_MAX  # a hint may not keep clients away for good
    assert health.skipped(now=5.0) == {"p", "q", "r"} and health.skipped(now=10.0) == {"p", "r"}
    assert health.room_at(now=0.0) == 9.5 and health.room_at(now=100.0) is None
    assert health.was_busy("q", retry_after=2.0, now=100.0) == 2.0  # a while later, its back-off starts over
    assert health.banned(now=1.0) == set()  # busy is no failure


def test_observed_speed_is_a_moving_average_per_layer():
    health = PeerHealth()
    health.observe("p", layers=10, seconds=0.1)
    assert health.observed["p"] == pytest.approx(100.0)
    health.observe("p", layers=10, seconds=0.05)
    assert 100.0 < health.observed["p"] < 200.0


def test_chunks_cover_the_step_in_pipeline_sized_pieces():
    assert chunk_sizes(1, 3) == [1] and chunk_sizes(100, 3) == [100]
    assert chunk_sizes(128, 3) == [64, 64] and chunk_sizes(128, 1) == [128]
    for tokens in range(1, 600, 7):
        for hops in range(1, 6):
            sizes = chunk_sizes(tokens, hops)
            assert sum(sizes) == tokens and len(sizes) <= hops
            assert len(sizes) == 1 or min(sizes) >= MIN_CHUNK_TOKENS
            assert max(sizes) - min(sizes) <= 1


def test_a_peer_that_comes_back_is_forgiven_its_ban():
    health = PeerHealth()
    health.failed("p", since=10.0, now=0.0)
    assert health.banned([rec(0, 4, name="p", since=10.0)], now=1.0) == {"p"}  # the same process
    assert health.banned([rec(0, 4, PeerState.JOINING, name="p", since=20.0)], now=1.0) == {"p"}  # still loading
    assert health.banned([rec(0, 4, name="p", since=20.0)], now=1.0) == set()  # restarted, serving again


def test_a_long_step_is_looked_into_after_many_usual_steps_and_a_silent_hop_is_blamed_only_beside_answering_ones():
    assert suspect_after(None) == MIN_SUSPECT and suspect_after(0.01) == MIN_SUSPECT
    assert suspect_after(0.5) == 0.5 * SUSPECT_FACTOR
    route = [rec(0, 10, name="a"), rec(10, 20, name="b"), rec(20, 30, name="c")]
    assert frozen_hop(route, set()) is None
    assert frozen_hop(route, {"b"}) == "b"
    assert frozen_hop(route, {"c", "b"}) == "b"  # the first silent hop of the route
    assert frozen_hop(route, {"a", "b", "c"}) is None  # nobody answers: this client's own network
    assert frozen_hop(route, {"z"}) is None  # a silent peer off the route is not this route's fault
    assert frozen_hop(route[:1], {"a"}) is None
    assert frozen_hop(route[:1], {"a"}, reference_answered=True) == "a"  # a one-hop route, a peer beside it answered


def test_a_silent_peer_is_given_up_after_its_grace_once_another_answered():
    assert grace(None, 3.0) == 3.0  # never heard from: its timeout
    assert grace(0.001, 3.0) == MIN_GRACE and grace(0.2, 3.0) == 2.0 and grace(1.0, 3.0) == 3.0
    assert deadline(0.001, 3.0, first=None) == 3.0  # nobody answered: maybe our own network
    assert deadline(0.001, 3.0, first=0.01) == MIN_GRACE
    assert deadline(0.2, 3.0, first=0.01) == 2.0  # a far peer: ten of its round trips
    assert deadline(None, 3.0, first=0.01) == 3.0  # never heard from: the timeout...
    assert deadline(None, 3.0, first=0.01, settled=0.5) == 0.5 + SETTLED_GRACE  # ...unless the caller has enough
    assert deadline(None, 3.0, first=0.1, settled=0.5) == 0.8  # three times the first answer's time
    assert deadline(0.001, 3.0, first=0.01, settled=0.5) == MIN_GRACE  # a known peer is judged as before

    async def answer(value, seconds):
        await asyncio.sleep(seconds)
        return value

    async def asked(calls, rtts, timeout, like_first=False):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        results = await ask_all({k: answer(v, s) for k, (v, s) in calls.items()}, rtts, timeout, bool, like_first)
        return results, loop.time() - t0

    # "frozen" answered quickly before, "live" answers now: "frozen" is given up after MIN_GRACE
    results, seconds = asyncio.run(asked({"live": (True, 0.01), "frozen": (True, 60)}, {"frozen": 0.001}, 3.0))
    assert results == {"live": True, "frozen": None} and MIN_GRACE <= seconds < 2.0
    # the same with no answer from anyone (False is no answer): the full timeout
    results, seconds = asyncio.run(asked({"live": (False, 0.01), "frozen": (True, 60)}, {"frozen": 0.001}, 1.2))
    assert results == {"live": False, "frozen": None} and seconds >= 1.2
    # a peer never heard from before is waited for its full timeout
    results, seconds = asyncio.run(asked({"live": (True, 0.01), "new": (True, 1.2)}, {}, 3.0))
    assert results == {"live": True, "new": True} and seconds >= 1.2
    # ...unless told to judge it by the first answer's time
    results, seconds = asyncio.run(asked({"live": (True, 0.01), "new": (True, 60)}, {}, 3.0, True))
    assert results == {"live": True, "new": None} and MIN_GRACE <= seconds < 2.0


def test_peers_never_heard_from_are_not_waited_for_once_the_caller_has_enough_and_their_calls_go_on():
    async def answer(value, seconds):
        await asyncio.sleep(seconds)
        return value

    async def scenario(enough):
        loop = asyncio.get_running_loop()
        calls = {"a": answer(True, 0.01), "b": answer(True, 0.05), "tarpit": answer(True, 1.0), "known": answer(True, 0.3)}
        t0 = loop.time()
        results, left = await ask_until_enough(calls, {"known": 0.01}, 3.0, bool, enough)
        seconds = loop.time() - t0
        late = {key: await task for key, task in left.items()}  # the caller owns them: they ran on
        return results, set(left), late, seconds

    # "a" alone is not enough, "a" and "b" are: the tarpit gets SETTLED_GRACE more, "known" its own grace
    results, left, late, seconds = asyncio.run(scenario(lambda heard: {"a", "b"} <= heard))
    assert results == {"a": True, "b": True, "tarpit": None, "known": True}
    assert left == {"tarpit"} and late == {"tarpit": True}
    assert 0.3 <= seconds < 0.05 + SETTLED_GRACE + 0.5  # "known" answered at 0.3 s, within its grace
    # never enough: every answer is waited for, and nothing is left running
    results, left, late, seconds = asyncio.run(scenario(lambda heard: False))
    assert results == {"a": True, "b": True, "tarpit": True, "known": True} and left == set() and seconds >= 1.0
