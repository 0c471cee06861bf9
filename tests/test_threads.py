"""How a peer runs one-token steps (the thread and warm-up policy on measured costs, and a peer
kept warm giving transformers' logits and the cores back), and how many threads the client's head
keeps."""

import asyncio
import time

import pytest
import torch
import uvloop

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.generate.greedy import REVISIT, TRIALS, HeadWays, kept_way
from p2pfusion.client.generate.trials import Trials
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.peer.compute import StageCompute
from p2pfusion.peer.threads import DecodeSettings, StepCost, choose_decode_settings, shares_host, thread_options
from tests.conftest import reference_model
from tests.swarm import running_peers

MS = 1e-3


def costs(*rows: tuple[int, bool, float, float]) -> list[StepCost]:
    return [StepCost(threads, warm, busy * MS, idle * MS) for threads, warm, busy, idle in rows]


def test_a_machine_whose_threads_wake_slowly_decodes_on_one():
    # the Intel VM of docs/benchmarks.md: two threads win back to back and lose 4x after idle
    intel = costs((1, False, 16.5, 19.2), (2, False, 10.0, 41.6))
    assert choose_decode_settings(intel) == DecodeSettings(1, False)


def test_warm_threads_are_chosen_only_where_they_clearly_win():
    assert choose_decode_settings(costs(
        (1, False, 16.5, 19.2), (2, False, 10.0, 41.6), (2, True, 10.0, 10.8),
    )) == DecodeSettings(2, True)
    # spinning that saves a little after idle does not pay for the cores it takes
    assert choose_decode_settings(costs(
        (1, False, 16.5, 19.2), (2, False, 10.0, 41.6), (2, True, 10.0, 16.0),
    )) == DecodeSettings(1, False)


def test_a_machine_where_one_thread_is_as_fast_keeps_one():
    # this project's AMD EPYC VM: one thread about as fast as two, both after idle
    assert choose_decode_settings(costs(
        (1, False, 10.7, 11.6), (2, False, 10.4, 12.0), (2, True, 10.5, 11.4),
    )) == DecodeSettings(1, False)


def test_many_cores_use_as_many_threads_as_still_pay():
    assert choose_decode_settings(costs(
        (1, False, 20, 21), (2, False, 11, 12), (4, False, 6, 7), (8, False, 4, 5), (16, False, 4.2, 6),
        (16, True, 4.0, 4.8),
    )) == DecodeSettings(8, False)


def test_noise_does_not_buy_threads_but_many_users_do():
    assert choose_decode_settings(costs((1, False, 10, 12), (2, False, 9.6, 11.5))) == DecodeSettings(1, False)
    # as fast after idle, and much faster when steps follow each other (many users)
    assert choose_decode_settings(costs((1, False, 10, 12), (2, False, 6, 12))) == DecodeSettings(2, False)


def test_the_policy_needs_measurements_and_offers_every_power_of_two():
    with pytest.raises(ValueError):
        choose_decode_settings([])
    assert thread_options(1) == [1]
    assert thread_options(2) == [1, 2]
    assert thread_options(6) == [1, 2, 4, 6]
    assert thread_options(16) == [1, 2, 4, 8, 16]


def test_a_peer_stops_spinning_while_another_peer_serves_from_its_machine():
    mine = ["192.168.1.11:40001", "127.0.0.1:40001"]
    assert shares_host(mine, [["10.0.0.2:40002"], ["192.168.1.11:40002"]])
    assert not shares_host(mine, [["10.0.0.2:40002"], ["192.168.1.12:40001"]])
    assert shares_host(["[::1]:40001"], [["[::1]:40002"]])
    assert not shares_host(mine, [])
    compute = StageCompute(DecodeSettings(2, True), 1 << 20)
    try:
        assert compute.warm
        compute.share_host(True)
        assert not compute.warm
        compute.share_host(False)
        assert compute.warm
    finally:
        compute.shutdown()
    alone = StageCompute(DecodeSettings(1, True), 1 << 20)
    assert not alone.warm  # one thread has nothing to keep awake
    alone.shutdown()


