"""Sessions spread over a stage's peers by the load each announces, and a peer without room says
"busy" with a retry hint: routing as pure functions, then the whole path on real peers."""

import asyncio
import logging
import time

import pytest
import torch
import uvloop
from hypothesis import given
from hypothesis import strategies as st

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.route.planner import FULL_SECONDS, find_route, load_seconds
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import PeerBusy, RequestError
from p2pfusion.net import messages as m
from p2pfusion.peer.streams import error_for
from p2pfusion.peer.upkeep import Upkeep, load_moved
from tests.conftest import reference_model
from tests.policy_records import rec
from tests.swarm import start_peer, stop_peer

KIB = 1 << 10
IDS = [3, 17, 42, 99, 5, 250, 7]
NEW_TOKENS = 8


def _loaded(name: str, throughput: float = 10.0, **load):
    return [rec(0, 4, throughput=throughput, name=name, **load), rec(4, 8, name="tail")]


def test_a_busy_answer_carries_a_bounded_retry_hint_to_the_client():
    busy = m.Error("peer p busy: no room", failed_peer="p", code=m.ErrorCode.BUSY, retry_after=2.0)
    assert m.from_header(m.to_header(busy)) == busy
    assert error_for(PeerBusy("peer p busy: no room", "p", 2.0)) == busy  # as the peer answers
    with pytest.raises(PeerBusy) as raised:
        m.raise_for_error(busy)
    assert raised.value.retry_after == 2.0 and raised.value.peer_id == "p"
    for bad in (-1.0, float("nan"), float("inf"), m.MAX_RETRY_AFTER + 1, "soon", True):
        with pytest.raises(RequestError, match="retry_after"):
            m.from_header({**m.to_header(busy), "retry_after": bad})


def test_a_loaded_peer_costs_more_and_a_full_one_is_a_last_resort():
    step = 0.1
    idle = rec(0, 4, cache_total=100 * KIB, token_bytes=KIB)
    assert load_seconds(idle, step, tokens=10) == 0.0
    assert load_seconds(rec(0, 4, sessions=3), step) == 3 * step  # no batching announced: steps one by one
    batching = rec(0, 4, sessions=3, batch_rate=400.0)  # 4 layers at 400 tokens/s each in a batch
    assert load_seconds(batching, step) == 3 * 4 / 400.0
    assert load_seconds(rec(0, 4, queued=2), step) == 2 * step
    near = rec(0, 4, cache_used=90 * KIB, cache_total=100 * KIB, token_bytes=KIB)
    assert 0 < load_seconds(near, step, tokens=5) < FULL_SECONDS
    assert load_seconds(near, step, tokens=11) == FULL_SECONDS  # the session does not fit

    fast_but_full = _loaded("full", 20.0, cache_used=60 * KIB, cache_total=64 * KIB, token_bytes=KIB)
    slow = _loaded("slow", 5.0, cache_total=64 * KIB, token_bytes=KIB)
    records = fast_but_full + slow[:1]
    assert find_route(records, 8, length=16)[0].peer_id == "slow"
    assert find_route(records, 8, length=4)[0].peer_id == "full"  # 4 tokens still fit there
    assert find_route(records, 8, length=16, banned={"slow"})[0].peer_id == "full"  # the only one left
    # what this client holds through a peer counts before the peer's record says so
    twins = _loaded("a")[:1] + _loaded("b")
    assert find_route(twins, 8, own={"a": 1})[0].peer_id == "b"
    assert find_route(twins, 8, own={"b": 1})[0].peer_id == "a"


@given(
    st.integers(0, 50), st.integers(0, 50), st.integers(0, 1000), st.integers(0, 64),
    st.integers(0, 5), st.integers(0, 5), st.integers(0, 200),
)
def test_more_load_never_costs_less(sessions, queued, used, tokens, more_sessions, more_queued, more_used):
    def seconds(s, q, u):
        return load_seconds(rec(0, 4, sessions=s, queued=q, cache_used=u, cache_total=2000, token_bytes=16), 0.05, tokens)

    assert seconds(sessions, queued, used) <= seconds(sessions + more_sessions, queued + more_queued, used + more_used)


