#!/usr/bin/env python
"""Slow links: a 3-peer swarm of the default model whose every link is shaped, for each codec.

Each peer runs in its own network namespace, joined to a bridge by a veth pair. Both ends of each
veth are shaped with `tc qdisc tbf` to the same rate, so every link of the pipeline (client ->
peer 1 -> peer 2 -> peer 3 -> client) carries at most that rate. No delay is added (this kernel has
no netem): RTTs stay well under a millisecond, so the figures isolate bandwidth, which is what a
codec changes. For each rate and codec (forced by the client on every hop; `auto` lets each hop
choose from its measured link), it measures:
- tokens/s of greedy generation (prefill excluded);
- seconds per forward of a 4x128 batch, to logits;
- seconds per training step (forward and backward) of a 4x128 batch, with the loss computed on
  the client and gradients sent back through every hop (top-k applies here only).
It prints the speedup of `auto` over `none`. Needs root (ip netns, tc); it removes its namespaces
and bridge when it ends, even on Ctrl-C. Addresses are 10.77.0.0/24, inside those namespaces only.
Usage: python scripts/bench_slow_links.py [--rates 10,100] [--tokens 32] [--runs 2]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import shutil
import statistics
import sys
import time

import torch
import uvloop

from p2pfusion.cli.hosts import HostNetwork, namespaces_unavailable
from p2pfusion.cli.local_swarm import LocalSwarm, even_ranges
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import resolve_model

PEERS = 3
SUBNET = "10.77.0"
INFERENCE_CODECS = ["none", "float16", "bfloat16", "int8", "auto"]
TRAINING_CODECS = ["none", "bfloat16", "int8", "topk", "auto"]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def start_swarm(network: HostNetwork, num_layers: int) -> LocalSwarm:
    swarm = LocalSwarm(model=None)
    for i, layers in enumerate(even_ranges(num_layers, network.hosts)):
        proc = swarm.launch(layers, ["--host", network.host(i)], prefix=network.prefix_of(i))
        swarm.wait_ready(proc)
    return swarm


async def _timed(coroutine) -> float:
    t0 = time.perf_counter()
    await coroutine
    return time.perf_counter() - t0


async def measure(source, maddrs: list[str], gateway: str, ids: list[int], batch: torch.Tensor, args) -> dict[str, list]:
    """Per codec: [generation tok/s, forward seconds, training step seconds], None where not applicable."""
    client = await join_swarm(maddrs, host=gateway, client_mode=True)
    results = {}
    try:
        for codec in dict.fromkeys(INFERENCE_CODECS + TRAINING_CODECS):
            model = RemoteCausalLM.build(source, client, compression=codec)
            speeds, forwards, steps = [], [], []
            if codec in INFERENCE_CODECS:
                await model.generate(ids, 2, stop_at_eos=False)  # warm-up: connections and link probes
                for _ in range(args.runs):
                    out = await model.generate(ids, args.tokens, stop_at_eos=False)
                    speeds.append((len(out.token_ids) - 1) / out.decode_seconds)
                    forwards.append(await _timed(model.forward_logits(batch)))
            if codec in TRAINING_CODECS:
                await model.train_step(batch[:, :8], batch[:, :8])  # warm-up
                steps = [await _timed(model.train_step(batch, batch)) for _ in range(args.runs)]
            results[codec] = [statistics.median(x) if x else None for x in (speeds, forwards, steps)]
            print(f"  {codec:9} " + "  ".join(_cell(v) for v in results[codec]), file=sys.stderr)
    finally:
        await client.shutdown()
    return results


def _cell(value: float | None, width: int = 10) -> str:
    return f"{value:{width}.2f}" if value is not None else f"{'-':>{width}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="10,100", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    print(machine_header(), flush=True)
    reason = namespaces_unavailable() or (None if shutil.which("tc") else "tc (iproute2) is not installed")
    if reason is not None:
        print(f"bench_slow_links: error: {reason}", file=sys.stderr)
        sys.exit(2)
    source = resolve_model(None)
    model = RemoteCausalLM.build(source)
    ids = model.encode(PROMPT, chat=True)
    batch = torch.randint(0, model.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    table = {}
    for mbit in (int(r) for r in args.rates.split(",")):
        print(f"links shaped to {mbit} Mbit/s:", file=sys.stderr)
        with HostNetwork(PEERS, prefix="p2pfslow", subnet=SUBNET, mbit=mbit) as network:
            swarm = start_swarm(network, model.config.num_hidden_layers)
            try:
                table[mbit] = uvloop.run(measure(source, swarm.maddrs, network.gateway, ids, batch, args))
            finally:
                swarm.stop()
    print(f"{'link':>9} {'codec':9} {'generation tok/s':>17} {'forward 4x128 s':>16} {'train step 4x128 s':>19}")
    for mbit, rows in table.items():
        for codec, (speed, forward, step) in rows.items():
            print(f"{mbit:>4} Mbit {codec:9} {_cell(speed, 17)} {_cell(forward, 16)} {_cell(step, 19)}")
        auto, none = rows["auto"], rows["none"]
        print(f"{mbit:>4} Mbit speedup of auto over none: generation {auto[0] / none[0]:.2f}x, "
              f"forward {none[1] / auto[1]:.2f}x, training step {none[2] / auto[2]:.2f}x")


if __name__ == "__main__":
    main()
