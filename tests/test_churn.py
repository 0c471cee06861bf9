"""Churn with real peers on 127.0.0.1: peers die (kill -9) or leave mid-generation, backups take
over, newcomers fill gaps, and the generated tokens stay exactly those of transformers."""

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import uvloop

from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.route.failover import MIN_STEP_TIMEOUT
from p2pfusion.dht.records import PeerState
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.peer.upkeep import Upkeep
from tests.conftest import reference_model
from tests.swarm import running_peers, start_peer, stop_peer
from tests.tiny_chat import with_chat_tokenizer

KILL_AT = 8  # tokens into the generation
PROMOTION_POLLS = 20  # seconds to wait for the replacement to announce itself online
FIXED = ["--throughput", "100"]  # skip the benchmark: these tests are about churn, not speed
MIDDLE = (1, 3)  # the stage killed mid-generation, of the tiny 4-layer Llama


def _reference(source, ids, tokens=32):
    with torch.no_grad():
        out = reference_model(source).generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
    return out[0, len(ids):].tolist()


async def _generate(source, maddrs, ids, on_token):
    client = await join_swarm(maddrs, client_mode=True)
    try:
        model = RemoteCausalLM.build(source, client, verify=0.0)  # failover timing, not checks
        return await model.generate(ids, 32, on_token=on_token)
    finally:
        await client.shutdown()


async def _prompt_logits(source, maddrs, ids, verify=None):
    """The logits a new client gets for `ids` through the swarm, in one step of a session."""
    client = await join_swarm(maddrs, client_mode=True)
    try:
        model = RemoteCausalLM.build(source, client) if verify is None else RemoteCausalLM.build(source, client, verify=verify)
        session = await model.open_session(8)
        logits = model.logits(await session.step(model.embed(ids)))
        await session.close()
        return logits
    finally:
        await client.shutdown()


async def _states(maddrs, model):
    client = await join_swarm(maddrs, client_mode=True)
    try:
        return {r.peer_id: (r.start, r.end, r.state.value) for r in await client.lookup(model)}
    finally:
        await client.shutdown()


def _peer_id(maddrs: list[str]) -> str:
    return maddrs[0].rsplit("/p2p/", 1)[1]


@pytest.fixture(scope="module")
def llama(tiny_models, tmp_path_factory):
    """The tiny Llama with a tokenizer: a generation decodes its text at the end."""
    return with_chat_tokenizer(tiny_models["llama"], tmp_path_factory.mktemp("churn") / "llama")


def _family(proc) -> list[int]:
    """A peer's process and its children (its libp2p daemon)."""
    return [proc.pid, *map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())]


def _kill_middle_during_generation(source, forks, with_backup: bool, freeze: bool = False):
    """Kill (or, `freeze`, SIGSTOP with its daemon: a host suspended, its connections open) the
    middle stage's peer KILL_AT tokens in; returns the prompt, the result, the peers' states, the
    replacement's state, and the longest gap between two tokens."""
    ids = list(range(3, 19))
    with LocalSwarm(model=str(source.folder), forks=forks) as swarm:
        first = swarm.launch((0, 1), FIXED)
        swarm.wait_ready(first)
        middle, last = swarm.launch(MIDDLE, FIXED), swarm.launch((3, 4), FIXED)
        extra = [swarm.launch(MIDDLE, [*FIXED, "--backup"])] if with_backup else []
        for proc in (middle, last, *extra):
            swarm.wait_ready(proc)
        joined, stamps, family = [], [], _family(middle)

        def on_token(_token):
            stamps.append(time.monotonic())
            if len(joined) == 0 and on_token.count == KILL_AT:
                for pid in family if freeze else [middle.pid]:
                    os.kill(pid, signal.SIGSTOP if freeze else signal.SIGKILL)  # no goodbye, no offline record
                if not with_backup:
                    # a volunteer arrives without --layers; it must find the gap by itself
                    joined.append(swarm.launch(None, [*FIXED, "--max-layers", "2"]))
            on_token.count += 1

        on_token.count = 0
        try:
            result = uvloop.run(_generate(source, swarm.maddrs, ids, on_token))
        finally:
            for pid in family:
                with contextlib.suppress(ProcessLookupError):  # a killed peer's daemon is gone already
                    os.kill(pid, signal.SIGKILL)  # a stopped process takes no SIGTERM
        # the peer that took over: the backup, or the newcomer; it announces itself within seconds,
        # which may be after the generation ended
        replacement = _peer_id(swarm.wait_ready((extra or joined)[0]))
        for _ in range(PROMOTION_POLLS):
            states = uvloop.run(_states(swarm.maddrs, source.key))
            if states.get(replacement, (0, 0, ""))[2] == "online":
                break
            time.sleep(1.0)
    return ids, result, states, states[replacement], max(b - a for a, b in zip(stamps, stamps[1:]))


