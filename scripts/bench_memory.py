#!/usr/bin/env python
"""Resident memory of a peer process per weight format, against float32 in the same run.

For each model and format, a real peer process (`p2pfusion run-peer`) serves the measured layers;
a client generates a few tokens through it, so every layer has run a forward (a float32 peer's
weights are mapped from the file and become resident only when touched); then, once the peer has
idled a few seconds: its resident memory (VmRSS), the peak while it loaded (VmHWM when it began
serving) and the peak overall. Planned weights are what the peer counts before loading
(models/formats.py's layer_sizes); "the rest" is RSS less them: interpreter, libraries, caches.
Models: the random 400M Llama of tests/random_llama.py, all 24 layers in one peer; the default
model, layers 0:10 in the measured peer (a float32 peer serves 10:30 beside it).
Usage: python scripts/bench_memory.py [--formats float32,bfloat16,int8,int4] [--models 400m,default]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import asyncio
import importlib.util
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.formats import layer_sizes, weight_format
from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import load_config

_spec = importlib.util.spec_from_file_location("random_llama", Path(__file__).parents[1] / "tests" / "random_llama.py")
random_llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(random_llama)

MIB = 1 << 20
IDS = [3, 17, 42, 99, 5, 250, 7, 1]
NEW = 16
IDLE = 4.0  # seconds the peer rests before the reading: past a quantized stage's heap trim
OPTIONS = {"float32": [], "bfloat16": ["--dtype", "bfloat16"], "int8": ["--quant", "int8"], "int4": ["--quant", "int4"]}


def status_mib(pid: int) -> dict[str, float]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) / 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


async def generate(maddrs: list[str], folder: str) -> None:
    client = await join_swarm(maddrs, client_mode=True)
    try:
        model = RemoteCausalLM.build(resolve_model(folder), client, compression="none", verify=0.0)
        await model.generate(IDS, NEW, stop_at_eos=False, decode=False)
    finally:
        await client.shutdown()


def measure(model: str | None, layers: tuple[int, int], companion: tuple[int, int] | None, fmt: str) -> dict:
    swarm = LocalSwarm(model=model, fork=False)  # each peer process as a volunteer starts it
    with swarm:
        proc = swarm.launch(layers, [*OPTIONS[fmt], "--throughput", "100"])
        swarm.wait_ready(proc, timeout=300)
        loading = status_mib(proc.pid)["VmHWM"]
        if companion is not None:
            swarm.wait_ready(swarm.launch(companion, ["--throughput", "100"]), timeout=300)
        asyncio.run(generate(swarm.maddrs, model))
        time.sleep(IDLE)
        return {**status_mib(proc.pid), "loading": loading}


def planned(folder: Path, layers: tuple[int, int], fmt: str) -> float:
    dtype = torch.float32 if fmt in ("float32", "int8", "int4") else getattr(torch, fmt)
    quant = fmt if fmt in ("int8", "int4") else None
    sizes = layer_sizes(folder, layers[1], weight_format(dtype, quant), dtype)
    return sum(sizes[layers[0]:]) / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="float32,bfloat16,int8,int4")
    parser.add_argument("--models", default="400m,default")
    args = parser.parse_args()
    print(machine_header(), flush=True)
    formats = args.formats.split(",")
    with tempfile.TemporaryDirectory() as scratch:
        setups = []
        for name in args.models.split(","):
            if name == "400m":
                print("writing the random 400M Llama ...", file=sys.stderr)
                folder = random_llama.write_random_llama(Path(scratch) / "llama-400m")
                setups.append((name, str(folder), folder, (0, random_llama.CONFIG["num_hidden_layers"]), None))
            else:
                source = resolve_model(None)
                total = load_config(source).num_hidden_layers
                setups.append((name, None, source.folder, (0, 10), (10, total)))
        print("| model | layers | format | planned weights | RSS serving | vs float32 | the rest | peak loading | peak |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, model, folder, layers, companion in setups:
            base = None
            for fmt in formats:
                print(f"{name} {fmt} ...", file=sys.stderr)
                got, weights = measure(model, layers, companion, fmt), planned(folder, layers, fmt)
                base = got["VmRSS"] if fmt == "float32" else base
                ratio = f"{got['VmRSS'] / base:.2f}" if base else "-"
                print(
                    f"| {name} | {layers[0]}:{layers[1]} | {fmt} | {weights:.0f} MiB | {got['VmRSS']:.0f} MiB | {ratio} "
                    f"| {got['VmRSS'] - weights:.0f} MiB | {got['loading']:.0f} MiB | {got['VmHWM']:.0f} MiB |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
