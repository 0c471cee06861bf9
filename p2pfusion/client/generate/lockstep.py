"""A client's decoding sessions step through the swarm in cohorts.

Left alone, the sessions of one client drift apart along the pipeline: each peer then sees a
step or two at a time, and every forward reads all of its stage's weights for them (on this
project's CPUs ten layers take 16 ms for one step and 37 ms for eight, docs/benchmarks.md). So
each decoding session belongs to a cohort, and a cohort's members take their next step together:
the client chooses their tokens as one head product (client/generate/greedy.py), their steps reach the
first peer in one burst, named as one cohort (net/messages.py `Cohort`), and every peer runs them
as one batch once all are in and passes them on as one burst, under the same name.

Two cohorts instead of one let the client's work and the peers' overlap: while one is in the
swarm the other is at the client's head, and where peers have machines of their own, the two keep
twice as many of them busy. Where the peers share the client's cores, one cohort runs bigger
batches on them, and two make two peers compute at once, each slower (on this project's 2-core
machine, with three peers on it, one cohort of 8 sessions gave 96-101 tokens/s where two gave
85-93, docs/benchmarks.md). So the client measures both: `CohortCounts` keeps the member steps per second
each count gave, over windows in which the same sessions decoded, and runs the faster, trying the
other again now and then. A new session joins the smaller cohort and waits, at most about one
cycle, for it to come back, so that it falls in step; a member that comes back late is not waited
for long once most of its cohort is back.

`Lockstep` holds the cohorts' state and its timers; `arrived`, `cohort_for`, `named`, `STRAGGLER` and
`CohortCounts` are its policy, pure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from p2pfusion.models.trials import Trials, size_class
from p2pfusion.models.source import cache_root, safe_name, write_json
from p2pfusion.net import messages as m

log = logging.getLogger(__name__)

COHORTS = 2
MIN_COHORT = 2  # a second cohort starts once the first has this many members
STRAGGLER = 0.005  # seconds a cohort waits for its last members once most are back
FIRST_CYCLE = 0.25  # seconds a joining member waits for a cohort whose cycle is not timed yet
JOIN_CYCLES = 1.5  # a joining member waits at most this many of its cohort's cycles
COUNTS = (1, COHORTS)  # the cohort counts a client measures, unless told one
WINDOW = 2.0  # seconds of steps that measure a count
WINDOWS = 2  # the latest windows of each count that decide, per size of group
REVISIT_WINDOWS = 8  # once decided, one window in this many runs the other count again


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


def named(released: int) -> m.Cohort | None:
    """The name the steps of a release of `released` sessions carry, which the peers run as one
    batch once all are in: a tag no earlier release had. None for a step alone, and for more steps
    than a name may count (net/messages.py `MAX_COHORT`): those gather as any burst does."""
    if not 1 < released <= m.MAX_COHORT:
        return None
    return m.Cohort(random.getrandbits(63), released)


def _faster(rates: dict[int, deque[float]]) -> int:
    return max(rates, key=lambda count: statistics.median(rates[count]))


class CohortCounts:
    """The one owner of what each cohort count gave, per size of group: member steps per second
    over windows of WINDOW seconds, the latest WINDOWS of each; the counts take turns until each
    has them (the one running first), then the faster runs, and one window in REVISIT_WINDOWS runs
    another (models/trials.py)."""

    def __init__(self, counts: tuple[int, ...] = COUNTS):
        self._counts = counts
        self._trials: Trials[int] = Trials(WINDOWS, REVISIT_WINDOWS, _faster)
        self.changed = False  # measured since last saved (`saved` clears it)

    def to_json(self) -> dict:
        return {
            str(size): {str(count): list(seen) for count, seen in rates.items()}
            for size, rates in self._trials.seen.items()
        }

    @classmethod
    def from_json(cls, raw: object) -> CohortCounts:
        """Counts as `to_json` wrote them; what is not a size, a count or a rate this code knows is left out."""
        counts = cls()
        if not isinstance(raw, dict):
            return counts
        for size, rates in raw.items():
            if size not in {str(size_class(n)) for n in range(1, 9)} or not isinstance(rates, dict):
                continue
            for count, seen in rates.items():
                if count not in {str(c) for c in counts._counts} or not isinstance(seen, list):
                    continue
                valid = [float(r) for r in seen if isinstance(r, (int, float)) and math.isfinite(r) and r > 0]
                counts._trials.of(int(size), counts._counts)[int(count)].extend(valid[-WINDOWS:])
        return counts

    def saved(self) -> None:
        self.changed = False

    def count(self, members: int, current: int | None = None) -> int:
        """The count to run next for a group of `members`, which runs `current` now (each change
        costs the sessions a moment out of step, so trials stay with it while it needs windows)."""
        return self._trials.choose(size_class(members), self._counts, current)

    def measured(self, members: int, count: int, rate: float) -> None:
        size = size_class(members)
        self._trials.of(size, self._counts)
        self._trials.add(size, count, rate)
        self.changed = True


def _counts_path(model: str) -> Path:
    return cache_root() / "cohorts" / f"{safe_name(model)}.json"


def load_counts(model: str) -> CohortCounts:
    """What a client of `model` on this machine measured last, so that its next run starts decided."""
    try:
        return CohortCounts.from_json(json.loads(_counts_path(model).read_text()))
    except (OSError, ValueError):
        return CohortCounts()


def save_counts(model: str, counts: CohortCounts) -> None:
    if not counts.changed:
        return
    path = _counts_path(model)
    try:
        write_json(path, counts.to_json())
        counts.saved()
    except OSError as exc:  # a read-only cache must not fail a generation
        log.warning("cannot save the cohort counts measured to %s: %s", path, exc)


@dataclass
class _Window:
    """Member steps released in a group since `start`, while it had `members` members."""

    start: float
    members: int
    count: int
    steps: int = 0


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
    on_release: Callable[[int], None] = lambda steps: None  # told how many members each release let go

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
        together = named(len(waiting))
        for future in waiting.values():
            if not future.done():
                future.set_result(together)
        self.on_release(len(waiting))


class Member:
    def __init__(self, lockstep: Lockstep, kind: Hashable):
        self._lockstep = lockstep
        self.kind = kind
        self.cohort: _Cohort | None = None

    async def turn(self) -> m.Cohort | None:
        """Wait until this session's cohort takes its next step (at once when alone): the steps
        sent with this session's next one, which its step names (None: none)."""
        return await self._lockstep.turn(self)

    @property
    def alone(self) -> bool:
        """Whether no other session of this client decodes on this loop now."""
        return self._lockstep.decoding(asyncio.get_running_loop()) <= 1