def test_kill_middle_peer_with_backup_gives_identical_tokens(llama, forks):
    ids, result, _, replacement, _ = _kill_middle_during_generation(llama, forks, with_backup=True)
    assert result.token_ids == _reference(llama, ids) and len(result.token_ids) == 32
    assert result.recoveries >= 1
    assert replacement == (*MIDDLE, "online")  # the backup promoted itself


def test_a_frozen_middle_peer_is_found_by_a_ping_not_waited_out(llama, forks):
    """Its connections stay open and nothing answers: the client pings the route's hops once a
    step runs long, blames the one that is silent, and moves to the backup well before the step's
    timeout (which, naming no peer, used to send the next route through the frozen peer again)."""
    ids, result, _, replacement, gap = _kill_middle_during_generation(llama, forks, with_backup=True, freeze=True)
    assert result.token_ids == _reference(llama, ids) and len(result.token_ids) == 32
    assert result.recoveries >= 1 and replacement == (*MIDDLE, "online")
    assert gap < MIN_STEP_TIMEOUT, gap


def test_kill_middle_peer_without_backup_newcomer_fills_the_gap(llama, forks):
    ids, result, states, replacement, _ = _kill_middle_during_generation(llama, forks, with_backup=False)
    assert result.token_ids == _reference(llama, ids) and len(result.token_ids) == 32
    assert replacement == (*MIDDLE, "online")  # the newcomer took exactly the killed peer's layers
    assert (0, 1, "online") in states.values()


def test_new_peer_picks_the_weak_stage(tiny_models):
    source = tiny_models["llama"]

    async def scenario():
        strong = await start_peer(source, [], (0, 2), throughput="1000")
        maddrs = await strong.swarm.maddrs()
        weak = await start_peer(source, maddrs, (2, 4), throughput="10")
        newcomer = await start_peer(source, maddrs, None, throughput="100", max_layers=2)
        try:
            return (newcomer.record.start, newcomer.record.end, newcomer.record.state)
        finally:
            for peer in (newcomer, weak, strong):
                await stop_peer(peer)

    assert uvloop.run(scenario()) == (2, 4, PeerState.ONLINE)


