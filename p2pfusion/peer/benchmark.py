"""Measure what this peer can offer: compute per layer and link speed.

Compute is timed as a pipeline stage meets it: one-token steps after idle gaps, for each thread
count (and kept warm), so that a peer picks what is fastest on its own machine (peer/threads.py).
Results are cached on disk, keyed by model, device and weight format, so a restart
does not measure again (`--throughput eval` forces it). Links are measured at every start, to
peers of the swarm it joins, over our own transport: there is no speed-test server.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from p2pfusion.models.formats import WeightFormat
from p2pfusion.models.source import ModelSource, cache_root, safe_name
from p2pfusion.models.stage import load_config, load_stage
from p2pfusion.peer.compute import spin
from p2pfusion.peer.threads import DecodeSettings, StepCost, choose_decode_settings, thread_options

log = logging.getLogger(__name__)

PROBE_LAYERS = 4  # timed together, so per-call overhead is shared as in a real stage
PREFILL_TOKENS = 16
DECODE_STEPS = 16  # per option, back to back
IDLE_STEPS = 12  # per option, each after IDLE_GAP
# A pipeline stage idles while the others compute: about two thirds of a token of a 3-stage
# swarm of the default model on 2 cores, where a token takes 35-50 ms
IDLE_GAP = 0.025
BATCH_TOKENS = 128


@dataclass(frozen=True)
class ComputeBenchmark:
    decode_rate: float  # one-token steps per second through one layer, with a KV cache, after idle gaps
    batch_rate: float  # tokens per second through one layer, in a 1x128 forward
    device_name: str
    # CPU threads for one-token steps, and whether they spin between a session's steps: what ran
    # fastest here after an idle gap like a pipeline's (peer/threads.py)
    decode_threads: int
    decode_warm: bool = False

    @property
    def decode(self) -> DecodeSettings:
        return DecodeSettings(self.decode_threads, self.decode_warm)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    if device == "mps":
        return "Apple MPS"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def free_memory(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cache_path(source: ModelSource, device: str, dtype: torch.dtype, quant: WeightFormat | None) -> Path:
    fmt = f"{dtype}-{quant.value}" if quant is not None else str(dtype)
    # "-idle": measured after idle gaps; earlier files timed steps back to back only
    return cache_root() / "benchmarks" / f"{safe_name(f'{source.key}-{device}-{fmt}')}-idle.json"


def step_costs(
    stage, hidden: int, options: list[tuple[int, bool]], bar: tqdm | None = None, gap: float = IDLE_GAP,
) -> list[StepCost]:
    """Each option (threads, warm)'s median one-token step back to back and after `gap` (spent sleeping, or
    spinning where the option keeps threads warm). Options take turns, so a busy moment of a
    shared machine hits them alike; medians, because the first steps warm caches up."""
    caches = {option: stage.new_cache() for option in options}
    for cache in caches.values():
        stage.forward(torch.randn(1, PREFILL_TOKENS, hidden), 0, cache)
    times: dict[tuple[int, bool], tuple[list[float], list[float]]] = {option: ([], []) for option in options}
    for i in range(DECODE_STEPS + IDLE_STEPS):
        idle = i >= DECODE_STEPS
        for (threads, warm), cache in caches.items():
            torch.set_num_threads(threads)
            step = torch.randn(1, 1, hidden)
            if idle and warm:
                spin(threads, time.perf_counter() + gap)
            elif idle:
                time.sleep(gap)
            t0 = time.perf_counter()
            stage.forward(step, PREFILL_TOKENS + i, cache)
            if stage.device.type == "cuda":
                torch.cuda.synchronize()
            times[threads, warm][idle].append(time.perf_counter() - t0)
            if bar is not None:
                bar.update(1)
    return [
        StepCost(threads, warm, statistics.median(busy), statistics.median(after))
        for (threads, warm), (busy, after) in times.items()
    ]


def measure_compute(source: ModelSource, device: str, dtype: torch.dtype, quant: WeightFormat | None) -> ComputeBenchmark:
    config = load_config(source)
    layers = min(PROBE_LAYERS, config.num_hidden_layers)
    stage = load_stage(source, 0, layers, dtype, device, quant)
    hidden = config.hidden_size
    all_threads = torch.get_num_threads()
    threads = thread_options(all_threads) if device == "cpu" else [all_threads]
    options = [(n, False) for n in threads] + [(n, True) for n in threads if n > 1]
    with tqdm(total=len(options) * (DECODE_STEPS + IDLE_STEPS) + 3, desc="benchmarking compute", unit="step",
              file=sys.stderr, leave=False, disable=not sys.stderr.isatty()) as bar:
        costs = step_costs(stage, hidden, options, bar)
        torch.set_num_threads(all_threads)
        batch = torch.randn(1, BATCH_TOKENS, hidden)
        batch_times = []
        for _ in range(3):
            t0 = time.perf_counter()
            stage.forward(batch, 0, None)
            if stage.device.type == "cuda":
                torch.cuda.synchronize()
            batch_times.append(time.perf_counter() - t0)
            bar.update(1)
    chosen = choose_decode_settings(costs)
    log.info("one-token steps through %d layers, back to back / after %.0f ms idle: %s", layers, IDLE_GAP * 1000,
             "; ".join(c.describe() for c in costs))
    cost = next(c for c in costs if (c.threads, c.warm) == (chosen.threads, chosen.warm))
    return ComputeBenchmark(
        layers / cost.after_idle, layers * BATCH_TOKENS / min(batch_times), device_name(device),
        chosen.threads, chosen.warm,
    )


def compute_benchmark(
    source: ModelSource, device: str, dtype: torch.dtype, quant: WeightFormat | None = None, force: bool = False,
) -> ComputeBenchmark:
    """The cached measurement for this model, device and format, or a new one."""
    path = _cache_path(source, device, dtype, quant)
    if not force:
        try:
            cached = ComputeBenchmark(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            cached = None
        here = device_name(device)
        if cached is not None and cached.device_name == here:
            log.info("reusing the compute benchmark in %s: one-token steps on %s", path, cached.decode.describe())
            return cached
        if cached is not None:  # a home folder shared or copied across machines
            log.info("the cached compute benchmark was measured on %s, not %s: measuring again", cached.device_name, here)
    result = measure_compute(source, device, dtype, quant)
    log.info(
        "benchmark: %.0f layer-steps/s decoding on %s, %.0f layer-tokens/s in batches",
        result.decode_rate, result.decode.describe(), result.batch_rate,
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(result)))
    except OSError as exc:
        log.warning("cannot cache the benchmark in %s: %s", path, exc)
    return result
