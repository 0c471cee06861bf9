#!/usr/bin/env python
"""Codecs: their speed, their size, and whether they change the default model's greedy tokens.

1. Speed: pack + unpack of 1x128x576 float32 hidden states, MB/s of input, and the wire ratio.
2. Token agreement: greedy decoding of the default model split into 3 stages (0:10, 10:20, 20:30),
   with each codec applied at all four crossings (client -> 1 -> 2 -> 3 -> client), exactly as the
   swarm applies it, against the same split with no codec (which equals transformers: the test
   suite checks that). Reported per codec: prompts whose tokens all match, and the mean share of
   tokens generated before the first difference.
Usage: python scripts/bench_codecs.py [--tokens 64] [--prompts 8]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import statistics
import time

import torch

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import load_stage
from p2pfusion.net.codecs import pack, unpack
from p2pfusion.net.compression import Codec

PROMPTS = [
    "What is the capital of France?",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a distributed hash table works.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "Give me a recipe for pancakes.",
    "What is 17 times 23? Show your steps.",
    "Describe the water cycle for a ten-year-old.",
    "Name the planets of the solar system in order.",
]


def codec_speeds(repeats: int = 50) -> dict[Codec, tuple[float, float]]:
    x = torch.randn(1, 128, 576)
    out = {}
    for codec in Codec:
        k = x.numel() // 10
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            packed = pack(x, codec, k)
            unpack(packed.spec, packed.body())
            times.append(time.perf_counter() - t0)
        out[codec] = (x.numel() * 4 / statistics.median(times), x.numel() * 4 / packed.nbytes)
    return out


def through(codec: Codec | None, hidden: torch.Tensor) -> torch.Tensor:
    if codec is None:
        return hidden
    packed = pack(hidden, codec, k=hidden.numel() // 10)
    return unpack(packed.spec, packed.body())


@torch.inference_mode()
def greedy(model: RemoteCausalLM, stages, ids: list[int], tokens: int, codec: Codec | None) -> list[int]:
    caches = [s.new_cache() for s in stages]
    hidden, position, out = model.embed(ids), 0, []
    for _ in range(tokens):
        width = hidden.shape[1]
        for stage, cache in zip(stages, caches):
            hidden = stage.forward(through(codec, hidden), position, cache)
        hidden = through(codec, hidden)
        position += width
        token = int(model.logits(hidden[:, -1:])[0, -1].argmax())
        out.append(token)
        hidden = model.embed([token])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--codecs", default=",".join(c.value for c in Codec), help="comma-separated, for agreement")
    args = parser.parse_args()
    print(machine_header(), flush=True)

    print("codec      pack+unpack MB/s   wire ratio")
    for codec, (speed, ratio) in codec_speeds().items():
        print(f"{codec.value:10} {speed / 1e6:16.0f} {ratio:12.2f}")

    source = resolve_model(None)
    model = RemoteCausalLM.build(source)
    stages = [load_stage(source, a, b) for a, b in ((0, 10), (10, 20), (20, 30))]
    prompts = [model.encode(p, chat=True) for p in PROMPTS[: args.prompts]]
    reference = [greedy(model, stages, ids, args.tokens, None) for ids in prompts]
    print(f"\ntoken agreement with no codec, greedy, {len(prompts)} prompts x {args.tokens} tokens, default model:")
    print("codec      identical prompts   tokens before first difference")
    for codec in (Codec(name) for name in args.codecs.split(",")):
        same, shares = 0, []
        for ids, ref in zip(prompts, reference):
            got = greedy(model, stages, ids, args.tokens, codec)
            first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
            same += first == len(ref)
            shares.append(first / len(ref))
        print(f"{codec.value:10} {same:8d} / {len(prompts):<8d} {100 * statistics.mean(shares):10.1f} %")


if __name__ == "__main__":
    main()