class Lockstep:
    def __init__(self, cohorts: int | None = None, counts: CohortCounts | None = None):
        """`cohorts`: how many cohorts a group of sessions steps in (None: measured, `counts`)."""
        self._fixed = cohorts
        self.counts = (counts or CohortCounts()) if cohorts is None else None
        # per event loop (a model may serve sessions from more than one; futures and timers belong
        # to one) and per kind of session (only sessions of one kind run as one batch on a peer)
        self._cohorts: dict[tuple[asyncio.AbstractEventLoop, Hashable], list[_Cohort]] = {}
        self._windows: dict[tuple[asyncio.AbstractEventLoop, Hashable], _Window] = {}
        self._count: dict[tuple[asyncio.AbstractEventLoop, Hashable], int] = {}  # what each group runs now

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

    async def turn(self, member: Member) -> m.Cohort | None:
        loop = asyncio.get_running_loop()
        cohort = member.cohort
        if cohort is None:
            key = (loop, member.kind)
            cohorts = self._cohorts.setdefault(key, [])
            index = cohort_for([len(c.members) for c in cohorts], self._counted(key))
            cohort = self._new_cohort(key) if index is None else cohorts[index]
            if index is None:
                cohorts.append(cohort)
            cohort.members.add(member)
            member.cohort = cohort
        future = loop.create_future()
        cohort.waiting[member] = future
        self._decide(cohort)
        return await future

    def _counted(self, key) -> int:
        if self._fixed is not None:
            return self._fixed
        if key not in self._count:
            self._count[key] = self.counts.count(self._members(key) + 1)
        return self._count[key]

    def _members(self, key) -> int:
        return sum(len(c.members) for c in self._cohorts.get(key, ()))

    def _new_cohort(self, key) -> _Cohort:
        cohort = _Cohort(key)
        cohort.on_release = lambda steps: self._released(key, steps)
        return cohort

    def _released(self, key, steps: int) -> None:
        """Count a release toward the group's window; at a window's end, record its rate and run the
        count `CohortCounts` says next. A window in which sessions joined or left measures nothing,
        and the group runs what was measured for its new size."""
        now, members = time.perf_counter(), self._members(key)
        if self.counts is None or members <= MIN_COHORT:  # one cohort, whatever the count
            return
        window, current = self._windows.get(key), self._counted(key)
        if window is not None and window.members == members and window.count == current:
            window.steps += steps
            if now - window.start < WINDOW:
                return
            self.counts.measured(members, current, window.steps / (now - window.start))
        count = self.counts.count(members, current)  # also when the group changed: it may be decided
        if count != current:
            log.debug("%d decoding sessions step in %d cohort(s)", members, count)
            self._count[key] = count
            self._regroup(key, count)
        self._windows[key] = _Window(now, members, count)

    def _regroup(self, key, count: int) -> None:
        """The group's members dealt into `count` cohorts; those waiting at the gate wait at their new
        cohort's, and the rest join theirs as they come back."""
        old = self._cohorts[key]
        members = [member for cohort in old for member in cohort.members]
        waiting = {member: future for cohort in old for member, future in cohort.waiting.items()}
        for cohort in old:
            if cohort.timer is not None:
                cohort.timer.cancel()
        cycles = [cohort.cycle for cohort in old if cohort.cycle is not None]
        # as `cohort_for` deals them: a second cohort once the first has MIN_COHORT members
        new = [self._new_cohort(key) for _ in range(max(1, min(count, -(-len(members) // MIN_COHORT))))]
        for cohort in new:  # the members still out come back within about the cycle they had
            cohort.cycle = max(cycles, default=None)
        for i, member in enumerate(members):
            cohort = new[i % len(new)]
            cohort.members.add(member)
            member.cohort = cohort
            if member in waiting:
                cohort.waiting[member] = waiting[member]
        self._cohorts[key] = new
        for cohort in new:
            self._decide(cohort)

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
            self._windows.pop(cohort.key, None)
            self._count.pop(cohort.key, None)
