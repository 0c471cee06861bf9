"""Training step benchmark: forward+backward of a 4x128 batch with LoRA through a local 3-peer swarm
of the default model (processes on 127.0.0.1), against the same step done locally by transformers
with PEFT, in the same run, interleaved; and the bytes the swarm's processes send per step.

    python scripts/bench_training.py [--runs 5] [--batch 4] [--tokens 128] [--compression auto]

Bytes are the growth of every process's written bytes (/proc/PID/io wchar, which counts socket
writes; logs are off), so they include framing, TLS and the adapter's upload when it changed.
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from p2pfusion import AutoDistributedModelForCausalLM
from p2pfusion.cli.local_swarm import LocalSwarm, even_ranges
from p2pfusion.models.source import resolve_model

TARGETS = ("q_proj", "v_proj")


def written(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("wchar:"):
                total += int(line.split()[1])
    return total


def timed_step(net, optimizer, ids) -> float:
    t0 = time.perf_counter()
    optimizer.zero_grad()
    net(ids, labels=ids).loss.backward()
    optimizer.step()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--compression", default="auto")
    args = parser.parse_args()
    print(machine_header(), flush=True)
    source = resolve_model(None)
    ids = torch.randint(100, 40000, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))

    local = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32)
    local = get_peft_model(local, LoraConfig(r=args.rank, lora_alpha=16, target_modules=list(TARGETS), lora_dropout=0.0))
    local_opt = torch.optim.AdamW([p for p in local.parameters() if p.requires_grad], lr=1e-4)

    with LocalSwarm(model=None) as swarm:
        swarm.start(even_ranges(30, 3))
        model = AutoDistributedModelForCausalLM.from_pretrained(
            None, initial_peers=swarm.maddrs, tuning="lora", lora_rank=args.rank, lora_targets=TARGETS,
            compression=args.compression,
        )
        try:
            opt = torch.optim.AdamW(model.adapter.parameters(), lr=1e-4)
            pids = [p.pid for p in swarm.processes] + [os.getpid()]
            timed_step(model, opt, ids)  # warm-up: routes, link measurements, first allocations
            timed_step(local, local_opt, ids)
            swarm_times, local_times, sent = [], [], []
            for _ in range(args.runs):
                before = written(pids)
                swarm_times.append(timed_step(model, opt, ids))
                sent.append(written(pids) - before)
                local_times.append(timed_step(local, local_opt, ids))
        finally:
            model.close()

    hidden = model.config.hidden_size
    tensor_bytes = args.batch * args.tokens * hidden * 4
    adapter_bytes = sum(p.numel() for p in model.adapter.parameters()) * 4
    # the adapter goes down the chain (all of it to hop 1, two thirds on, ...) and its gradients up
    chained = 2 * adapter_bytes * (1 + 2 / 3 + 1 / 3)
    ours, theirs = statistics.median(swarm_times), statistics.median(local_times)
    print(f"forward+backward+optimizer step, LoRA r={args.rank} on {','.join(TARGETS)}, batch {args.batch}x{args.tokens}, "
          f"median of {args.runs}")
    print(f"  swarm (3 peers): {ours * 1000:8.0f} ms   runs: {', '.join(f'{t * 1000:.0f}' for t in swarm_times)}")
    print(f"  local:           {theirs * 1000:8.0f} ms   runs: {', '.join(f'{t * 1000:.0f}' for t in local_times)}")
    print(f"  ratio local/swarm (1.0 = as fast as local): {theirs / ours:.2f}")
    print(f"  bytes written per step by all processes: {statistics.median(sent) / 1e6:.2f} MB "
          f"(raw float32: hidden states and their gradients over 4 links each way {8 * tensor_bytes / 1e6:.2f} MB, "
          f"adapter upload and its gradients {chained / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