IDS = [3, 17, 42, 99, 5]


async def _warm_decode(source):
    async with running_peers(source, [(0, 4)], decode_threads="2:warm") as ([peer], maddrs):
        swarm = await join_swarm(maddrs, client_mode=True)
        try:
            model = RemoteCausalLM.build(source, swarm)
            session = await model.open_session(16)
            logits = [model.logits(await session.step(model.embed(IDS)))]
            for token in (11, 12, 13, 14):
                await asyncio.sleep(0.02)  # a pipeline's gap between a session's steps
                logits.append(model.logits(await session.step(model.embed([token]))))
            await session.close()
            steps = peer.server.compute.stats.steps
            await asyncio.sleep(0.3)  # longer than any warm spin
            cpu = time.process_time()
            await asyncio.sleep(0.5)
            idle_cpu = time.process_time() - cpu
        finally:
            await swarm.shutdown()
    return torch.cat(logits, dim=1), steps, idle_cpu


def test_a_peer_kept_warm_gives_transformers_logits_and_the_cores_back(tiny_models):
    source = tiny_models["llama"]
    logits, steps, idle_cpu = uvloop.run(_warm_decode(source))
    with torch.no_grad():
        expected = reference_model(source)(torch.tensor([IDS + [11, 12, 13, 14]])).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    assert steps >= 5  # warm steps run on the compute thread, whose threads were kept spinning
    assert idle_cpu < 0.25  # spinning two threads would burn 1 s of CPU in those 0.5 s


def test_the_client_head_keeps_the_way_its_own_calls_found_faster():
    head = HeadWays([1, 2])
    # one-row calls: a second thread wakes slowly after the client's idle wait
    # eight-row calls: the product is large enough for two threads to pay, and bfloat16 pays
    # more where the CPU multiplies it natively; on four rows it is slow (no native support)
    seconds = {
        (1, (1, False)): 3e-3, (1, (2, False)): 11e-3,
        (8, (1, False)): 33e-3, (8, (2, False)): 17e-3, (8, (1, True)): 5e-3, (8, (2, True)): 4.8e-3,
        (4, (1, False)): 20e-3, (4, (2, False)): 12e-3, (4, (1, True)): 60e-3, (4, (2, True)): 40e-3,
    }
    for _ in range(4 * TRIALS):
        for rows in (1, 4, 8):
            way = head.way(rows)
            head.timed(rows, way, seconds[rows, way])
    assert head.way(1) == (1, False) and head.way(8) == (1, True) and head.way(4) == (2, False)
    assert head.way(12) == (1, True)  # 8 rows or more are one size
    # the hour changes: waking a second thread is cheap now, and the head notices within a few revisits
    seconds[1, (2, False)] = 1.5e-3
    ways = []
    for _ in range(REVISIT * (TRIALS + 1)):
        way = head.way(1)
        ways.append(way)
        head.timed(1, way, seconds[1, way])
    assert head.way(1) == (2, False)
    assert ways[:REVISIT].count((2, False)) <= 1  # before, one call in REVISIT tried it
    assert ways[-2 * REVISIT:].count((1, False)) <= 2  # after, one call in REVISIT tries the old way
    assert kept_way({(1, False): [1.0] * TRIALS, (2, False): [0.95] * TRIALS}) == (1, False)  # within the margin
    trying = Trials(TRIALS, REVISIT, kept_way)
    trying.of(1, [(1, False), (2, False)])
    for way, seconds, times in [((1, False), 1.0, TRIALS), ((2, False), 0.5, TRIALS - 1)]:
        for _ in range(times):
            trying.add(1, way, seconds)
    assert trying.decided(1) is None and trying.choose(1, []) == (2, False)  # still trying: its turn
