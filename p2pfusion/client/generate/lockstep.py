"""A client's decoding sessions step through the swarm in cohorts.

Left alone, the sessions of one client drift apart along the pipeline: each peer then sees a
step or two at a time, and every forward reads all of its stage's weights for them (on this
project's CPUs ten layers take 16 ms for one step and 37 ms for eight, docs/benchmarks.md). So
each decoding session belongs to a cohort, and a cohort's members take their next step together:
the client chooses their tokens as one head product (client/generate/greedy.py), their steps reach the
first peer in one burst, and every peer runs them as one batch and passes them on as one burst
(peer/scheduler.py starts a batch as soon as the sessions it last ran together are back).

There are two cohorts, not one: while one is in the swarm the other is at the client's head, so
the client's work and the peers' overlap instead of taking turns; where peers have machines of
their own, the two also keep twice as many of them busy. (On this project's 2-core machine, with
three peers on it, one cohort and two gave the same tokens/s at 8 sessions and three less,
docs/benchmarks.md.) A new session joins the smaller
cohort and waits, at most about one cycle, for it to come back, so that it falls in step; a member
that comes back late is not waited for long once most of its cohort is back.

`Lockstep` holds the cohorts' state and its timers; `arrived`, `cohort_for` and `STRAGGLER` are
its policy, pure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

COHORTS = 2
MIN_COHORT = 2  # a second cohort starts once the first has this many members
STRAGGLER = 0.005  # seconds a cohort waits for its last members once most are back
FIRST_CYCLE = 0.25  # seconds a joining member waits for a cohort whose cycle is not timed yet
JOIN_CYCLES = 1.5  # a joining member waits at most this many of its cohort's cycles


def cohort_for(sizes: list[int], cohorts: int = COHORTS) -> int | None:
    """The cohort a new member joins, given the members each one has: None (a new cohort) while
    there are fewer than `cohorts` and each has MIN_COHORT members, else the smallest (the first of
    equals). Two sessions step together, which batches them; a third starts the second cohort."""
    if len(sizes) < cohorts and min(sizes, default=MIN_COHORT) >= MIN_COHORT:
        return None
    return sizes.index(min(sizes))


def arrived(members: int, back: int) -> str:
    """Whether a cohort with `back` of its `members` at the gate goes now ("go"), gives the rest a
    moment ("straggler": most are back, the rest come from the same batch) or waits for them to
    come round ("cycle": members fell out of step, or joined, and fall in again; with half back,
    the two halves are out of step, and waiting joins them)."""
    if back >= members:
        return "go"
    return "straggler" if 2 * back > members else "cycle"


@dataclass(eq=False)
class _Cohort:
    key: tuple[asyncio.AbstractEventLoop, Hashable]  # the loop its futures belong to, and its kind
    members: set = field(default_factory=set)
    waiting: dict = field(default_factory=dict)  # member -> the future its turn waits on
    released: float | None = None  # when it last went
    released_by: int = 0  # how many members it had then
    cycle: float | None = None  # seconds between its releases, lately
    timer: asyncio.TimerHandle | None = None
    timing: str = ""  # what the timer waits for: "straggler" or "cycle"

    def wait(self, state: str) -> None:
        if self.timer is not None and self.timing == state:
            return
        if self.timer is not None:
            self.timer.cancel()
        seconds = STRAGGLER if state == "straggler" else JOIN_CYCLES * (self.cycle or FIRST_CYCLE)
        self.timer, self.timing = self.key[0].call_later(seconds, self.release), state

    def release(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        now = time.perf_counter()
        if 2 * len(self.waiting) > len(self.members):  # the cohort's body, not members falling in
            # a gap across a change of members is no cycle: a joiner may come in just behind
            if self.released is not None and self.released_by == len(self.members):
                gap = now - self.released
                self.cycle = gap if self.cycle is None else 0.7 * self.cycle + 0.3 * gap
            self.released, self.released_by = now, len(self.members)
        waiting, self.waiting = self.waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_result(None)


class Member:
    def __init__(self, lockstep: Lockstep, kind: Hashable):
        self._lockstep = lockstep
        self.kind = kind
        self.cohort: _Cohort | None = None

    async def turn(self) -> None:
        """Wait until this session's cohort takes its next step (at once when alone)."""
        await self._lockstep.turn(self)

    @property
    def alone(self) -> bool:
        """Whether no other session of this client decodes on this loop now."""
        return self._lockstep.decoding(asyncio.get_running_loop()) <= 1


class Lockstep:
    def __init__(self, cohorts: int = COHORTS):
        self.cohorts = cohorts
        # per event loop (a model may serve sessions from more than one; futures and timers belong
        # to one) and per kind of session (only sessions of one kind run as one batch on a peer)
        self._cohorts: dict[tuple[asyncio.AbstractEventLoop, Hashable], list[_Cohort]] = {}

    @contextmanager
    def member(self, kind: Hashable = None) -> Iterator[Member]:
        """A decoding session's place, for the length of its decoding; `kind`: what its steps run
        with on the peers (its adapter), which sessions of a cohort share."""
        member = Member(self, kind)
        try:
            yield member
        finally:
            self._leave(member)

    def decoding(self, loop: asyncio.AbstractEventLoop) -> int:
        """Sessions decoding on `loop`, in every cohort of every kind."""
        return sum(len(c.members) for (owner, _), cohorts in self._cohorts.items() if owner is loop for c in cohorts)

    async def turn(self, member: Member) -> None:
        loop = asyncio.get_running_loop()
        cohort = member.cohort
        if cohort is None:
            cohorts = self._cohorts.setdefault((loop, member.kind), [])
            index = cohort_for([len(c.members) for c in cohorts], self.cohorts)
            cohort = _Cohort((loop, member.kind)) if index is None else cohorts[index]
            if index is None:
                cohorts.append(cohort)
            cohort.members.add(member)
            member.cohort = cohort
        future = loop.create_future()
        cohort.waiting[member] = future
        self._decide(cohort)
        await future

    def _decide(self, cohort: _Cohort) -> None:
        if not cohort.waiting:
            return
        state = arrived(len(cohort.members), len(cohort.waiting))
        if state == "go":
            cohort.release()
        else:
            cohort.wait(state)

    def _leave(self, member: Member) -> None:
        cohort, member.cohort = member.cohort, None
        if cohort is None:
            return
        cohort.members.discard(member)
        future = cohort.waiting.pop(member, None)
        if future is not None and not future.done():
            future.cancel()
        if cohort.members:
            self._decide(cohort)
            return
        if cohort.timer is not None:
            cohort.timer.cancel()
        cohorts = self._cohorts[cohort.key]
        cohorts.remove(cohort)
        if not cohorts:
            del self._cohorts[cohort.key]
