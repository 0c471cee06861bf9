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

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import uvloop

from p2pfusion.cli.local_swarm import LocalSwarm, even_ranges
from p2pfusion.client.generation import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import resolve_model

PEERS = 3
BRIDGE = "p2pfbr0"
SUBNET = "10.77.0"
INFERENCE_CODECS = ["none", "float16", "bfloat16", "int8", "auto"]
TRAINING_CODECS = ["none", "bfloat16", "int8", "topk", "auto"]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _namespace(i: int) -> str:
    return f"p2pfslow{i}"


class ShapedNetwork:
    """A bridge in this namespace (the client, at .1) and one namespace per peer (.11, .12, ...)."""

    def __init__(self, peers: int, mbit: int):
        self.peers, self.mbit = peers, mbit

    def host(self, i: int) -> str:
        return f"{SUBNET}.{11 + i}"

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", _namespace(i)]

    def _shape(self, device: str, namespace: str | None) -> None:
        burst = max(self.mbit * 1250, 16000)  # bytes: 10 ms at the rate, at least a few packets
        cmd = ["tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{self.mbit}mbit",
               "burst", str(burst), "latency", "400ms"]
        subprocess.run((["ip", "netns", "exec", namespace] if namespace else []) + cmd, check=True, capture_output=True)

    def __enter__(self) -> ShapedNetwork:
        self.__exit__()
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for i in range(self.peers):
            ns, outside, inside = _namespace(i), f"p2pfv{i}", f"p2pfe{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "master", BRIDGE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.host(i)}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            self._shape(outside, None)  # toward the peer
            self._shape(inside, ns)  # from the peer
        return self

    def __exit__(self, *exc) -> None:
        for i in range(self.peers):
            subprocess.run(["ip", "netns", "del", _namespace(i)], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def start_swarm(network: ShapedNetwork, num_layers: int) -> LocalSwarm:
    swarm = LocalSwarm(model=None)
    for i, layers in enumerate(even_ranges(num_layers, network.peers)):
        proc = swarm.launch(layers, ["--host", network.host(i)], prefix=network.prefix(i))
        swarm.wait_ready(proc)
    return swarm


async def _timed(coroutine) -> float:
    t0 = time.perf_counter()
    await coroutine
    return time.perf_counter() - t0


async def measure(source, maddrs: list[str], ids: list[int], batch: torch.Tensor, args) -> dict[str, list]:
    """Per codec: [generation tok/s, forward seconds, training step seconds], None where not applicable."""
    client = await join_swarm(maddrs, host=f"{SUBNET}.1", client_mode=True)
    results = {}
    try:
        for codec in dict.fromkeys(INFERENCE_CODECS + TRAINING_CODECS):
            model = RemoteCausalLM(source, client, compression=codec)
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
    if os.geteuid() != 0 or shutil.which("tc") is None:
        print("bench_slow_links: error: needs root and iproute2 (ip netns, tc)", file=sys.stderr)
        sys.exit(2)
    source = resolve_model(None)
    model = RemoteCausalLM(source)
    ids = model.encode(PROMPT, chat=True)
    batch = torch.randint(0, model.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    table = {}
    for mbit in (int(r) for r in args.rates.split(",")):
        print(f"links shaped to {mbit} Mbit/s:", file=sys.stderr)
        with ShapedNetwork(PEERS, mbit) as network:
            swarm = start_swarm(network, model.config.num_hidden_layers)
            try:
                table[mbit] = uvloop.run(measure(source, swarm.maddrs, ids, batch, args))
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
