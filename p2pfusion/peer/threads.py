"""How a peer runs its one-token steps on a CPU: how many threads, and whether to keep them warm.

A stage in a pipeline idles while the other stages compute, for most of every token. On some
machines a thread that has slept costs more to wake than its step costs: on one Intel VM a step
through 10 layers took 10.0 ms on two threads back to back but 41.6 ms after 50 ms idle, against
16.5 and 19.2 ms on one thread. So what counts is a step's time after such a gap, measured for
each option where the peer runs; a step back to back only breaks ties under many users, when steps
do follow each other. Keeping threads warm (spinning through the gap) costs cores that other
stages or the volunteer's own work may need, so it is chosen only where it clearly wins.

The benchmark's choice is where a peer starts. It was measured once, maybe while the machine was
busy with something else, and it is cached: on another Intel VM, peers started during a test run
kept one thread where two made steps a third shorter. So a peer whose threads were not fixed by
`--decode-threads` goes on timing its own one-token steps as it serves (`DecodeThreads`), and
keeps the thread count they say is fastest, under the load it meets.

Which threads run torch matters as much (models/threads.py): one-token steps all run on one
long-lived compute thread, and everything else a peer computes on threads that end with the job.
"""

from __future__ import annotations

import functools
import statistics
from collections import deque
from dataclasses import dataclass

from p2pfusion.models.trials import Trials, first_unless_beaten, size_class

MARGIN = 0.1  # a costlier option must be this much faster to be chosen: timings on a shared machine wobble
WARM_MARGIN = 0.25  # spinning through every gap costs cores, so it must win by more
STEP_TRIALS = 8  # a served step's latest timings per thread count that decide
STEP_REVISIT = 64  # once decided, one step in this many runs on another count: about 1% of steps pay for it
MOVED = 0.2  # a kept count whose steps' median moves this much has the others timed again
_FEWEST_UNLESS_BEATEN = first_unless_beaten(MARGIN)


@dataclass(frozen=True)
class StepCost:
    """Measured seconds of one one-token step with one setting."""

    threads: int
    warm: bool  # the threads were kept spinning through the idle gap before the step
    back_to_back: float
    after_idle: float

    def describe(self) -> str:
        setting = f"{_threads(self.threads)}{' warm' if self.warm else ''}"
        return f"{setting} {self.back_to_back * 1000:.2f} / {self.after_idle * 1000:.2f} ms"


@dataclass(frozen=True)
class DecodeSettings:
    threads: int
    warm: bool
    tuned: bool = False  # the threads are then only where timing the served steps starts (`DecodeThreads`)

    def describe(self) -> str:
        return _threads(self.threads) + (", kept warm between steps" if self.warm else "")


def _price(cost: StepCost) -> tuple[bool, int]:
    """What an option costs the machine besides its time: spinning first, then threads."""
    return cost.warm, cost.threads


def choose_decode_settings(costs: list[StepCost]) -> DecodeSettings:
    """The cheapest option whose step after an idle gap is within its margin of the fastest one's.

    Options are compared after idle because that is how a pipeline's steps arrive; an option that
    costs more (more threads, or warm) must beat the cheaper choice by MARGIN (WARM_MARGIN for
    warm), or match it after idle and beat it by MARGIN back to back.
    """
    if not costs:
        raise ValueError("no step costs to choose from")
    chosen = min(costs, key=_price)
    for cost in sorted(costs, key=_price):
        margin = WARM_MARGIN if cost.warm and not chosen.warm else MARGIN
        if cost.after_idle < (1 - margin) * chosen.after_idle:
            chosen = cost
        elif not cost.warm and cost.after_idle <= chosen.after_idle and cost.back_to_back < (1 - margin) * chosen.back_to_back:
            # as fast after idle, and clearly faster when steps follow each other (spinning
            # changes nothing then, so it is never chosen for that)
            chosen = cost
    return DecodeSettings(chosen.threads, chosen.warm)


