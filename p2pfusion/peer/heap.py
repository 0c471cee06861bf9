"""Giving the C heap's free pages back to the system at moments no step waits for it.

glibc keeps what a process frees in its heap for reuse: ended sessions' KV caches (grown by many
small reallocations) and a quantized stage's dequantized temporaries stayed resident long after
their use. A trim returns them but holds the heap's lock for 10-20 ms, stalling the compute
thread's allocations, so it runs on its own thread, only when peer/memory.py's policies say so.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from p2pfusion.models.formats import trim_heap
from p2pfusion.peer import memory

SETTLE = 0.05  # seconds after a step before a trim: the step's output is on its way, the next not yet here


class HeapTrimmer:
    """The one owner of when the heap was last trimmed and what was freed since."""

    def __init__(self, compute_idle: Callable[[], bool]):
        self._compute_idle = compute_idle
        self._freed = 0  # bytes of sessions ended since the last trim
        self._trimmed = 0.0  # when it was, on the monotonic clock
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None

    def _since(self) -> float:
        return time.monotonic() - self._trimmed

    async def session_ended(self, reserved: int, open_sessions: int) -> None:
        self._freed += reserved
        if memory.trim_due(self._freed, open_sessions, self._since()):
            await self._trim()

    def step_done(self, quantized_on_cpu: bool) -> None:
        """Plan a trim for once the compute has gone idle, so that a quantized stage at rest holds
        none of its last steps' temporaries, and a busy one trims at most every few seconds."""
        if not quantized_on_cpu or self._timer is not None:
            return
        delay = max(memory.QUANTIZED_TRIM_EVERY - self._since(), SETTLE)
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        # busy: the step running now plans the next try when it is done
        if memory.quantized_trim_due(True, self._compute_idle(), self._since()) and self._task is None:
            self._task = asyncio.ensure_future(self._trim())
            self._task.add_done_callback(self._trimmed_done)

    def _trimmed_done(self, _task: asyncio.Task) -> None:
        self._task = None

    async def _trim(self) -> None:
        self._freed, self._trimmed = 0, time.monotonic()
        await asyncio.to_thread(trim_heap)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
