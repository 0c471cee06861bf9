#!/usr/bin/env python
"""Weight formats against float32 on the default model: memory, speed, tokens and perplexity.

Each format holds all 30 layers as one stage (models/stage.py's load_stage, as a peer loads
them), and the client's head stays float32, as in the swarm. Per format:
1. memory per layer: the bytes its weights take as stored, and what a peer plans with
   (models/formats.py's layer_sizes, from the headers);
2. speed, against float32 in the same run, the formats taking turns: a decode step (one token
   after a 64-token prefix, KV-cached) and a forward of 128 tokens, median of several;
3. greedy-token agreement with float32: the codec benchmark's prompts (8 x 64 tokens);
4. perplexity on held-out text (CPython's documentation, 4 windows of 256 tokens), the relative
   error of the final hidden states against float32, and the total variation between the
   next-token distributions the client's head reads from both (the verifier's bars are set from
   these two).
Usage: python scripts/bench_formats.py [--formats float32,bfloat16,float16,int8,int4] [--tokens 64] [--prompts 8]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import pydoc_data.topics
import torch
from tqdm import tqdm

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.checks.policy import relative_errors, total_variation
from p2pfusion.models.formats import WeightFormat, layer_sizes, load_settings
from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import load_stage

_spec = importlib.util.spec_from_file_location("bench_codecs", Path(__file__).with_name("bench_codecs.py"))
codecs_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(codecs_bench)

PREFIX, FORWARD_TOKENS, REPEATS = 64, 128, 7
PPL_WINDOWS, PPL_TOKENS = 4, 256


def held_out(tokenizer) -> torch.Tensor:
    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)[::4])
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    return ids[: PPL_WINDOWS * PPL_TOKENS].view(PPL_WINDOWS, PPL_TOKENS)


@torch.inference_mode()
def timings(stages: dict, hidden_size: int) -> dict:
    """Median seconds of a decode step and of a 128-token forward per format, taking turns."""
    torch.manual_seed(0)
    prefix, step, block = torch.randn(1, PREFIX, hidden_size), torch.randn(1, 1, hidden_size), torch.randn(1, FORWARD_TOKENS, hidden_size)
    times = {fmt: ([], []) for fmt in stages}
    for _ in range(REPEATS):
        for fmt, stage in stages.items():
            cache = stage.new_cache()
            stage.forward(prefix, 0, cache)
            t0 = time.perf_counter()
            stage.forward(step, PREFIX, cache)
            times[fmt][0].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            stage.forward(block, 0)
            times[fmt][1].append(time.perf_counter() - t0)
    return {fmt: (statistics.median(d), statistics.median(f)) for fmt, (d, f) in times.items()}


@torch.inference_mode()
def perplexity(model: RemoteCausalLM, stage, rows: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Perplexity of `rows`, their final hidden states and the head's logits."""
    hidden = stage.forward(model.head.get_input_embeddings()(rows).float(), 0)
    logits = model.logits(hidden).float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
    return float(loss.exp()), hidden, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=",".join(f.value for f in WeightFormat), help="comma-separated")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    print(machine_header(), flush=True)
    formats = [WeightFormat(name) for name in args.formats.split(",")]
    if WeightFormat.FLOAT32 not in formats:
        formats.insert(0, WeightFormat.FLOAT32)

    source = resolve_model(None)
    model = RemoteCausalLM.build(source)
    layers = model.config.num_hidden_layers
    stages = {}
    for fmt in tqdm(formats, desc="loading formats", file=sys.stderr):
        dtype, quant = load_settings(fmt)
        stages[fmt] = load_stage(source, 0, layers, dtype, quant=quant)
    print(f"default model ({source.name}), {layers} layers as one stage, client head float32, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    speed = timings(stages, model.config.hidden_size)
    rows = held_out(model.tokenizer)
    prompts = [model.encode(p, chat=True) for p in codecs_bench.PROMPTS[: args.prompts]]
    base_ppl, base_hidden, base_logits = perplexity(model, stages[WeightFormat.FLOAT32], rows)
    reference = [codecs_bench.greedy(model, [stages[WeightFormat.FLOAT32]], ids, args.tokens, None) for ids in prompts]

    print(f"\n| format | MiB/layer (planned) | of float32 | decode step | speed vs float32 | {FORWARD_TOKENS}-token forward "
          f"| speed vs float32 | identical prompts | tokens before 1st difference | perplexity (ratio) | hidden-state error "
          f"| next-token total variation (median; max) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    f32_bytes = stages[WeightFormat.FLOAT32].parameter_bytes()
    f32_decode, f32_forward = speed[WeightFormat.FLOAT32]
    for fmt in tqdm(formats, desc="tokens and perplexity", file=sys.stderr):
        stage = stages[fmt]
        dtype, _ = load_settings(fmt)
        planned = sum(layer_sizes(source.folder, layers, fmt, dtype)) / layers
        same, shares = 0, []
        for ids, ref in zip(prompts, reference):
            got = reference[len(shares)] if fmt == WeightFormat.FLOAT32 else codecs_bench.greedy(model, [stage], ids, args.tokens, None)
            first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
            same += first == len(ref)
            shares.append(first / len(ref))
        ppl, hidden, logits = perplexity(model, stage, rows)
        error = float(relative_errors(hidden, base_hidden).max())
        shift = total_variation(logits, base_logits)
        decode, forward = speed[fmt]
        print(f"| {fmt.value} | {stage.parameter_bytes() / layers / 2**20:.2f} ({planned / 2**20:.2f}) | "
              f"{stage.parameter_bytes() / f32_bytes:.2f} | {1e3 * decode:.1f} ms | {f32_decode / decode:.2f}x | "
              f"{1e3 * forward:.0f} ms | {f32_forward / forward:.2f}x | {same} / {len(prompts)} | "
              f"{100 * statistics.mean(shares):.0f} % | {ppl:.2f} ({ppl / base_ppl:.3f}) | {error:.3g} | "
              f"{float(shift.median()):.3g}; {float(shift.max()):.3g} |")


if __name__ == "__main__":
    main()