def test_one_backup_promotes_when_its_stage_loses_its_peer(tiny_models):
    source = tiny_models["qwen2"]
    ids = [3, 17, 42, 99]

    async def scenario():
        async with running_peers(source, [(0, 4)]) as ([active], maddrs):
            backups = [await start_peer(source, maddrs, (0, 4), backup=True, watch_period=0.5) for _ in range(2)]
            try:
                async with Upkeep(backups[0]), Upkeep(backups[1]):
                    await asyncio.sleep(1.5)  # each backup has seen its stage served
                    await active.leave()
                    await asyncio.sleep(8.0)  # rank 0 acts at once, rank 1 three seconds later
                    states = sorted(b.record.state.value for b in backups)
                    logits = await _prompt_logits(source, maddrs, ids)
            finally:
                for peer in backups:
                    await stop_peer(peer)
        return states, logits

    states, logits = uvloop.run(scenario())
    assert states == ["backup", "online"]
    with torch.no_grad():
        expected = reference_model(source)(torch.tensor([ids])).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_graceful_leave_moves_the_session_without_error(tiny_models):
    source = tiny_models["mistral"]
    ids = [3, 17, 42, 99, 5]

    async def scenario():
        async with running_peers(source, [(0, 2), (2, 4), (2, 4)]) as (peers, maddrs):
            client = await join_swarm(maddrs, client_mode=True)
            model = RemoteCausalLM.build(source, client)
            leaving = []

            def on_token(_token):
                on_token.count += 1
                if on_token.count == 4:
                    session_peers = [p for p in peers[1:] if p.server.sessions]
                    leaving.append(asyncio.ensure_future(session_peers[0].leave()))

            on_token.count = 0
            try:
                result = await model.generate(ids, 12, on_token=on_token, stop_at_eos=False, decode=False)
                await asyncio.gather(*leaving)
            finally:
                await client.shutdown()
            return result

    result = uvloop.run(scenario())
    assert result.token_ids == _reference(source, ids, 12)
    assert result.recoveries == 0  # it moved on notice, with no failure


def test_a_peer_that_moves_away_and_back_is_used_again(tiny_models):
    """The only peer of a stage tells the session it is leaving, reloads, and serves again: the
    session waits for it and goes on through it, instead of avoiding it for good."""
    source = tiny_models["llama"]
    ids = [3, 17, 42, 99, 5]

    async def scenario():
        async with running_peers(source, [(0, 2), (2, 4)]) as (peers, maddrs):
            client = await join_swarm(maddrs, client_mode=True)
            model = RemoteCausalLM.build(source, client)
            try:
                session = await model.open_session(32)
                tokens = [await model.next_token(await session.step(model.embed(ids)), 0.0, None)]
                move = asyncio.ensure_future(peers[1].move(2, 4, overlap=False))
                while not peers[1].server.draining:  # it has told the session it is leaving
                    await asyncio.sleep(0.01)
                for _ in range(11):
                    tokens.append(await model.next_token(await session.step(model.embed(tokens[-1:])), 0.0, None))
                await move
                await session.close()
            finally:
                await client.shutdown()
            return tokens, peers[1].record.state

    tokens, state = uvloop.run(scenario())
    assert tokens == _reference(source, ids, 12)
    assert state == PeerState.ONLINE


@contextlib.asynccontextmanager
async def _stages_and_a_backup(source):
    """Peers on 0:2 and 2:4 of `source`, and a warm backup of 2:4: (peers, maddrs, backup)."""
    async with running_peers(source, [(0, 2), (2, 4)]) as (peers, maddrs):
        backup = await start_peer(source, maddrs, (2, 4), backup=True)
        try:
            yield peers, maddrs, backup
        finally:
            await stop_peer(backup)


async def _eight_tokens(source, maddrs, ids, **settings):
    client = await join_swarm(maddrs, client_mode=True)
    try:
        return await RemoteCausalLM.build(source, client, **settings).generate(ids, 8, stop_at_eos=False, decode=False)
    finally:
        await client.shutdown()


def test_a_session_opening_on_a_crashed_peers_stage_goes_through_its_warm_backup(tiny_models):
    """A peer crashes and its record still says online. A client that opens a session now finds
    it silent; the stage's warm backup, not promoted yet, serves the session, and the tokens are
    transformers' own (before, opening failed until the backup promoted)."""
    source = tiny_models["llama"]
    ids = [5, 17, 42, 99, 3]

    async def scenario():
        async with _stages_and_a_backup(source) as (peers, maddrs, backup):
            crashed = peers.pop()
            await crashed.server.stop()  # no goodbye: its record stays online until it expires
            await crashed.swarm.shutdown()
            return await _eight_tokens(source, maddrs, ids), backup.record.state

    result, state = uvloop.run(scenario())
    assert result.token_ids == _reference(source, ids, 8)
    assert state == PeerState.BACKUP  # nobody promoted it: the client routed through a warm backup