@given(st.integers(2, 5), st.integers(1, 40), st.lists(st.floats(0.0, 0.002), min_size=5, max_size=5))
def test_sessions_spread_evenly_over_equivalent_peers(peers, sessions, rtts):
    """Each new session sees the others in the records (or in what its own client holds)."""
    held = {f"p{i}": 0 for i in range(peers)}
    tail = rec(4, 8, name="tail")
    for _ in range(sessions):
        records = [rec(0, 4, throughput=10.0, name=p, sessions=n) for p, n in held.items()] + [tail]
        pick = find_route(records, 8, rtts={f"p{i}": rtt for i, rtt in enumerate(rtts)})[0].peer_id
        held[pick] += 1
    # sessions outweigh small differences in ping time: none is left idle while others double up
    assert max(held.values()) - min(held.values()) <= 1


def test_a_peer_announces_early_only_when_its_load_moved_a_lot():
    announced = rec(0, 4, sessions=8, cache_used=100, cache_total=800)
    same = dict(sessions=9, cache_used=150, cache_total=800)
    assert not load_moved(announced, same)
    assert load_moved(announced, {**same, "sessions": 10})  # a quarter more sessions
    assert load_moved(announced, {**same, "cache_used": 200})  # an eighth of the budget
    assert load_moved(rec(0, 4, cache_total=800), dict(sessions=1, cache_used=10, cache_total=800))  # the first


async def _busy_then_elsewhere(source) -> dict:
    # the tiny model reserves 1 KiB of KV cache a token through its 4 layers
    full = await start_peer(source, [], (0, 4), throughput="1000", cache_memory=70 * KIB, client_share=1.0)
    peers, clients, seen = [full], [], {"full": full.swarm.peer_id}
    try:
        maddrs = await full.swarm.maddrs()
        spare = await start_peer(source, maddrs, (0, 4), throughput="10")
        peers.append(spare)
        seen["spare"] = spare.swarm.peer_id

        async def client() -> RemoteCausalLM:
            model = RemoteCausalLM.build(source, await join_swarm(maddrs, client_mode=True), compression="none", verify=0.0)
            model.core.health.observed.clear()  # other tests' peers of this model: not these, and no cap on them
            clients.append(model)
            return model

        async def generate(model: RemoteCausalLM | None = None) -> list[int]:
            model = model or await client()
            return list((await model.generate(IDS, NEW_TOKENS, stop_at_eos=False, decode=False)).token_ids)

        held = await (await client()).open_session(64)  # 64 of the full peer's 70 KiB
        seen["held_on"] = [r.peer_id for r in held.session.route]
        seen["routed"] = await generate()
        served = spare.server.sessions_opened
        await Upkeep(full).announce_load()  # as its upkeep does within a second of a change
        seen["by_load"] = await generate()
        seen["spare_took"] = spare.server.sessions_opened - served
        seen["full_took"] = full.server.sessions_opened
        peers.remove(spare)
        await stop_peer(spare)  # now only the full peer serves these layers: the next session waits for room

        waiting = await client()

        async def release():  # once the full peer told the waiting client it is busy
            while full.swarm.peer_id not in waiting.core.health.busy:
                await asyncio.sleep(0.05)
            await held.close()

        t0 = time.perf_counter()
        seen["waited"], _ = await asyncio.gather(generate(waiting), release())
        seen["wait_seconds"] = time.perf_counter() - t0
        return seen
    finally:
        for model in clients:
            await model.core.swarm.shutdown()
        for peer in peers:
            await stop_peer(peer)


def test_a_full_peer_answers_busy_and_the_session_goes_to_another_of_its_layers(tiny_models, caplog):
    source = tiny_models["llama"]
    with torch.no_grad():
        reference = reference_model(source).generate(torch.tensor([IDS]), max_new_tokens=NEW_TOKENS, do_sample=False)
    reference = reference[0, len(IDS):].tolist()
    with caplog.at_level(logging.INFO):
        seen = uvloop.run(_busy_then_elsewhere(source))
    assert seen["held_on"] == [seen["full"]]  # the faster peer took the first session
    assert seen["routed"] == reference and seen["by_load"] == reference and seen["waited"] == reference
    busy = [r.getMessage() for r in caplog.records if "busy" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(busy) == 2, busy  # one line each time, for the user: where the layers went, then the wait
    assert "no room for a 15 KiB session (64 KiB of 70 KiB reserved)" in busy[0]
    assert f"layers 0:4 go to {seen['spare']} instead" in busy[0]
    # once its record shows it full, the next client goes straight to the other peer
    assert seen["spare_took"] == 1 and seen["full_took"] == 1
    # with no other peer of its layers, a client waits for room (the peer's hint: 2 s), then is served
    assert "every route needs a busy peer" in busy[1] and "waiting for room" in busy[1]
    assert 2.0 <= seen["wait_seconds"] < 15.0
