"""What the stage's one compute thread runs next.

Steps run one at a time on one thread (torch already uses every core per op, and an adapter hooks
the shared module for the length of its step). A long prefill is cut into chunks of a few hundred
positions, each its own job, so decoding steps (a few positions each) run between the chunks
instead of waiting for the whole prefill; and the chunks of different sources take turns, so one
client sending prefill after prefill cannot starve another's.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

URGENT_ROWS = 32  # a step of at most this many positions (batch x tokens) runs before any chunk


@dataclass(frozen=True)
class Pending:
    source: str
    rows: int
    order: int  # arrival


def pick(pending: list[Pending], last_source: str | None) -> int:
    """Index of the job to run next: the oldest urgent one; else the oldest of the source that
    comes after `last_source` (the source of the last chunk run), in a fixed ring of sources."""
    urgent = [i for i, job in enumerate(pending) if job.rows <= URGENT_ROWS]
    if urgent or last_source is None:
        return min(urgent or range(len(pending)), key=lambda i: pending[i].order)
    sources = sorted({job.source for job in pending})
    after = [s for s in sources if s > last_source]
    source = after[0] if after else sources[0]
    return min((i for i, job in enumerate(pending) if job.source == source), key=lambda i: pending[i].order)


def chunks(tokens: int, batch: int, chunk_rows: int) -> list[tuple[int, int]]:
    """Token ranges [a, b) of a step cut into pieces of at most `chunk_rows` positions (at least one
    token each)."""
    size = max(1, chunk_rows // batch)
    return [(a, min(tokens, a + size)) for a in range(0, tokens, size)]


@dataclass
class _Job:
    pending: Pending
    run: Callable[[], Any]
    future: asyncio.Future


class Scheduler:
    """One compute thread, and the queue in front of it, ordered by `pick`."""

    def __init__(self):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")
        self._jobs: list[_Job] = []
        self._busy = False
        self._last_source: str | None = None
        self._order = itertools.count()

    @property
    def idle(self) -> bool:
        return not self._busy and not self._jobs

    async def run(self, source: str, rows: int, fn: Callable, *args) -> Any:
        loop = asyncio.get_running_loop()
        job = _Job(Pending(source, rows, next(self._order)), functools.partial(fn, *args), loop.create_future())
        self._jobs.append(job)
        self._dispatch()
        return await job.future

    def _dispatch(self) -> None:
        self._jobs = [job for job in self._jobs if not job.future.cancelled()]  # their sessions ended
        if self._busy or not self._jobs:
            return
        job = self._jobs.pop(pick([j.pending for j in self._jobs], self._last_source))
        if job.pending.rows > URGENT_ROWS:
            self._last_source = job.pending.source
        self._busy = True
        done = asyncio.get_running_loop().run_in_executor(self._thread, job.run)
        done.add_done_callback(functools.partial(self._finish, job))

    def _finish(self, job: _Job, done: asyncio.Future) -> None:
        self._busy = False
        if done.cancelled():  # the thread was shut down
            job.future.cancel()
        elif not job.future.cancelled():
            if done.exception() is not None:
                job.future.set_exception(done.exception())
            else:
                job.future.set_result(done.result())
        self._dispatch()

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
