"""Choices learned from a node's own measurements, because what is fastest depends on the machine
and on its load at the hour: how a client's LM head runs (client/generate/greedy.py), how many
cohorts its decoding sessions step in (client/generate/lockstep.py), and how many threads a peer's
one-token steps run on (peer/threads.py).

`Trials` keeps the latest few measurements of each option, per size (of a call, of a group of
sessions): the options take turns until each has them, then the best is kept, and one measurement
in so many goes to another option, in turn, so that a choice made in a busy moment does not stand
for good.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Generic, TypeVar

Option = TypeVar("Option", bound=Hashable)


def size_class(n: int) -> int:
    """Sizes 1, 2-3, 4-7 and 8 or more (rows of a call, sessions of a group) are measured apart."""
    return 1 << (min(n, 8).bit_length() - 1)


def first_unless_beaten(margin: float) -> Callable[[dict[Option, Sequence[float]]], Option]:
    """Of options given cheapest first, the first that no later one beats by more than `margin`
    (a fraction) in median: a costlier option (more threads, say) must clearly pay for itself."""

    def best(times: dict[Option, Sequence[float]]) -> Option:
        medians = {option: statistics.median(values) for option, values in times.items()}
        options = list(medians)
        chosen = options[0]
        for option in options[1:]:
            if medians[option] < (1 - margin) * medians[chosen]:
                chosen = option
        return chosen

    return best


class Trials(Generic[Option]):
    def __init__(self, keep: int, revisit: int, best: Callable[[dict[Option, deque[float]]], Option]):
        """`keep`: the latest measurements of each option that decide; `revisit`: once decided, one
        choice in this many takes another option; `best`: the option to keep, from all of them."""
        self.keep = keep
        self.revisit = revisit
        self._best = best
        self.seen: dict[int, dict[Option, deque[float]]] = {}  # size -> option -> latest measurements
        self._since: dict[int, int] = {}  # measurements per size since every option had `keep`

    def of(self, size: int, options: Iterable[Option]) -> dict[Option, deque[float]]:
        return self.seen.setdefault(size, {option: deque(maxlen=self.keep) for option in options})

    def decided(self, size: int) -> Option | None:
        seen = self.seen.get(size)
        if not seen or any(len(values) < self.keep for values in seen.values()):
            return None
        return self._best(seen)

    def choose(self, size: int, options: Iterable[Option], current: Option | None = None) -> Option:
        """The option to measure next at `size`; `current`: the one running now, kept while it needs
        measurements (a change may cost something of its own)."""
        seen = self.of(size, options)
        best = self.decided(size)
        if best is None:
            if current in seen and len(seen[current]) < self.keep:
                return current
            return min(seen, key=lambda option: len(seen[option]))
        since, others = self._since.get(size, 0), [option for option in seen if option != best]
        if others and since % self.revisit == self.revisit - 1:
            return others[since // self.revisit % len(others)]
        return best

    def add(self, size: int, option: Option, value: float) -> None:
        self.seen[size][option].append(value)
        if self.decided(size) is not None:
            self._since[size] = self._since.get(size, 0) + 1
