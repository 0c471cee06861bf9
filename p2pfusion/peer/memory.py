"""How much memory a peer gives sessions' KV caches, and giving freed memory back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

CACHE_SHARE = 0.5  # of the memory left free once the weights are loaded
TRIM_AFTER = 16 << 20  # bytes of sessions freed before the heap is trimmed (or none left open)


def default_cache_memory(free: int, weights: int) -> int:
    """Bytes of KV cache for all sessions together, unless the operator says: half of what the
    device had free before the stage was loaded (`free`), less the stage's weights. The other half
    stays for activations (prefill chunks, batched steps), the allocator's slack and the rest of
    the machine. Peers sharing a device each see as free what the others reserved but have not
    filled yet: their operators split it with --cache-mib."""
    return max(int(CACHE_SHARE * (free - weights)), 0)


def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        return None


_TRIM = _malloc_trim()


def trim() -> None:
    """Return the heap's free pages to the system. glibc keeps freed KV caches (grown by many small
    reallocations) in its heap: RSS stayed near its peak after the sessions closed."""
    if _TRIM is not None:
        _TRIM(0)