def test_a_step_that_fails_on_a_peers_bug_is_asked_again_through_the_backup(tiny_models):
    """A peer whose own code fails mid-generation (a bug, not the request's fault) answers the
    step with an error; the client asks for a second opinion through the stage's warm backup, the
    session goes on there, and the tokens are transformers' own."""
    source = tiny_models["llama"]
    ids = [5, 17, 42, 99, 3]

    async def scenario():
        async with _stages_and_a_backup(source) as (peers, maddrs, _):
            compute, steps = peers[1].server.compute, []
            forward = compute.forward

            async def buggy(session, inputs):
                steps.append(inputs)
                if len(steps) == 3:
                    raise KeyError("a bug")
                return await forward(session, inputs)

            compute.forward = buggy
            return await _eight_tokens(source, maddrs, ids, verify=0.0), len(steps)

    result, steps = uvloop.run(scenario())
    assert steps == 3  # the peer with the bug was asked nothing after its failure
    assert result.token_ids == _reference(source, ids, 8)


def test_backups_piled_onto_one_stage_spread_and_the_moved_one_takes_over(tiny_models):
    """Two backups joined when 0:2 was the stage most at risk; then 2:4 lost one of its two peers.
    The backup that would promote last keeps 2:4 warm instead, and when 2:4 loses its last peer it
    takes over: a session through it computes transformers' logits."""
    source = tiny_models["llama"]
    ids = [3, 17, 42, 99]

    async def scenario():
        async with running_peers(source, [(0, 2), (2, 4), (2, 4)]) as ([_, second, third], maddrs):
            backups = [await start_peer(source, maddrs, None, backup=True, max_layers=2) for _ in range(2)]
            try:
                assert [(b.record.start, b.record.end) for b in backups] == [(0, 2), (0, 2)]
                await third.leave()
                upkeeps = [Upkeep(b) for b in backups]
                for upkeep in upkeeps:
                    await upkeep.rebalance()
                places = {b.record.peer_id: (b.record.start, b.record.end, b.record.state) for b in backups}
                (moved,) = [b for b in backups if b.record.start == 2]
                await upkeeps[backups.index(moved)].watch()  # it sees 2:4 served
                await second.leave()
                await upkeeps[backups.index(moved)].watch()
                logits = await _prompt_logits(source, maddrs, ids, verify=0.0)
                return places, moved.record.peer_id, moved.record.state, logits
            finally:
                for peer in backups:
                    await stop_peer(peer)

    places, moved, state, logits = uvloop.run(scenario())
    last = max(places)  # equal speeds: the higher peer id promotes last
    assert places == {p: ((2, 4) if p == last else (0, 2)) + (PeerState.BACKUP,) for p in places}
    assert moved == last and state == PeerState.ONLINE  # the only peer of 2:4 left: it served the session
    with torch.no_grad():
        expected = reference_model(source)(torch.tensor([ids])).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_a_serving_peer_moves_to_a_gap_nobody_guards(tiny_models):
    """Layers 2:4 lose their only peer, with no backup: the peer that shares 0:2 with a slower one
    moves there (its watch), and a session through the two computes transformers' logits."""
    source = tiny_models["llama"]
    ids = [3, 17, 42, 99]

    async def scenario():
        async with running_peers(source, [(0, 2)], throughput="10") as (_, maddrs):
            last = await start_peer(source, maddrs, (2, 4), throughput="1000")
            mover = await start_peer(source, maddrs, None, max_layers=2)  # 0:2 is the bottleneck
            try:
                placed = (mover.record.start, mover.record.end)
                upkeep = Upkeep(mover)
                await last.leave()
                await upkeep.watch()
                logits = await _prompt_logits(source, maddrs, ids, verify=0.0)
                return placed, (mover.record.start, mover.record.end, mover.record.state), logits
            finally:
                await stop_peer(mover)
                await stop_peer(last)

    placed, now, logits = uvloop.run(scenario())
    assert placed == (0, 2) and now == (2, 4, PeerState.ONLINE)
    with torch.no_grad():
        expected = reference_model(source)(torch.tensor([ids])).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
