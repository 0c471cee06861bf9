"""Measure what this peer can offer: compute per layer and link speed.

Compute results are cached on disk, keyed by model, device and weight format, so a restart
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

log = logging.getLogger(__name__)

PROBE_LAYERS = 4  # timed together, so per-call overhead is shared as in a real stage
PREFILL_TOKENS = 16
DECODE_STEPS = 24
BATCH_TOKENS = 128
THREADS_MARGIN = 0.1


@dataclass(frozen=True)
class ComputeBenchmark:
    decode_rate: float  # one-token steps per second through one layer, with a KV cache
    batch_rate: float  # tokens per second through one layer, in a 1x128 forward
    device_name: str
    # CPU threads for one-token steps: their matrices are small, so one thread often beats
    # several that must be woken for every op (and stages sharing cores must not spin)
    decode_threads: int


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
    return cache_root() / "benchmarks" / f"{safe_name(f'{source.key}-{device}-{fmt}')}.json"


def _timed(fn, bar: tqdm) -> float:
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    bar.update(1)
    return time.perf_counter() - t0


def measure_compute(source: ModelSource, device: str, dtype: torch.dtype, quant: WeightFormat | None) -> ComputeBenchmark:
    config = load_config(source)
    layers = min(PROBE_LAYERS, config.num_hidden_layers)
    stage = load_stage(source, 0, layers, dtype, device, quant)
    hidden = config.hidden_size
    all_threads = torch.get_num_threads()
    thread_options = sorted({1, all_threads}) if device == "cpu" else [all_threads]
    total = DECODE_STEPS * len(thread_options) + 3
    with tqdm(total=total, desc="benchmarking compute", unit="step", file=sys.stderr, leave=False,
              disable=not sys.stderr.isatty()) as bar:
        caches = {threads: stage.new_cache() for threads in thread_options}
        for cache in caches.values():
            stage.forward(torch.randn(1, PREFILL_TOKENS, hidden), 0, cache)
        step_times: dict[int, list[float]] = {threads: [] for threads in thread_options}
        for i in range(DECODE_STEPS):  # the options take turns, so a busy moment hits both
            for threads, cache in caches.items():
                torch.set_num_threads(threads)
                step = torch.randn(1, 1, hidden)
                step_times[threads].append(_timed(lambda: stage.forward(step, PREFILL_TOKENS + i, cache), bar))
        torch.set_num_threads(all_threads)
        batch = torch.randn(1, BATCH_TOKENS, hidden)
        batch_times = [_timed(lambda: stage.forward(batch, 0, None), bar) for _ in range(3)]
    # the median step: the first ones warm caches up, and a shared machine has bad moments
    step_seconds = {threads: statistics.median(times) for threads, times in step_times.items()}
    # more threads must clearly win: they cost wake-ups, and cores that other stages may need
    decode_threads = min(thread_options)
    if step_seconds[max(thread_options)] < (1 - THREADS_MARGIN) * step_seconds[decode_threads]:
        decode_threads = max(thread_options)
    decode_rate = layers / step_seconds[decode_threads]
    batch_rate = layers * BATCH_TOKENS / min(batch_times)
    return ComputeBenchmark(decode_rate, batch_rate, device_name(device), decode_threads)


def compute_benchmark(
    source: ModelSource, device: str, dtype: torch.dtype, quant: WeightFormat | None = None, force: bool = False,
) -> ComputeBenchmark:
    """The cached measurement for this model, device and format, or a new one."""
    path = _cache_path(source, device, dtype, quant)
    if not force:
        try:
            cached = ComputeBenchmark(**json.loads(path.read_text()))
            log.info("reusing the compute benchmark in %s", path)
            return cached
        except (OSError, ValueError, TypeError):
            pass
    result = measure_compute(source, device, dtype, quant)
    log.info(
        "benchmark: %.0f layer-steps/s decoding (%d threads), %.0f layer-tokens/s in batches",
        result.decode_rate, result.decode_threads, result.batch_rate,
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(result)))
    except OSError as exc:
        log.warning("cannot cache the benchmark in %s: %s", path, exc)
    return result
