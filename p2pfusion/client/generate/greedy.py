"""Greedy next tokens of the sessions that want one at the same moment, as one head computation.

A client running many sessions releases a cohort's members together (client/generate/lockstep.py); each
would then run the LM head on its own, a matrix-vector product over the whole vocabulary each.
Requests made in the same turn of the event loop are answered together instead: one final norm
and one matrix product for all of them (generate/screen.py), which also sends their next steps to
the first peer together, to be batched there.
Fewer than BATCHED_ROWS requests go through the float16 screen one by one, which costs less then
where a float16 product is faster than a float32 one. On a CPU that converts float16 as it
multiplies, the screen saves nothing: on an Intel Xeon VM, with cold caches and two threads, a
one-row screen took 6.2 ms, and the float32 product with its top two kept apart 6.0 ms.

How the head runs is learned from its own calls (`HeadWays`): on how many threads, and whether
screened in a narrower format (float16 for a few rows, bfloat16 for many) or taken in float32. The
client idles while the swarm computes, and waking a second thread after that cost 6-10 ms on this
project's VMs, more than a one-row screen (3 ms on one thread), while eight rows took 33 ms on one
thread and 17 ms on two; a bfloat16 product of eight rows took 4 ms on a CPU with AVX512-BF16 and
is slow on one without (docs/benchmarks.md). No fixed choice suits every size of call and every
machine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch

from p2pfusion.client.generate.screen import ScreenedHead
from p2pfusion.models.trials import Trials, first_unless_beaten, size_class

log = logging.getLogger(__name__)

BATCHED_ROWS = 4  # from this many rows, one product costs less than screening each (docs/benchmarks.md)
TRIALS = 4  # the latest timings per way and size of call that decide, taking turns before the first decision
MARGIN = 0.1  # a later way must be this much faster: more threads take cores the peers on this host may need
REVISIT = 32  # once decided, one call in this many takes another way, so the timings follow the machine

Way = tuple[int, bool]  # threads, and whether screened narrower (float16 for few rows, bfloat16 for many) or in float32


# of the ways in the order given (fewest threads first), the first no later one beats by MARGIN
kept_way = first_unless_beaten(MARGIN)


class HeadWays:
    """The one owner of what the head's calls measured, per size of call, and the way kept for it:
    its thread count, and whether the product is screened narrower (float16 row by row for fewer
    than BATCHED_ROWS; bfloat16 for more, fast where the CPU multiplies it natively, slow
    elsewhere) or taken in float32. What is fastest moves with the machine's load and with what
    waking a thread costs at the hour, so the decision stands on each way's latest TRIALS timings,
    and the other ways are timed again now and then (one call in REVISIT, in turn;
    models/trials.py)."""

    def __init__(self, threads: list[int]):
        self._threads = threads
        self._trials: Trials[Way] = Trials(TRIALS, REVISIT, kept_way)
        self._kept: dict[int, Way] = {}

    def way(self, rows: int) -> Way:
        return self._trials.choose(size_class(rows), [(threads, low) for threads in self._threads for low in (True, False)])

    def timed(self, rows: int, way: Way, seconds: float) -> None:
        size = size_class(rows)
        self._trials.add(size, way, seconds)
        kept = self._trials.decided(size)
        if kept is not None and kept != self._kept.get(size):
            self._kept[size] = kept
            log.debug("the LM head runs calls of %d+ rows on %d thread(s), %s", size, kept[0],
                      "screened narrower" if kept[1] else "in float32")


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
        self.ways = HeadWays(sorted({1, torch.get_num_threads()}))

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
        threads, narrow = way = self.ways.way(rows)
        if threads != previous:
            torch.set_num_threads(threads)
        try:
            started = time.perf_counter()
            normed = self.norm(last)[:, -1]
            if rows < BATCHED_ROWS and narrow:
                tokens = [self.screen.next_token(row) for row in normed]
            else:
                tokens = self.screen.next_tokens(normed, bfloat16=narrow)
            self.ways.timed(rows, way, time.perf_counter() - started)
            return tokens
        finally:
            if threads != previous:
                torch.set_num_threads(previous)
