"""How the swarm heals: stall of a generation when a peer dies, time to full coverage, balance quality.

1. Stall: a greedy generation through a local swarm of the default model; after KILL_AT tokens the
   peer of one stage gets SIGKILL (with `--freeze`: SIGSTOP, to it and its libp2p daemon, as a
   host suspended or gone without a reset: its connections stay open and nothing answers). The stall is the longest gap between two tokens minus the
   median gap of the same run (the uninterrupted pace is the reference). Each run's tokens are
   compared with transformers' own greedy generation; a run that raises or differs is a failure.
   Two setups:
   - warm backup: peers on 0:10, 10:20, 20:30 and a `--backup` on 10:20; the 10:20 peer dies;
   - no backup: three peers placed by the balancer with room for 20 layers each (0:20, 20:30,
     0:20); the 20:30 peer dies, and one 0:20 peer must move there by itself.
2. Coverage: the no-backup setup with no client at all, so nobody reports the death: the time
   from the kill until online peers cover every layer again (the dead record has to expire).
3. Balance quality: a simulation of peers joining in random order with random speeds, each with
   room for a third of the layers. Quality is the bottleneck reached over the best achievable,
   found by trying every assignment of peers to the three stages; after joins, and after rounds
   of the rebalancing cost model.

Usage: python scripts/bench_churn.py [--runs 2] [--tokens 40] [--stall-runs 20] [--setups backup,self-heal] [--freeze]
(--runs 0 skips the coverage measurement)
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import itertools
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
import uvloop
from transformers import AutoModelForCausalLM

from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import P2PFusionError
from p2pfusion.models.source import resolve_model
from p2pfusion.peer.balance import Capacity, bottleneck, choose_range, layer_throughputs
from p2pfusion.peer.rebalance import plan_move

KILL_AT = 12
PROMPT = "Write a short story about a robot who learns to paint."


def _launch(swarm: LocalSwarm, setup: str):
    """Start a setup; return the process to kill."""
    if setup == "backup":
        first = swarm.launch((0, 10))
        swarm.wait_ready(first)
        procs = [swarm.launch((10, 20)), swarm.launch((20, 30)), swarm.launch((10, 20), ["--backup"])]
        for proc in procs:
            swarm.wait_ready(proc)
        return procs[0]
    procs = []
    for _ in range(3):  # one by one, so each sees the others when it picks its layers
        procs.append(swarm.launch(None, ["--max-layers", "20"]))
        swarm.wait_ready(procs[-1])
    return procs[1]  # 20:30


def family(proc) -> list[int]:
    """A peer's process and its children (its libp2p daemon)."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return [proc.pid, *map(int, children)]


