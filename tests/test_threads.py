"""How a peer runs one-token steps (the thread and warm-up policy on measured costs, and a peer
kept warm giving transformers' logits and the cores back), and how many threads the client's head
keeps."""

import asyncio
import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch
import uvloop

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.generate.greedy import REVISIT, TRIALS, HeadWays, kept_way
from p2pfusion.models.trials import Trials
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.peer.benchmark import compute_benchmark, device_name
from p2pfusion.peer.compute import StageCompute
from p2pfusion.peer.threads import (
    STEP_REVISIT, STEP_TRIALS, DecodeSettings, DecodeThreads, StepCost, choose_decode_settings, shares_host, thread_options,
)
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


def serve(threads: DecodeThreads, steps: int, seconds, rows: int = 1) -> tuple[list[int], list[str]]:
    """`steps` steps of `rows` rows timed by `seconds(threads)`: the counts they ran on, and what was logged."""
    used, said = [], []
    for _ in range(steps):
        n = threads.threads(rows)
        used.append(n)
        message = threads.timed(rows, n, seconds(n))
        if message:
            said.append(message)
    return used, said


def test_a_peer_corrects_a_stale_benchmark_from_its_served_steps():
    # the Intel VM of docs/benchmarks.md: a benchmark cached during a test run chose one thread,
    # where served steps take 21 ms on one and 14 ms on two
    threads = DecodeThreads(DecodeSettings(1, False, tuned=True), 2)
    used, said = serve(threads, 2 * STEP_TRIALS, {1: 21e-3, 2: 14e-3}.get)
    assert used == [1] * STEP_TRIALS + [2] * STEP_TRIALS  # the benchmark's count first, then the other
    assert said == ["steps of 1 row run on 2 threads (medians as served: 1 thread 21.00 ms; 2 threads 14.00 ms)"]
    used, said = serve(threads, 4 * STEP_REVISIT, {1: 21e-3, 2: 14e-3}.get)
    assert used.count(1) == 4 and said == []  # one step in STEP_REVISIT looks again, and nothing changes
    # two threads slow down to within MARGIN of one but stay faster: one is timed again, and
    # there is no turn-taking at each look
    used, said = serve(threads, STEP_TRIALS * STEP_REVISIT, {1: 18.4e-3, 2: 17.0e-3}.get)
    assert said == [] and used[:2 * STEP_TRIALS].count(1) == STEP_TRIALS
    # the machine gets busy (others' work on the second core): two threads now wait for it
    used, said = serve(threads, STEP_REVISIT, {1: 21e-3, 2: 40e-3}.get)
    assert len(said) == 1 and said[0].startswith("steps of 1 row run on 1 thread (medians as served: 1 thread 21.00 ms")
    assert used.index(1) <= STEP_TRIALS  # its own latest steps say so within a few steps
    assert used[2 * STEP_TRIALS:].count(2) <= 1
    # and quiet again, one thread's steps slow down by more than MOVED: two are timed again at
    # once, not left to one step in STEP_REVISIT
    used, said = serve(threads, 4 * STEP_TRIALS, {1: 30e-3, 2: 16e-3}.get)
    assert len(said) == 1 and said[0].startswith("steps of 1 row run on 2 threads") and said[0].endswith("2 threads 16.00 ms)")
    assert used[-2 * STEP_TRIALS:].count(1) <= 1


def test_served_steps_keep_the_fewest_threads_unless_more_clearly_pay():
    # the AMD VM: one thread as fast as two
    threads = DecodeThreads(DecodeSettings(2, False, tuned=True), 2)
    used, said = serve(threads, 2 * STEP_TRIALS + STEP_REVISIT, {1: 11.6e-3, 2: 11.0e-3}.get)
    assert said[-1].startswith("steps of 1 row run on 1 thread") and used[-STEP_REVISIT:].count(2) <= 1
    # sizes of step are decided apart: batches of 8 rows do pay for four threads of eight
    many = DecodeThreads(DecodeSettings(1, False, tuned=True), 8)
    cost = {1: 40e-3, 2: 21e-3, 4: 12e-3, 8: 11.5e-3}.get
    used, said = serve(many, 4 * STEP_TRIALS + STEP_REVISIT, cost, rows=8)
    assert said[-1].startswith("steps of 8+ rows run on 4 threads")
    assert many.threads(1) == 1 and many.threads(8) == 4


def test_threads_fixed_by_the_operator_are_never_tuned():
    threads = DecodeThreads(DecodeSettings(2, False), 4)
    used, said = serve(threads, 3 * STEP_REVISIT, {2: 50e-3}.get)
    assert set(used) == {2} and said == []


