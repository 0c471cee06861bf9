"""The stage's compute, one step at a time, and the queue in front of it.

Steps run one at a time (torch already uses every core per op, and an adapter hooks the shared
module for the length of its step), with one exception below. Decode steps run on one thread;
prefill chunks and training steps each on a thread of their own that ends with them (so that no
idle OpenMP pool is left to slow the decode steps, models/threads.py), of lower OS priority: where
processes share cores (several peers on one host, a volunteer's own work), bulk work yields the
CPU to latency-bound work, and on a machine of its own it loses nothing (docs/benchmarks.md, Many
users at once: the normal clients' p99 beside a prefill flood went from about 2x to 1.6-1.7x). The
exception: a bulk job that lets others run beside it (an inference prefill chunk that hooks
nothing on the shared module and touches no other session's cache; `peer.compute` says which) does
not hold up the decode steps of units served no more than its own: they start on their own thread
while it runs, and the OS gives them the cores first, so a decode step does not wait for a chunk
to end. A busier unit's decode steps wait for the chunk, as they would for any job of a unit
served less.
`peer.batching.next_batch` decides what runs next and which decode steps run together; this
module keeps the queue, charges each source the compute time its jobs took, and hands results
back to the sessions' tasks.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from p2pfusion.models.threads import FreshThreads
from p2pfusion.peer.batching import Pending, charged, connection_of, next_batch, served, unready

BatchRunner = Callable[[list[Any]], list[Any]]  # items of one key -> their results, in order
# While sessions share the peer, an idle thread takes a decode step a moment after it arrives,
# not at once: steps that came in the same burst (a client's sessions, or a hop's batch passed on)
# are still being read then, or a moment behind, and join its batch. The moment is a quarter of a
# batch's recent time, at most 8 ms (on this project's CPUs: 8 sessions went from 16 to 22
# tokens/s through 3 peers, docs/benchmarks.md); on a GPU, where a step takes a few ms, less.
# A client's cohort (client/generate/lockstep.py) says how many steps it sent together: its batch
# starts as its last step is read, and the moment only bounds the wait for a step that never comes
# (its session ended between the cohort's release and its step).
GATHER_SHARE = 0.25
MAX_GATHER = 0.008
BULK_NICE = 10  # how much lower the OS priority of prefill chunks and training steps is (Linux nice)
# A unit that was away (a new user, or one between turns) comes back at most this many seconds of
# compute behind the least served unit waiting, as a sleeper does under Linux's CFS: its prompt
# then runs before a busy unit's next chunks instead of taking turns with them (beside a flood of
# 2,000-token prefills, a fresh user's 35-token prompt took two chunks' turns at each hop, 0.4 s
# instead of 0.1). Banking more would let a unit that pauses claim a peer for that long.
RETURN_CREDIT = 0.1


def _lower_priority() -> None:
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BULK_NICE)
    except (OSError, AttributeError):  # not Linux, or not allowed: bulk work keeps the usual priority
        pass


@dataclass
class Stats:
    steps: int = 0  # jobs run on the compute threads
    batches: int = 0  # forwards that ran two or more jobs together
    batched_steps: int = 0  # jobs that ran in those
    cohort_steps: int = 0  # jobs that named the cohort their client sent them in


@dataclass
class _Job:
    pending: Pending
    work: Any  # a callable (run alone), or an item for `runner`
    future: asyncio.Future
    runner: BatchRunner | None = None  # runs the items of the jobs batched with this one
    alone: bool = True  # no other job may run while it does


class Scheduler:
    def __init__(self):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")
        self._bulk = FreshThreads("stage-bulk", initializer=_lower_priority)
        self._jobs: list[_Job] = []
        self._running: dict[bool, _Job] = {}  # what runs (a batch's first job), by lane (bulk: True)
        self._after_prefill = False
        self._used: dict[str, float] = {}  # compute seconds per connection and per fairness unit
        # what a connection (or a unit within one) that was away starts from, less RETURN_CREDIT
        self._floors = {True: 0.0, False: 0.0}  # by "is a connection"
        self._gathering: asyncio.TimerHandle | None = None
        self._batch_seconds = 0.0  # a batched forward's time, lately
        self._warming: threading.Event | None = None  # set to end the spin that keeps the compute thread warm
        self._order = itertools.count()
        self.stats = Stats()
        self.observe: Callable[[list[Pending], float], None] = lambda jobs, seconds: None  # each run (peer.metrics)

    @property
    def idle(self) -> bool:
        return not self._running and not self._jobs

    def _decode_lane_free(self) -> bool:
        """Whether a decode step could start now: nothing runs, or a bulk job that lets it run beside."""
        bulk = self._running.get(True)
        return not self._running or (len(self._running) == 1 and bulk is not None and not bulk.alone)

    @property
    def queued(self) -> int:
        return len(self._jobs)

    async def run(self, source: str, rows: int, prefill: bool, fn: Callable, *args, alone: bool = True) -> Any:
        """`fn(*args)` on the compute thread, in no batch; `prefill`: it has many positions per
        sequence; `alone`: no other job may run beside it (else decode steps may, see above)."""
        pending = Pending(source, rows, next(self._order), prefill=prefill)
        return await self._submit(pending, functools.partial(fn, *args), None, alone)

    async def run_batched(
        self, source: str, rows: int, key: Hashable, runner: BatchRunner, item: Any,
        cohort: tuple[int, int] | None = None,
    ) -> Any:
        """`runner([item, ...])`'s result for `item`, run with the other items of `key` that are
        ready at the same time (jobs of one key share one runner); `cohort`: the (tag, size) of the
        steps its client sent with it, which it waits for."""
        return await self._submit(Pending(source, rows, next(self._order), key, cohort=cohort), item, runner, alone=False)

    def keep_warm(self, spin: Callable[[float, threading.Event], None], until: float) -> None:
        """Spin on the compute thread until `until` (perf_counter), unless work arrives first:
        jobs queue behind the spin, which ends as the first of them is dispatched."""
        self.stop_warm()
        if self.idle:
            self._warming = threading.Event()
            self._thread.submit(spin, until, self._warming)

    def stop_warm(self) -> None:
        if self._warming is not None:
            self._warming.set()
            self._warming = None

    async def _submit(self, pending: Pending, work: Any, runner: BatchRunner | None, alone: bool) -> Any:
        job = _Job(pending, work, asyncio.get_running_loop().create_future(), runner, alone)
        self._jobs.append(job)
        if runner is None or not self._decode_lane_free():
            self._dispatch()
        elif pending.cohort is None:
            self._gather()
        elif len(self._jobs) - 1 in unready([job.pending for job in self._jobs]):
            self._gather()  # its cohort's last step starts the cohort's batch; the others wait for theirs
        else:
            self._dispatch()
        return await job.future

    def _gather(self) -> None:
        """Start the gathering moment, after which the steps waiting run, whether or not their cohorts are all here."""
        if self._gathering is None:
            delay = min(MAX_GATHER, GATHER_SHARE * self._batch_seconds)
            self._gathering = asyncio.get_running_loop().call_later(delay, self._dispatch, True)

    def _dispatch(self, gathered: bool = False) -> None:
        """Start the next batch, if its lane is free: of the steps waiting, those whose cohorts are
        all here, or all once `gathered`; beside a bulk job that allows it, decode steps only."""
        if self._gathering is not None:
            self._gathering.cancel()
            self._gathering = None
        self._jobs = [job for job in self._jobs if not job.future.cancelled()]  # their sessions ended
        if not self._decode_lane_free():
            return
        self._level_up({job.pending.source for job in self._jobs})
        eligible = [job for job in self._jobs if not self._running or self._may_join(job, self._running[True])]
        if not eligible:
            return
        held = set() if gathered else unready([job.pending for job in eligible])
        ready = [job for i, job in enumerate(eligible) if i not in held]
        if not ready:
            self._gather()
            return
        self.stop_warm()
        batch = [ready[i] for i in next_batch([job.pending for job in ready], self._used, self._after_prefill)]
        taken = set(map(id, batch))
        self._jobs = [job for job in self._jobs if id(job) not in taken]
        runner = batch[0].runner
        work = batch[0].work if runner is None else functools.partial(runner, [job.work for job in batch])
        bulk = batch[0].pending.prefill
        self._running[bulk] = batch[0]
        done = asyncio.get_running_loop().run_in_executor(self._bulk if bulk else self._thread, work)
        done.add_done_callback(functools.partial(self._finish, batch, runner is not None, time.perf_counter()))
        if bulk and not batch[0].alone:
            self._dispatch()  # the decode steps waiting start beside it

    def _may_join(self, job: _Job, bulk: _Job) -> bool:
        """Whether `job` may start beside `bulk`, a bulk job that lets decode steps run: a decode
        step of a unit served no more than `bulk`'s, so that a busier unit's steps never take the
        cores from a less served unit's chunk (one API user's streams from another's prompt)."""
        return not (job.pending.prefill or job.alone) and (
            served(job.pending.source, self._used) <= served(bulk.pending.source, self._used)
        )

    def _level_up(self, waiting: set[str]) -> None:
        """Bring the waiting connections and units up to RETURN_CREDIT below their floors, then set
        the floors to the least served of them."""
        keys = waiting | {connection_of(unit) for unit in waiting}
        for key in keys:
            least = self._floors[connection_of(key) == key] - RETURN_CREDIT
            self._used[key] = max(self._used.get(key, least), least)
        for is_connection in (True, False):
            level = [self._used[key] for key in keys if (connection_of(key) == key) == is_connection]
            if level:
                self._floors[is_connection] = min(level)

    def _charge(self, jobs: list[Pending], seconds: float) -> None:
        rows = sum(job.rows for job in jobs)
        for job in jobs:
            for key in {job.source, connection_of(job.source)}:
                floor = self._floors[connection_of(key) == key]
                self._used[key] = self._used.get(key, floor) + charged(job, seconds * job.rows / rows)
        if len(self._used) > 1024:  # a key at its floor is the same as a new one: forget it
            self._used = {k: v for k, v in self._used.items() if v > self._floors[connection_of(k) == k]}

    def _finish(self, batch: list[_Job], batched: bool, started: float, done: asyncio.Future) -> None:
        self._running.pop(batch[0].pending.prefill, None)
        seconds = time.perf_counter() - started
        self._charge([job.pending for job in batch], seconds)
        self.observe([job.pending for job in batch], seconds)
        if batched:
            self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * seconds
        self._after_prefill = batch[0].pending.prefill
        self.stats.steps += len(batch)
        self.stats.cohort_steps += sum(job.pending.cohort is not None for job in batch)
        if len(batch) > 1:
            self.stats.batches += 1
            self.stats.batched_steps += len(batch)
        if done.cancelled():  # the thread was shut down
            for job in batch:
                job.future.cancel()
        elif done.exception() is not None:
            for job in batch:
                if not job.future.cancelled():
                    job.future.set_exception(done.exception())
        else:
            results = done.result() if batched else [done.result()]
            for job, result in zip(batch, results):
                if not job.future.cancelled():
                    job.future.set_result(result)
        if batch[0].pending.prefill:
            # chosen once the chunk's session has gone on: its next chunk is then among the
            # candidates, rather than always behind whatever else was waiting
            asyncio.get_running_loop().call_soon(self._dispatch)
        else:
            self._dispatch()

    def shutdown(self) -> None:
        self.stop_warm()
        self._thread.shutdown(wait=True)
        self._bulk.shutdown(wait=True)
