"""A peer keeps one OpenMP pool, its one-token steps', and a client one, its event loop's
(models/threads.py says why it matters)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import uvloop

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.threads import FreshThreads
from tests.swarm import peers_in_background

# Two peers of the default model on this process's main thread, its OS name set first: threads
# it starts inherit the name, libgomp's workers too, and Python's own threads are left out. The
# peers decode on one thread, so nothing they serve needs a pool that outlives its job, and no
# native thread of the loop's should be left once they serve (none is, once they have started).
PEERS = """
import asyncio, ctypes, os, sys, threading
ctypes.CDLL(None).prctl(15, b"peer-loop", 0, 0, 0)
import p2pfusion, uvloop
from p2pfusion.models.source import resolve_model
from tests.swarm import running_peers

def native_threads_of_the_loop():
    python = {t.native_id for t in threading.enumerate()}
    return sum(1 for t in os.listdir("/proc/self/task")
               if int(t) not in python and open(f"/proc/self/task/{t}/comm").read().strip() == "peer-loop")

async def main():
    async with running_peers(resolve_model(None), [(0, 15), (15, 30)], decode_threads="1") as (peers, maddrs):
        print(" ".join(maddrs), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await asyncio.sleep(0.5)  # the last prefill's thread ends
        print(native_threads_of_the_loop(), flush=True)

uvloop.run(main())
"""


async def _generate(maddrs: list[str], source) -> list[int]:
    swarm = await join_swarm(maddrs, client_mode=True)
    try:
        model = RemoteCausalLM.build(source, swarm)
        ids = model.encode("Name three colours.", chat=True)
        out = await model.generate(ids, 6, stop_at_eos=False)
        return out.token_ids
    finally:
        await swarm.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and names threads with prctl")
def test_serving_leaves_no_openmp_pool_beside_the_decode_threads(default_model):
    peers = subprocess.Popen([sys.executable, "-c", PEERS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        maddrs = peers.stdout.readline().split()
        assert maddrs, "the peers did not start"
        tokens = uvloop.run(_generate(maddrs, default_model))
        assert len(tokens) == 6
        peers.stdin.write("\n")
        peers.stdin.flush()
        # a prompt's chunks, loading, the benchmark, link probes and receipts ran torch here: any
        # pool of theirs still alive would throttle every decode step's workers
        assert peers.stdout.readline().strip() == "0"
    finally:
        peers.kill()
        peers.wait()


# A client on its main thread, named as PEERS' is once its tokenizer has started its own native
# threads, with two torch threads: its loop's pool holds one worker. It runs the first 15 layers
# itself and samples a quote, so that prompt lookup's drafts stand and are judged by sampling; it
# prints the native threads named as the loop (pools' workers) once the generation is over, and
# the swarm steps it took.
CLIENT = """
import asyncio, ctypes, os, sys, threading
import torch
torch.set_num_threads(2)
import uvloop
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import resolve_model

def native_threads_of_the_loop():
    python = {t.native_id for t in threading.enumerate()}
    return sum(1 for t in os.listdir("/proc/self/task")
               if int(t) not in python and open(f"/proc/self/task/{t}/comm").read().strip() == "client-loop")

async def main():
    swarm = await join_swarm(sys.argv[1:], client_mode=True)
    model = RemoteCausalLM.build(resolve_model(None), swarm, local_layers=15)
    quote = "The quick brown fox jumps over the lazy dog, and the dog sleeps on by the river bank."
    ids = model.encode(f"Repeat this sentence exactly, and nothing else: {quote}", chat=True)
    ctypes.CDLL(None).prctl(15, b"client-loop", 0, 0, 0)  # after the tokenizer's own native threads
    out = await model.generate(ids, 20, temperature=0.05, seed=1, stop_at_eos=False)
    await asyncio.sleep(0.5)  # the last job's thread ends
    print(native_threads_of_the_loop(), out.steps, len(out.token_ids), flush=True)
    await swarm.shutdown()

uvloop.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and names threads with prctl")
def test_a_client_keeps_one_openmp_pool_through_local_layers_and_sampled_drafts(default_model):
    with peers_in_background(default_model, [(0, 15), (15, 30)]) as (_, maddrs, _):
        done = subprocess.run([sys.executable, "-c", CLIENT, *maddrs], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    workers, steps, tokens = map(int, done.stdout.split())
    assert steps < tokens  # drafts stood, so the sampled judge ran
    # the local layers' decode steps, the sampled judge and the local prefill ran torch: only the
    # loop's own pool, of one worker, may be left
    assert workers <= 1


def test_fresh_threads_run_each_job_on_a_thread_that_ends_with_it():
    lanes = FreshThreads("test-fresh")
    first = lanes.submit(threading.get_native_id).result(timeout=10)
    second = lanes.submit(threading.get_native_id).result(timeout=10)
    lanes.shutdown(wait=True)
    live = {thread.native_id for thread in threading.enumerate()}
    assert first != threading.get_native_id() and first not in live and second not in live
    failed = lanes.submit(int, "not a number")
    with pytest.raises(ValueError):
        failed.result(timeout=10)  # the job's own error reaches the caller