def test_a_benchmark_cached_on_another_machine_is_measured_again(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("P2PFUSION_CACHE", str(tmp_path))
    source = tiny_models["llama"]
    measured = compute_benchmark(source, "cpu", torch.float32)
    assert measured.device_name == device_name("cpu")
    assert compute_benchmark(source, "cpu", torch.float32) == measured  # reused: the file is read back
    (cached,) = tmp_path.glob("benchmarks/*.json")
    cached.write_text(json.dumps({**json.loads(cached.read_text()), "device_name": "Another CPU", "decode_threads": 99}))
    again = compute_benchmark(source, "cpu", torch.float32)
    assert again.device_name == device_name("cpu") and again.decode_threads in thread_options(torch.get_num_threads())
    assert json.loads(cached.read_text())["device_name"] == device_name("cpu")


SPIN = "import os; print(os.environ.get('GOMP_SPINCOUNT', 'default'))"


@pytest.mark.parametrize("first, spin", [("import p2pfusion", "10000"), ("import torch, p2pfusion", "default")])
def test_importing_the_package_before_torch_sets_openmp_s_spin(first, spin):
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", f"{first}; {SPIN}"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == spin  # torch loaded first has read the default already: it is left alone


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


async def _tuned_decode(source, tokens: int):
    async with running_peers(source, [(0, 2), (2, 4)]) as (peers, maddrs):
        swarm = await join_swarm(maddrs, client_mode=True)
        try:
            result = await RemoteCausalLM.build(source, swarm, speculate="off").generate(IDS, tokens, stop_at_eos=False, decode=False)
        finally:
            await swarm.shutdown()
    return list(result.token_ids)


def test_peers_tune_their_threads_on_served_steps_and_still_give_transformers_tokens(tiny_models, caplog):
    source, tokens = tiny_models["llama"], 2 * STEP_TRIALS + 8
    with caplog.at_level(logging.INFO, logger="p2pfusion.peer.compute"):
        generated = uvloop.run(_tuned_decode(source, tokens))
    with torch.no_grad():
        expected = reference_model(source).generate(torch.tensor([IDS]), max_new_tokens=tokens, do_sample=False)
    assert generated == expected[0, len(IDS):].tolist()  # steps on either count of threads
    decided = [r.getMessage() for r in caplog.records if "one-token steps: steps of 1 row run on" in r.getMessage()]
    if torch.get_num_threads() > 1:  # each peer tried both counts on its own steps, and said which it kept
        assert len(decided) >= 2 and all("medians as served: 1 thread" in message for message in decided), decided


def test_the_client_head_keeps_the_way_its_own_calls_found_faster():
    head = HeadWays([1, 2])
    # one-row calls: a second thread wakes slowly after the client's idle wait, and the float16
    # screen beats the float32 product
    # eight-row calls: the product is large enough for two threads to pay, and bfloat16 pays
    # more where the CPU multiplies it natively; on four rows it is slow (no native support)
    seconds = {
        (1, (1, True)): 3e-3, (1, (2, True)): 11e-3, (1, (1, False)): 4e-3, (1, (2, False)): 12e-3,
        (8, (1, False)): 33e-3, (8, (2, False)): 17e-3, (8, (1, True)): 5e-3, (8, (2, True)): 4.8e-3,
        (4, (1, False)): 20e-3, (4, (2, False)): 12e-3, (4, (1, True)): 60e-3, (4, (2, True)): 40e-3,
    }
    for _ in range(4 * TRIALS):
        for rows in (1, 4, 8):
            way = head.way(rows)
            head.timed(rows, way, seconds[rows, way])
    assert head.way(1) == (1, True) and head.way(8) == (1, True) and head.way(4) == (2, False)
    assert head.way(12) == (1, True)  # 8 rows or more are one size
    # the hour changes: waking a second thread is cheap now, and the head notices within a few revisits
    seconds[1, (2, True)] = 1.5e-3
    ways = []
    for _ in range(REVISIT * (TRIALS + 1) * 3):
        way = head.way(1)
        ways.append(way)
        head.timed(1, way, seconds[1, way])
    assert head.way(1) == (2, True)
    assert ways[:REVISIT].count((2, True)) <= 1  # before, one call in REVISIT tried it
    assert ways[-3 * REVISIT:].count((1, True)) <= 2  # after, one call in REVISIT tries another way
    assert kept_way({(1, False): [1.0] * TRIALS, (2, False): [0.95] * TRIALS}) == (1, False)  # within the margin
    # a CPU whose float16 product is no faster: one row goes through the float32 product
    intel = HeadWays([1, 2])
    cost = {(1, True): 10e-3, (2, True): 6.2e-3, (1, False): 9.5e-3, (2, False): 5.0e-3}
    for _ in range(4 * TRIALS):
        way = intel.way(1)
        intel.timed(1, way, cost[way])
    assert intel.way(1) == (2, False)
    trying = Trials(TRIALS, REVISIT, kept_way)
    trying.of(1, [(1, False), (2, False)])
    for way, seconds, times in [((1, False), 1.0, TRIALS), ((2, False), 0.5, TRIALS - 1)]:
        for _ in range(times):
            trying.add(1, way, seconds)
    assert trying.decided(1) is None and trying.choose(1, []) == (2, False)  # still trying: its turn

