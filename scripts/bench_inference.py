#!/usr/bin/env python
"""Local transformers vs. a local 3-peer swarm, in one run, with their ratios:
1. greedy decoding of --tokens new tokens (prefill excluded on both sides), by our client as it is
   and by our client with a plain float32 LM head (as transformers computes it: what is left is
   the swarm's own overhead);
2. a batch forward of 4 sequences of 128 tokens, to logits.

Both sides use the same model, inputs, dtype (fp32) and CPU threads. The swarm's peers are real
processes on 127.0.0.1, each serving a third of the layers; the client keeps embeddings and head.
Local and swarm runs alternate, so load from other tenants of the machine hits both alike.
Usage: python scripts/bench_inference.py [--tokens 64] [--runs 5] [--peers 3] [--peer-args '--decode-threads 2:warm']
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import statistics
import sys
import time

import torch
import uvloop
from transformers import AutoModelForCausalLM

from p2pfusion.cli.local_swarm import LocalSwarm, even_ranges
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
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


def local_batch_seconds(model, batch: torch.Tensor) -> float:
    with torch.no_grad():
        model(batch)  # warm-up
        t = time.perf_counter()
        model(batch)
        return time.perf_counter() - t


async def swarm_decode_speed(model: RemoteCausalLM, ids: list[int], tokens: int) -> float:
    out = await model.generate(ids, tokens, stop_at_eos=False)
    return (len(out.token_ids) - 1) / out.decode_seconds


async def swarm_batch_seconds(model: RemoteCausalLM, batch: torch.Tensor) -> float:
    """Embed, run the stages, and compute logits: the same work as the local forward."""
    t = time.perf_counter()
    await model.forward_logits(batch)
    return time.perf_counter() - t


async def swarm_runs(source, maddrs, local, ids, batch, args) -> dict[str, list[float]]:
    swarm = await join_swarm(maddrs, client_mode=True)
    results = {"local_tps": [], "swarm_tps": [], "plain_tps": [], "local_batch": [], "swarm_batch": []}
    try:
        # one token per step, as transformers decodes: scripts/bench_speculative.py measures drafts
        model = RemoteCausalLM.build(source, swarm, speculate="off")
        plain = RemoteCausalLM.build(source, swarm, screen_head=False, speculate="off")
        for warm in (model, plain):  # connections, links, caches
            await warm.generate(ids, 2, stop_at_eos=False)
        await swarm_batch_seconds(model, batch)
        for run in range(args.runs):
            results["local_tps"].append(local_decode_speed(local, ids, args.tokens))
            results["swarm_tps"].append(await swarm_decode_speed(model, ids, args.tokens))
            results["plain_tps"].append(await swarm_decode_speed(plain, ids, args.tokens))
            results["local_batch"].append(local_batch_seconds(local, batch))
            results["swarm_batch"].append(await swarm_batch_seconds(model, batch))
            print(f"run {run}: decode local {results['local_tps'][-1]:.1f} tok/s, swarm {results['swarm_tps'][-1]:.1f} "
                  f"(plain head {results['plain_tps'][-1]:.1f}) tok/s; batch local {results['local_batch'][-1]:.2f} s, "
                  f"swarm {results['swarm_batch'][-1]:.2f} s", file=sys.stderr)
        return results
    finally:
        await swarm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--peer-args", default="", help="more run-peer arguments, e.g. '--decode-threads 2:warm'")
    args = parser.parse_args()
    print(machine_header(), flush=True)

    source = resolve_model(None)
    local = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
    ids = RemoteCausalLM.build(source).encode(PROMPT, chat=True)
    batch = torch.randint(0, local.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    print(f"model {source.name}, prompt {len(ids)} tokens, {args.tokens} new tokens, batch 4x128, "
          f"torch threads {torch.get_num_threads()}", file=sys.stderr)

    with LocalSwarm(model=None) as swarm:
        swarm.start(even_ranges(local.config.num_hidden_layers, args.peers), args.peer_args.split())
        r = uvloop.run(swarm_runs(source, swarm.maddrs, local, ids, batch, args))

    decode = [s / loc for s, loc in zip(r["swarm_tps"], r["local_tps"])]
    plain = [s / loc for s, loc in zip(r["plain_tps"], r["local_tps"])]
    forward = [loc / s for s, loc in zip(r["swarm_batch"], r["local_batch"])]
    med = statistics.median
    print(f"greedy decode, {args.tokens} tokens: local {med(r['local_tps']):.1f} tok/s, "
          f"{args.peers}-peer swarm {med(r['swarm_tps']):.1f} tok/s, ratio {med(decode):.2f} "
          f"(runs: {', '.join(f'{x:.2f}' for x in decode)})")
    print(f"  with a plain float32 head: {med(r['plain_tps']):.1f} tok/s, ratio {med(plain):.2f} "
          f"(runs: {', '.join(f'{x:.2f}' for x in plain)})")
    print(f"batch forward 4x128:     local {med(r['local_batch']):.2f} s, "
          f"{args.peers}-peer swarm {med(r['swarm_batch']):.2f} s, ratio {med(forward):.2f} "
          f"(runs: {', '.join(f'{x:.2f}' for x in forward)})")


if __name__ == "__main__":
    main()
