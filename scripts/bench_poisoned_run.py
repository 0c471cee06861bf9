#!/usr/bin/env python
"""A training run with one poisoning replica, against the same run with none, in one run.

The default model cut to its first 6 layers (its embeddings, final norm and head kept, frozen as
a driver holds them) is trained on the docstrings of Python's standard library by a
`SwarmTrainer` (the run's driver) through four replicas of its layers, real peers on 127.0.0.1 in
this process (so that one of them can be made to lie), with DiLoCo outer steps every
`--sync-every` inner steps.
One replica poisons its pseudo-gradient at every outer step:
- huge: 10,000 times its own;
- flipped: its own, reversed;
- shapes: tensors of other shapes;
- two-faced: its own, scaled 2, 4 and 1 times for the three other replicas, each version sealed
  by its key (different tensors to different members: unless left out, the honest replicas part);
- late-two-faced: its own to two replicas, and twice its own to the third only after the others
  stopped waiting for that one's echo (`averaging.ECHO_WAIT`): only the third sees both seals, so
  the round leaves the honest replicas with different weights unless the driver mends it;
- undefended-huge: huge, with the replicas' robust mean replaced by a plain mean (what the outer
  step was before), to show what the defence holds off.
Printed per run: held-out perplexity at the end, and its ratio to the clean run's on the same
data (target: 1.05x at most), and the replicas' weights' agreement (the honest replicas must hold
the same weights). With `--seeds N`, every run goes again on N orders of the training sequences,
and the ratios' geometric mean is printed too: a model this far from trained ends tens of percent
apart on a change as small as which replica's micro-batches were lost before the liar was left out.

Usage: python scripts/bench_poisoned_run.py [--steps 60] [--sync-every 5] [--seeds 1] [--runs clean,huge,...]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import asyncio
import itertools
import math
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.client.run.trainer import SwarmTrainer
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import resolve_model
from p2pfusion.net import averaging
from p2pfusion.net.robust import Aggregate
from p2pfusion.peer.runtime import Peer, PeerOptions
from bench_pretrain import HELD_OUT_MODULES, TRAIN_MODULES, batches, progress

RUNS = ["clean", "huge", "flipped", "shapes", "two-faced", "late-two-faced", "undefended-huge"]
REPLICAS = 4
LAYERS = 6
LR = 1e-3


def small_model(folder: Path, layers: int = LAYERS) -> Path:
    """The default model cut to its first `layers` layers (its embeddings, final norm and head
    kept): a language model that training those layers improves quickly, or a draft model."""
    default = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(default.folder, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(default.folder).save_pretrained(folder)
    return folder


def poison(replica, kind: str) -> None:
    honest = replica.pseudo_gradient
    if kind.endswith("huge"):
        replica.pseudo_gradient = lambda: [d * 1e4 for d in honest()]
    elif kind == "flipped":
        replica.pseudo_gradient = lambda: [-d for d in honest()]
    elif kind == "shapes":
        replica.pseudo_gradient = lambda: [d.reshape(-1)[1:] for d in honest()]


def two_faced(averager) -> None:
    honest = averager._send
    sent = itertools.count(1)

    async def send(peer, group_id, tensors, compression, seal):
        factor = 2 ** (next(sent) % 3)
        scaled = [d * factor for d in tensors]
        await honest(peer, group_id, scaled, compression, averager.seal(group_id, scaled))

    averager._send = send


def late_two_faced(averager, victim: str) -> None:
    honest = averager._send

    async def send(peer, group_id, tensors, compression, seal):
        if peer == victim:  # once the others hold every tensor but the victim's, and stopped waiting
            round_ = averager._rounds[group_id]
            while not set(round_.others) - {victim} <= set(round_.echoes):
                await asyncio.sleep(0.1)
            await asyncio.sleep(averaging.ECHO_WAIT + 1.0)
            tensors = [d * 2 for d in tensors]
            seal = averager.seal(group_id, tensors)
        await honest(peer, group_id, tensors, compression, seal)

    averager._send = send


def plain_mean(vectors: list[torch.Tensor]) -> Aggregate:
    return Aggregate(torch.stack(vectors).mean(dim=0), ())


async def start_replicas(source, run: str) -> tuple[list[Peer], list[str], asyncio.Task]:
    """The replicas, and the task that refreshes their records as `run-peer` does."""
    peers, initial = [], []
    for _ in range(REPLICAS):
        swarm = await join_swarm(initial)
        peer = Peer(PeerOptions(source=source, initial_peers=initial, layers=(0, LAYERS), throughput="100", train=run), swarm)
        await peer.start()
        peers.append(peer)
        initial = initial or await swarm.maddrs()
    return peers, initial, asyncio.create_task(keep_announcing(peers))


async def keep_announcing(peers: list[Peer]) -> None:
    while True:
        await asyncio.sleep(peers[0].options.refresh_period)
        for peer in peers:
            await peer.announce()


async def stop_replicas(peers: list[Peer], refresher: asyncio.Task) -> None:
    refresher.cancel()
    for peer in peers:
        await peer.leave()
        await peer.swarm.shutdown()


def run_one(kind: str, source, data, held_out, sync_every: int) -> tuple[float, float]:
    """Held-out loss at the end, and the largest relative difference between honest replicas' weights."""
    loop = BackgroundLoop("replicas")
    robust = averaging.robust_mean
    if kind.startswith("undefended"):
        averaging.robust_mean = plain_mean
    try:
        peers, maddrs, refresher = loop.run(start_replicas(source, f"poison-{kind}"))
        try:
            if kind == "two-faced":
                two_faced(peers[-1].training.averager)
            elif kind == "late-two-faced":
                late_two_faced(peers[-1].training.averager, peers[0].swarm.peer_id)
            elif kind != "clean":
                poison(peers[-1].training.replica, kind)
            with SwarmTrainer.connect(str(source.folder), maddrs, run=f"poison-{kind}", lr=LR, sync_every=sync_every) as trainer:
                with progress(len(data), kind) as bar:
                    for ids in data:
                        loss = trainer.step(ids)
                        bar.update(ids, loss)
                held = trainer.evaluate(held_out)
            honest = [p.training.replica.outer for p in peers[:-1]]
            spread = max(float((a - b).norm() / b.norm().clamp_min(1e-12)) for other in honest[1:]
                         for a, b in zip(other, honest[0]))
        finally:
            loop.run(stop_replicas(peers, refresher))
    finally:
        averaging.robust_mean = robust
        loop.close()
    return held, spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sync-every", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--seeds", type=int, default=1, help="orders of the training data to run every row on")
    args = parser.parse_args()
    kinds = [k for k in args.runs.split(",") if k]
    if set(kinds) - set(RUNS) or "clean" not in kinds:
        parser.error(f"runs are among {RUNS}, clean included")
    print(machine_header(), flush=True)
    folder = small_model(Path(tempfile.mkdtemp(prefix="bench-poison-")) / "small-llama")
    source = resolve_model(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    held_out = batches(tokenizer, HELD_OUT_MODULES, 1, 32, args.tokens, seed=1)[0]
    with torch.no_grad():
        before = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(input_ids=held_out, labels=held_out).loss
    results: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    for seed in range(args.seeds):  # each seed another order of the training sequences
        data = batches(tokenizer, TRAIN_MODULES, args.steps, args.batch, args.tokens, seed=seed)
        for kind in kinds:
            results[kind].append(run_one(kind, source, data, held_out, args.sync_every))
    clean = [math.exp(held) for held, _ in results["clean"]]
    print(f"{REPLICAS} replicas of layers 0:{LAYERS}, {args.steps} steps of {args.batch}x{args.tokens} tokens, "
          f"outer step every {args.sync_every}; one replica poisons its pseudo-gradient; {args.seeds} data order(s)")
    print("| run | held-out perplexity | vs clean | mean vs clean | honest replicas' weights differ by |")
    print("|---|---|---|---|---|")
    print(f"| before training | {math.exp(float(before)):.1f} | | | |")
    for kind, runs in results.items():
        ppl = [math.exp(held) if held < 700 else math.inf for held, _ in runs]
        ratios = [p / c for p, c in zip(ppl, clean)]
        mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))  # geometric: ratios
        print(f"| {kind} | {', '.join(f'{p:.1f}' for p in ppl)} | {', '.join(f'{r:.3f}x' for r in ratios)} | "
              f"{mean:.3f}x | {max(spread for _, spread in runs):.1e} |")
    sys.stdout.flush()

if __name__ == "__main__":
    main()
