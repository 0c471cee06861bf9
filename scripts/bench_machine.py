#!/usr/bin/env python
"""Which machine a benchmark ran on, and the two traits of it that move our ratios most.

Every bench script prints this header first (and docs/benchmarks.md records it beside each
table): CPU model, cores, torch's threads, then one-token steps through 10 layers of the default
model (float32, KV cache), back to back and after an idle gap like a pipeline's, on one thread and
on all of them, and what a peer here would choose (peer/threads.py). Two figures summarise it:
- "threads": the step on all threads over the step on one, back to back (below 1: more threads help);
- "idle gap": the step after the gap over the step back to back, on the setting a peer would choose.
About 5 s. Alone: python scripts/bench_machine.py [--gap-ms 25]
"""

from __future__ import annotations

import argparse
import os
import platform

import p2pfusion  # before torch: importing the package sets OpenMP's spin, as in the CLI's processes
import torch

from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import load_stage
from p2pfusion.peer.benchmark import IDLE_GAP, device_name, step_costs
from p2pfusion.peer.threads import choose_decode_settings

LAYERS = 10


def machine_header(gap: float = IDLE_GAP) -> str:
    """The header's lines, measured now (torch's threads are left as they were)."""
    threads = torch.get_num_threads()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    stage = load_stage(resolve_model(None), 0, LAYERS)
    options = [(1, False)] + ([(threads, False), (threads, True)] if threads > 1 else [])
    costs = step_costs(stage, stage.hidden_size, options, gap=gap)
    torch.set_num_threads(threads)
    by = {(c.threads, c.warm): c for c in costs}
    chosen = choose_decode_settings(costs)
    mine = by[chosen.threads, chosen.warm]
    steps = "; ".join(c.describe() for c in costs)
    ratio = by[threads, False].back_to_back / by[1, False].back_to_back
    return "\n".join([
        f"machine: {device_name('cpu')}, {os.cpu_count()} cores ({usable} usable), torch threads {threads}, "
        f"{platform.machine()}, torch {torch.__version__}, p2pfusion {p2pfusion.__version__}, "
        f"GOMP_SPINCOUNT {os.environ.get('GOMP_SPINCOUNT', 'default')}",
        f"machine: {LAYERS}-layer decode step, back to back / after {gap * 1000:.0f} ms idle: {steps}",
        f"machine: threads {ratio:.2f} ({threads} ÷ 1 back to back), idle gap {mine.after_idle / mine.back_to_back:.2f}x "
        f"on the peers' choice, {chosen.describe()}",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gap-ms", type=float, default=IDLE_GAP * 1000)
    args = parser.parse_args()
    print(machine_header(args.gap_ms / 1000))


if __name__ == "__main__":
    main()