class DecodeThreads:
    """The one owner of how many threads a peer's one-token steps (and batches of up to a few
    rows) run on: fixed, or learned from the served steps' own timings, per size of step (1, 2-3,
    4-7, 8 rows), fewest threads kept unless more are MARGIN faster (models/trials.py). When the
    kept count's own steps speed up or slow down by MOVED (other peers on the same cores start
    or stop computing, say), the other counts are timed again at once rather than compared by
    their old timings. Only the compute thread calls it: every small step runs there."""

    def __init__(self, settings: DecodeSettings, all_threads: int):
        self.start = settings.threads  # until the served steps say otherwise
        options = thread_options(all_threads) if settings.tuned else [settings.threads]
        self._options = sorted(set(options))
        self._trials: dict[int, Trials[int]] = {}  # per size of step, so that each decides on its own
        self._kept: dict[int, int] = {}
        self._basis: dict[int, float] = {}  # the kept count's median when it was (last) decided

    def _trials_of(self, size: int) -> Trials[int]:
        if size not in self._trials:
            self._trials[size] = Trials(STEP_TRIALS, STEP_REVISIT, functools.partial(self._best, size))
        return self._trials[size]

    def _best(self, size: int, times: dict[int, deque[float]]) -> int:
        """The fewest threads unless more are MARGIN faster; but once more threads are kept, fewer
        take over only when they are faster, not merely within MARGIN, so that counts within
        MARGIN of each other do not take turns at every look."""
        pick, kept = _FEWEST_UNLESS_BEATEN(times), self._kept.get(size)
        if kept is None or pick >= kept or statistics.median(times[pick]) <= statistics.median(times[kept]):
            return pick
        return kept

    def threads(self, rows: int) -> int:
        """The thread count to run the next step of `rows` rows on (then `timed`)."""
        if len(self._options) == 1:
            return self._options[0]
        size = size_class(rows)
        return self._trials_of(size).choose(size, self._options, self._kept.get(size, self.start))

    def timed(self, rows: int, threads: int, seconds: float) -> str | None:
        """A step's forward took `seconds` on `threads`; what to log when the count kept changes."""
        if len(self._options) == 1:
            return None
        size = size_class(rows)
        trials = self._trials_of(size)
        trials.add(size, threads, seconds)
        seen = trials.seen[size]
        if threads == self._kept.get(size) and self._moved(size, seen[threads]):
            for option, values in seen.items():
                if option != threads:  # timed in other conditions: timed again before the next decision
                    values.clear()
            del self._basis[size]
        kept = trials.decided(size)
        if kept is None or (kept == self._kept.get(size) and size in self._basis):
            return None
        self._basis[size] = statistics.median(seen[kept])
        if kept == self._kept.get(size):
            return None
        self._kept[size] = kept
        medians = "; ".join(f"{_threads(n)} {1000 * statistics.median(t):.2f} ms" for n, t in seen.items())
        return f"steps of {'1 row' if size == 1 else f'{size}+ rows'} run on {_threads(kept)} (medians as served: {medians})"

    def _moved(self, size: int, values: deque[float]) -> bool:
        """Whether the kept count's steps now take MOVED more or less time than when it was chosen:
        the machine's load changed, and the other counts' timings no longer compare."""
        basis = self._basis.get(size)
        return basis is not None and len(values) == STEP_TRIALS and abs(statistics.median(values) - basis) > MOVED * basis


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n > 1 else ''}"


def thread_options(all_threads: int) -> list[int]:
    """1, 2, 4, ... up to all of this process's threads, and all of them."""
    options, threads = [], 1
    while threads < all_threads:
        options.append(threads)
        threads *= 2
    return options + [all_threads]



def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def shares_host(mine: list[str], others: list[list[str]]) -> bool:
    """Whether another peer announces a direct address (host:port) on one of this peer's hosts.
    Such peers compute on the same cores, where a spinning peer takes them from the others (decode
    0.47x of local with three warm peers on 2 cores, docs/benchmarks.md). Peers behind one NAT look
    alike too; they merely lose the spin."""
    hosts = {_host(address) for address in mine}
    return any(_host(address) in hosts for addresses in others for address in addresses)