def send_signal(pids: list[int], number: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            continue


async def _generate(source, maddrs, tokens, victim: list[int], freeze: bool):
    client = await join_swarm(maddrs, client_mode=True)
    try:
        model = RemoteCausalLM.build(source, client, verify=0.0)  # the stall of failover alone
        ids = model.encode(PROMPT, chat=True)
        stamps = []

        def on_token(_token):
            stamps.append(time.perf_counter())
            if len(stamps) == KILL_AT:
                send_signal(victim, signal.SIGSTOP if freeze else signal.SIGKILL)

        result = await model.generate(ids, tokens, on_token=on_token)
        return stamps, result
    finally:
        await client.shutdown()


def reference_tokens(source, tokens: int) -> list[int]:
    """transformers' own greedy tokens for the prompt: what every run must produce."""
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
    ids = RemoteCausalLM.build(source).encode(PROMPT, chat=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def measure_stall(source, setup: str, tokens: int, expected: list[int], freeze: bool) -> float | None:
    """The run's stall in seconds; None when the generation failed or its tokens differ."""
    with LocalSwarm(model=None) as swarm:
        victim = family(_launch(swarm, setup))
        try:
            stamps, result = uvloop.run(_generate(source, swarm.maddrs, tokens, victim, freeze))
        except P2PFusionError as exc:
            print(f"  {setup}: FAILED: {exc}", file=sys.stderr)
            return None
        finally:
            send_signal(victim, signal.SIGKILL)  # a stopped process takes no SIGTERM
    gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]
    stall = max(gaps) - statistics.median(gaps)
    same = result.token_ids == expected
    print(f"  {setup}: stall {stall:.2f} s (median step {statistics.median(gaps) * 1000:.0f} ms, "
          f"recoveries {result.recoveries}, tokens {'identical' if same else 'DIFFER'})", file=sys.stderr)
    return stall if same else None


async def _covered_without(maddrs, model: str, num_layers: int, dead: str) -> bool:
    client = await join_swarm(maddrs, client_mode=True)
    try:
        records = [r for r in await client.lookup(model) if r.peer_id != dead and r.state == PeerState.ONLINE]
    finally:
        await client.shutdown()
    return min(layer_throughputs(records, num_layers)) > 0


def measure_coverage(source, num_layers: int) -> float:
    with LocalSwarm(model=None) as swarm:
        victim = _launch(swarm, "self-heal")
        dead = _peer_id(swarm, victim)
        t0 = time.perf_counter()
        victim.kill()
        while not uvloop.run(_covered_without(swarm.maddrs, source.key, num_layers, dead)):
            if time.perf_counter() - t0 > 180:
                return float("inf")
            time.sleep(0.5)
        seconds = time.perf_counter() - t0
    print(f"  coverage restored {seconds:.1f} s after the kill", file=sys.stderr)
    return seconds


def _peer_id(swarm: LocalSwarm, proc) -> str:
    return proc.address_file.read_text().split()[0].rsplit("/p2p/", 1)[1]


def _best_split(rates: list[float], stages: int) -> float:
    best = 0.0
    for assign in itertools.product(range(stages), repeat=len(rates) - 1):
        sums = [rates[0]] + [0.0] * (stages - 1)
        for rate, stage in zip(rates[1:], assign):
            sums[stage] += rate
        best = max(best, min(sums))
    return best


def balance_quality(seed: int, peers: int, num_layers: int = 30, stages: int = 3) -> tuple[float, float]:
    rng = random.Random(seed)
    span = num_layers // stages
    rates = [rng.uniform(10, 100) for _ in range(peers)]
    records: list[PeerRecord] = []
    for i, rate in enumerate(rates):
        start, end = choose_range(records, num_layers, Capacity(rate, None, span))
        records.append(PeerRecord("m", f"p{i}", [], start, end, PeerState.ONLINE, rate, None, "sim"))
    best = _best_split(rates, stages) / span
    joined = bottleneck(records, num_layers) / best
    for _ in range(10):
        moved = False
        for i in rng.sample(range(peers), peers):
            me = next(r for r in records if r.peer_id == f"p{i}")
            move = plan_move(records, num_layers, me, Capacity(rates[i], None, span), 0.1, 3600.0)
            if move is not None:
                moved_record = PeerRecord("m", me.peer_id, [], move.start, move.end, PeerState.ONLINE, rates[i], None, "sim")
                records = [r for r in records if r.peer_id != me.peer_id] + [moved_record]
                moved = True
        if not moved:
            break
    return joined, bottleneck(records, num_layers) / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="runs of the coverage measurement")
    parser.add_argument("--stall-runs", type=int, default=20, help="generations per setup with a peer killed")
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--skip-swarm", action="store_true", help="only the balance simulation")
    parser.add_argument("--setups", default="backup,self-heal", help="stall setups to run, comma-separated")
    parser.add_argument("--freeze", action="store_true", help="SIGSTOP the peer instead of SIGKILL")
    args = parser.parse_args()
    print(machine_header(), flush=True)

    print("balance quality (simulation, 30 seeds each; bottleneck / best achievable):")
    for peers in (6, 9, 12):
        results = [balance_quality(seed, peers) for seed in range(30)]
        joined = [r[0] for r in results]
        rebalanced = [r[1] for r in results]
        print(f"  {peers:>2} peers: after joins mean {statistics.mean(joined):.3f} (worst {min(joined):.3f}); "
              f"after rebalancing mean {statistics.mean(rebalanced):.3f} (worst {min(rebalanced):.3f})")
    if args.skip_swarm:
        return
    source = resolve_model(None)
    expected = reference_tokens(source, args.tokens)
    for setup in [name for name in args.setups.split(",") if name in ("backup", "self-heal")]:
        runs = [measure_stall(source, setup, args.tokens, expected, args.freeze) for _ in range(args.stall_runs)]
        stalls = sorted(s for s in runs if s is not None)
        name = "a warm backup" if setup == "backup" else "no backup (a peer moves)"
        name += ", the peer frozen (SIGSTOP)" if args.freeze else ""
        summary = f"p50 {statistics.median(stalls):.2f} s, max {stalls[-1]:.2f} s" if stalls else "no run completed"
        print(f"stall with {name}: {len(stalls)} of {len(runs)} generations complete and token-identical; {summary}")
    coverage = [measure_coverage(source, 30) for _ in range(args.runs)]
    if not coverage:
        return
    print(f"full coverage after an unreported kill -9, no backup: median {statistics.median(coverage):.1f} s; "
          f"runs {', '.join(f'{c:.1f}' for c in coverage)}")


if __name__ == "__main__":
    main()
