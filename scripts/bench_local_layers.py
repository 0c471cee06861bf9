#!/usr/bin/env python
"""What local first layers cost the client: the default model on 3 peer processes (stages 0:10,
10:20, 20:30 on 127.0.0.1), one client generating --tokens greedy tokens for a few prompts with
local_layers 0 and 10 alternated in the same run (so load from other tenants of the machine hits
both alike): prefill seconds, decode tokens/s and their ratios, whether the tokens agree, and the
client's memory (its process's RSS and the anonymous part of it, and the local stage's weights and
KV cache per token).
Verification is off (--verify), so the figures are the local layers' own.
Usage: python scripts/bench_local_layers.py [--tokens 64] [--runs 2] [--local-layers 10]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import statistics
import sys

import uvloop

from p2pfusion.cli.local_swarm import LocalSwarm, even_ranges
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import load_config
from p2pfusion.models.formats import trim_heap

PROMPTS = [
    "What is a DHT?",
    "Explain in a few sentences why the sky is blue, and why sunsets are red.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle. It should have "
    "a beginning, a middle and an end, and the message should change the keeper's life.",
]


def memory_mib() -> tuple[float, float]:
    """This process's resident memory and the anonymous part of it (heap: weights, caches; the
    rest is mostly library code paged in), once freed heap pages went back to the system."""
    trim_heap()
    with open("/proc/self/smaps_rollup") as rollup:
        fields = {line.split()[0]: int(line.split()[1]) for line in rollup if line.split()[0] in ("Rss:", "Anonymous:")}
    return fields["Rss:"] / 1024, fields["Anonymous:"] / 1024


def kv_bytes_per_token(config, layers: int, element: int = 4) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * layers * config.num_key_value_heads * head_dim * element


async def runs(source, maddrs, args) -> dict:
    swarm = await join_swarm(maddrs, client_mode=True)
    try:
        models = {k: RemoteCausalLM.build(source, swarm, verify=args.verify, local_layers=k) for k in (0, args.local_layers)}
        prompts = [models[0].encode(text, chat=True) for text in PROMPTS]
        print(f"prompts of {', '.join(str(len(ids)) for ids in prompts)} tokens", file=sys.stderr)
        await models[0].generate(prompts[0], 2, stop_at_eos=False)  # connections, links, caches
        before = memory_mib()
        await models[args.local_layers].generate(prompts[0], 2, stop_at_eos=False)  # loads the local stage
        after = memory_mib()
        stage = (await models[args.local_layers].local.run(None)).stage
        results = {k: {"prefill": [], "tps": [], "tokens": []} for k in models}
        for run in range(args.runs):
            for i, ids in enumerate(prompts):
                for k, model in models.items():
                    out = await model.generate(ids, args.tokens, stop_at_eos=False, decode=False)
                    results[k]["prefill"].append(out.prefill_seconds)
                    results[k]["tps"].append((len(out.token_ids) - 1) / out.decode_seconds)
                    results[k]["tokens"].append(out.token_ids)
                    print(f"run {run} prompt {i} ({len(ids)} tokens) local_layers={k}: prefill "
                          f"{out.prefill_seconds:.3f} s, decode {results[k]['tps'][-1]:.1f} tok/s", file=sys.stderr)
        return {"results": results, "memory": (before, after), "stage": stage}
    finally:
        await swarm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--local-layers", type=int, default=10)
    parser.add_argument("--verify", type=float, default=0.0)
    args = parser.parse_args()
    print(machine_header(), flush=True)

    source = resolve_model(None)
    config = load_config(source)
    ranges = even_ranges(config.num_hidden_layers, 3)
    print(f"model {source.name}, stages {ranges}, {args.tokens} new tokens", file=sys.stderr)
    with LocalSwarm(model=None) as swarm:
        swarm.start(ranges)
        out = uvloop.run(runs(source, swarm.maddrs, args))

    med = statistics.median
    r, k = out["results"], args.local_layers
    prefill = [b / a for a, b in zip(r[0]["prefill"], r[k]["prefill"])]
    decode = [b / a for a, b in zip(r[0]["tps"], r[k]["tps"])]
    same = sum(a == b for a, b in zip(r[0]["tokens"], r[k]["tokens"]))
    stage = out["stage"]
    for layers in (0, k):
        print(f"local_layers={layers}: prefill {med(r[layers]['prefill']):.3f} s, decode {med(r[layers]['tps']):.1f} tok/s "
              f"(medians of {len(r[layers]['tps'])} generations)")
    print(f"ratios local_layers={k} / 0: prefill time {med(prefill):.2f} (runs: {', '.join(f'{x:.2f}' for x in prefill)}), "
          f"decode speed {med(decode):.2f} (runs: {', '.join(f'{x:.2f}' for x in decode)})")
    print(f"same tokens in {same} of {len(decode)} generation pairs")
    (rss, anon), (rss_after, anon_after) = out["memory"]
    print(f"client RSS {rss:.0f} MiB before the local stage, {rss_after:.0f} MiB after its first generation "
          f"(anonymous {anon:.0f} -> {anon_after:.0f} MiB); the stage 0:{stage.end}: {stage.parameter_bytes() / 2**20:.1f} MiB of weights, "
          f"{kv_bytes_per_token(config, stage.end) / 1024:.1f} KiB of KV cache per token")


if __name__ == "__main__":
    main()
