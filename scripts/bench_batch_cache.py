"""A peer's batched decode step over its sessions' own KV caches, against transformers' batch of
the same sessions over one padded DynamicCache (what its batched `generate` runs), in one process.

8 sessions (by default) of different lengths step together through 10 layers of the default model,
one token each, step after step, as a client's cohort does (client/generate/lockstep.py): ours is
`Stage.forward_batch` over each session's `SessionCache` (models/kv_cache.py), the reference the
stage's transformers module over one `DynamicCache` holding the 8 left-padded rows. The two take
turns within each repetition, so a busy moment of a shared machine hits them alike; medians per
step are printed, with ours over transformers'. One thread, as a peer's decode steps run.

    .venv/bin/python scripts/bench_batch_cache.py [--sessions 8] [--lengths 60,500,2000] [--steps 15] [--reps 3]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import statistics
import sys
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache

from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import Stage, load_stage

LAYERS = 10
SPREAD = 7  # positions between one session's length and the next's


def ours(stage: Stage, lengths: list[int], steps: int) -> float:
    """Median ms of a batched step of sessions holding `lengths` positions, through their own caches."""
    caches = [stage.new_cache() for _ in lengths]
    for cache, length in zip(caches, lengths):
        stage.forward(torch.randn(1, length, stage.hidden_size), 0, cache)
    times = []
    for _ in range(steps):
        xs = [torch.randn(1, 1, stage.hidden_size) for _ in lengths]
        start = time.perf_counter()
        stage.forward_batch(xs, caches, [None] * len(lengths), [None] * len(lengths))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


@torch.inference_mode()
def transformers_batch(stage: Stage, lengths: list[int], steps: int) -> float:
    """The same, as transformers' module over one left-padded DynamicCache."""
    longest = max(lengths)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, longest - length:] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=stage.module.config)
    stage.module(inputs_embeds=torch.randn(len(lengths), longest, stage.hidden_size), attention_mask=mask,
                 position_ids=positions, past_key_values=cache, use_cache=True)
    times = []
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones(len(lengths), 1, dtype=torch.long)], dim=1)
        step_positions = positions[:, -1:] + 1
        positions = torch.cat([positions, step_positions], dim=1)
        x = torch.randn(len(lengths), 1, stage.hidden_size)
        start = time.perf_counter()
        stage.module(inputs_embeds=x, attention_mask=mask, position_ids=step_positions, past_key_values=cache,
                     use_cache=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--lengths", default="60,500,2000", help="the shortest session's positions, per case")
    parser.add_argument("--steps", type=int, default=15, help="batched steps timed per side and repetition")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    try:
        bases = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths must be integers separated by commas, got {args.lengths!r}")
    if args.sessions < 2 or args.steps < 1 or args.reps < 1 or min(bases) < 1:
        parser.error("--sessions must be at least 2, and --steps, --reps and every length at least 1")
    torch.set_num_threads(1)  # as a peer's decode steps run; the header keeps it
    print(machine_header(), flush=True)
    stage = load_stage(resolve_model(None), 0, LAYERS)
    print(f"{args.sessions} sessions, one token a step through {LAYERS} layers of the default model, 1 thread; "
          f"ms per step, medians of {args.reps} x {args.steps} steps", file=sys.stderr)
    print(f"{'positions held':>16} {'ours':>8} {'transformers':>13} {'ratio':>6}")
    for base in bases:
        lengths = [base + SPREAD * i for i in range(args.sessions)]
        mine, theirs = [], []
        for _ in tqdm(range(args.reps), desc=f"{base}-{lengths[-1]} positions", file=sys.stderr):
            mine.append(ours(stage, lengths, args.steps))
            theirs.append(transformers_batch(stage, lengths, args.steps))
        a, b = statistics.median(mine), statistics.median(theirs)
        print(f"{f'{base}-{lengths[-1]}':>16} {a:>8.1f} {b:>13.1f} {a / b:>6.2f}")


if __name__ == "__main__":
    main()
