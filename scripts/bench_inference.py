#!/usr/bin/env python
"""Greedy decoding: local transformers vs. a local 3-peer swarm, in one run, with their ratio.

Both sides use the same model, prompt, dtype (fp32) and CPU threads. The swarm's peers are real
processes on 127.0.0.1, each serving a third of the layers; the client keeps embeddings and head.
Usage: python scripts/bench_inference.py [--tokens 64] [--runs 3] [--peers 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import uvloop
from transformers import AutoModelForCausalLM

from p2pfusion.cli.local_swarm import LocalSwarm, even_ranges
from p2pfusion.client.generation import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import resolve_model

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def local_decode_speed(model, ids: list[int], tokens: int) -> float:
    """Tokens/s of decoding alone: the time of N tokens minus the time of 1 (the prefill)."""
    inputs = torch.tensor([ids])

    def timed(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t

    timed(2)  # warm-up
    return (tokens - 1) / (timed(tokens) - timed(1))


async def swarm_decode_speeds(source, maddrs: list[str], ids: list[int], tokens: int, runs: int) -> list[float]:
    swarm = await join_swarm(maddrs, client_mode=True)
    try:
        model = RemoteCausalLM(source, swarm)
        await model.generate(ids, 2, stop_at_eos=False)  # warm-up: connections, caches
        speeds = []
        for _ in range(runs):
            out = await model.generate(ids, tokens, stop_at_eos=False)
            speeds.append((len(out.token_ids) - 1) / out.decode_seconds)
        return speeds
    finally:
        await swarm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--peers", type=int, default=3)
    args = parser.parse_args()

    source = resolve_model(None)
    local = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
    ids = RemoteCausalLM(source).encode(PROMPT, chat=True)
    print(f"model {source.name}, prompt {len(ids)} tokens, {args.tokens} new tokens, "
          f"torch threads {torch.get_num_threads()}", file=sys.stderr)

    with LocalSwarm(model=None) as swarm:
        swarm.start(even_ranges(local.config.num_hidden_layers, args.peers))
        ratios, local_speeds, swarm_speeds = [], [], []
        # Interleave local and swarm runs so that load from other tenants hits both alike.
        for _ in range(args.runs):
            local_speeds.append(local_decode_speed(local, ids, args.tokens))
            swarm_speeds.append(uvloop.run(swarm_decode_speeds(source, swarm.maddrs, ids, args.tokens, 1))[0])
            ratios.append(swarm_speeds[-1] / local_speeds[-1])
            print(f"run: local {local_speeds[-1]:.1f} tok/s, swarm {swarm_speeds[-1]:.1f} tok/s, "
                  f"ratio {ratios[-1]:.2f}", file=sys.stderr)

    print(f"local transformers : {statistics.median(local_speeds):6.1f} tokens/s (median of {args.runs})")
    print(f"{args.peers}-peer swarm       : {statistics.median(swarm_speeds):6.1f} tokens/s (median of {args.runs})")
    print(f"ratio swarm/local  : {statistics.median(ratios):6.2f} (runs: {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
