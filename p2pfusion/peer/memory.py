"""How much memory a peer gives sessions, and giving freed memory back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

log = logging.getLogger(__name__)

SESSION_MEMORY_CAP = 16 << 30
TRIM_AFTER = 16 << 20  # bytes of sessions freed before the heap is trimmed (or none left open)


def default_session_memory(device: str) -> int:
    """Bytes of KV cache for all sessions together: on a GPU, half of what is free once the weights
    are loaded; on the CPU a quarter of the machine's memory; at most SESSION_MEMORY_CAP."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return min(free // 2, SESSION_MEMORY_CAP)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(total // 4, SESSION_MEMORY_CAP)


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
