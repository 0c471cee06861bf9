"""Greedy next tokens of the sessions that want one at the same moment, as one head computation.

A client running many sessions releases a cohort's members together (client/generate/lockstep.py); each
would then run the LM head on its own, a matrix-vector product over the whole vocabulary each.
Requests made in the same turn of the event loop are answered together instead: one final norm
and one float32 matrix product for all of them, which also sends their next steps to the first
peer together, to be batched there.
Fewer than BATCHED_ROWS requests go through the float16 screen one by one, which costs less then.

How many threads the head runs on is learned from its own calls (`HeadThreads`): the client idles
while the swarm computes, and waking a second thread after that cost 6-10 ms on this project's VMs,
more than a one-row screen (3 ms on one thread), while eight rows took 33 ms on one thread and
17 ms on two (docs/benchmarks.md). No fixed choice suits every size of call and every machine.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable

import torch

from p2pfusion.client.generate.screen import ScreenedHead

log = logging.getLogger(__name__)

BATCHED_ROWS = 4  # from this many rows, one float32 product costs less than screening each (docs/benchmarks.md)
TRIALS = 4  # timed calls per thread count and size of call, taking turns, before the faster one is kept
MARGIN = 0.1  # more threads must be this much faster: they take cores the peers on this host may need


def faster_threads(times: dict[int, list[float]], trials: int = TRIALS) -> int | None:
    """The fewest threads whose median time is within MARGIN of the best, once every option has
    `trials` timings (None before)."""
    if not times or any(len(seconds) < trials for seconds in times.values()):
        return None
    medians = {threads: statistics.median(seconds) for threads, seconds in times.items()}
    chosen = min(medians)
    for threads in sorted(medians):
        if medians[threads] < (1 - MARGIN) * medians[chosen]:
            chosen = threads
    return chosen


def size_of(rows: int) -> int:
    """Calls of 1, 2-3, 4-7 and 8 or more rows are timed apart."""
    return 1 << (min(rows, 8).bit_length() - 1)


class HeadThreads:
    """The one owner of what the head's calls measured, per size of call, and what was kept."""

    def __init__(self, options: list[int]):
        self._options = options
        self._times: dict[int, dict[int, list[float]]] = {}
        self._kept: dict[int, int] = {}

    def threads(self, rows: int) -> int:
        size = size_of(rows)
        if size in self._kept:
            return self._kept[size]
        times = self._times.setdefault(size, {threads: [] for threads in self._options})
        return min(times, key=lambda threads: len(times[threads]))  # the options take turns

    def timed(self, rows: int, threads: int, seconds: float) -> None:
        size = size_of(rows)
        if size in self._kept:
            return
        self._times[size][threads].append(seconds)
        kept = faster_threads(self._times[size])
        if kept is not None:
            self._kept[size] = kept
            log.debug("the LM head runs calls of %d+ rows on %d thread(s)", size, kept)


class HeadBatcher:
    def __init__(
        self,
        screen: ScreenedHead,
        norm: Callable[[torch.Tensor], torch.Tensor],
        exact: Callable[[torch.Tensor], int],
    ):
        self.screen = screen
        self.norm = norm  # hidden states [rows, 1, hidden] -> the final norm's output
        self.exact = exact  # the full float32 head's greedy token for one [1, 1, hidden]
        self._waiting: list[tuple[torch.Tensor, asyncio.Future]] = []
        self.threads = HeadThreads(sorted({1, torch.get_num_threads()}))

    async def next_token(self, last: torch.Tensor) -> int:
        """The greedy token after `last` [1, 1, hidden], the last position's hidden states."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((last, future))
        if len(self._waiting) == 1:
            asyncio.get_running_loop().call_soon(self._answer)
        return await future

    @torch.inference_mode()
    def _answer(self) -> None:
        waiting, self._waiting = self._waiting, []
        live = [(last, future) for last, future in waiting if not future.cancelled()]
        if not live:
            return
        try:
            tokens = self._screened(torch.cat([last for last, _ in live]))
            answers = [self.exact(last) if token is None else token for (last, _), token in zip(live, tokens)]
        except Exception as exc:  # not ours to judge: each waiting session raises it as its own
            for _, future in live:
                future.set_exception(exc)
            return
        for (_, future), token in zip(live, answers):
            future.set_result(token)

    def _screened(self, last: torch.Tensor) -> list[int | None]:
        rows, previous = last.shape[0], torch.get_num_threads()
        threads = self.threads.threads(rows)
        if threads != previous:
            torch.set_num_threads(threads)
        try:
            started = time.perf_counter()
            normed = self.norm(last)[:, -1]
            if rows < BATCHED_ROWS:
                tokens = [self.screen.next_token(row) for row in normed]
            else:
                tokens = self.screen.next_tokens(normed)
            self.threads.timed(rows, threads, time.perf_counter() - started)
            return tokens
        finally:
            if threads != previous:
                torch.set_num_threads(previous)
