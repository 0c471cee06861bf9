"""How many layers fit a peer's memory, how much it gives sessions' KV caches, and when to give
freed memory back to the system (peer/heap.py does, when these policies say so).

A peer's budget (`--max-memory`, or by default most of what the device has free) covers
everything the peer holds: on CPU, the process itself too (its interpreter and libraries, read
from its resident set before any layer loads, and SERVING_RESERVE for what serving adds). Layers
take their size in the peer's format, and
each keeps room for KV_RESERVE_TOKENS tokens of KV cache (fewer if no session may be that long);
what is left once they are loaded goes to sessions and activations.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_SHARE = 0.5  # of the memory left free once the weights are loaded
MEMORY_SHARE = 0.8  # of the device's free memory, what a peer takes when not told (--max-memory)
KV_RESERVE_TOKENS = 4096  # tokens of KV cache each layer keeps room for (at most the peer's --session-limit)
# what serving adds to the process beyond its layers: library code paged in by the first steps and
# a step's activations (a peer of 9 float32 layers of 64 MiB grew by about 100 MiB over its first steps)
SERVING_RESERVE = 128 << 20
TRIM_AFTER = 16 << 20  # bytes of sessions freed before the heap is trimmed (or none left open)
# seconds between trims while sessions stay open: a trim walks the heap, holding up the compute
# thread's allocations, and a client whose idle sessions expire together (each reserving more
# than TRIM_AFTER) had set off one per session, slowing others' tokens 2.5x (docs/benchmarks.md)
TRIM_EVERY = 10.0
# seconds between trims while a quantized stage on CPU serves: its forwards dequantize each weight
# into a temporary, and glibc kept about 300 MiB of them (a quarter of the weights of a 400M int8
# stage) until a trim (docs/benchmarks.md); a trim takes 10-20 ms, so it runs only while the compute is idle
QUANTIZED_TRIM_EVERY = 2.0
DEQUANTIZED_LAYERS = 4  # float32 layers' worth of dequantized temporaries a quantized CPU stage holds at its peak


def layers_that_fit(
    budget: int, used: int, layer_bytes: int, kv_token_bytes: int, session_limit: int, temporaries: int = 0
) -> int:
    """Layers of `layer_bytes` each (with their KV reserve) that fit in `budget` bytes, `used`
    of which the peer already holds; its sessions are at most `session_limit` tokens long, and its
    forwards' temporaries take `temporaries` bytes beside the serving reserve."""
    reserve = min(KV_RESERVE_TOKENS, session_limit) * kv_token_bytes
    return max(budget - used - SERVING_RESERVE - temporaries, 0) // (layer_bytes + reserve)


def dequantized_temporaries(float32_layer_bytes: int) -> int:
    """What a quantized stage on CPU holds for its forwards' dequantized weights: each forward
    dequantizes a layer's weights into temporaries, and the threads' heaps keep several layers'
    worth of them (a 0:24 int8 peer of the 400M model, whose plan left 100 MiB spare under a
    1 GiB budget, peaked 10-270 MiB over it in some runs: up to about 4 of its 64 MiB float32 layers)."""
    return DEQUANTIZED_LAYERS * float32_layer_bytes


def default_budget(free: int, used: int) -> int:
    """A peer's budget when its operator sets none: most of the device's free memory, plus what it holds."""
    return int(MEMORY_SHARE * free) + used


def resident_bytes() -> int:
    """This process's resident memory (0 where /proc is missing: then the budget is all for layers)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def default_cache_memory(free: int, weights: int) -> int:
    """Bytes of KV cache for all sessions together, unless the operator says: half of what the
    device had free before the stage was loaded (`free`), less the stage's weights. The other half
    stays for activations (prefill chunks, batched steps), the allocator's slack and the rest of
    the machine. Peers sharing a device each see as free what the others reserved but have not
    filled yet: their operators split it with --cache-mib."""
    return max(int(CACHE_SHARE * (free - weights)), 0)


def quantized_trim_due(quantized_on_cpu: bool, compute_idle: bool, since_trim: float) -> bool:
    """Whether to trim the heap after a step of a stage whose forwards free large temporaries."""
    return quantized_on_cpu and compute_idle and since_trim >= QUANTIZED_TRIM_EVERY


def trim_due(freed: int, open_sessions: int, since_trim: float) -> bool:
    """Whether to trim the heap now: `freed` bytes of sessions ended since the last trim,
    `since_trim` seconds ago."""
    if not freed:
        return False
    return open_sessions == 0 or (freed >= TRIM_AFTER and since_trim >= TRIM_EVERY)
