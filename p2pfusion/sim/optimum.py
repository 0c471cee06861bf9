"""A placement's pipeline throughput, and the best placement of a fleet.

A placement gives each peer a contiguous range of layers (or none); what it carries, routed
perfectly, is its weakest layer's summed throughput (`carried`: routes may leave a peer early, so
that is the maximum flow through the ranges, peer/balance.py says why).

The best placement (as Helix places models on heterogeneous GPUs, with a max-flow objective) is a
mixed-integer program over the fleet's kinds of volunteer (same compute, link and memory): how
many of each kind serve each range, and a flow through the ranges, each range's tokens going on
from its end (`best_placement`, solved by HiGHS through scipy). A route that leaves a peer early
uses it as a share of a peer on the shorter range, at least as fast, so the relaxation bounds
what routes carry too. With hundreds of volunteers of each kind, the relaxation is within a hair
of the program and solves in a second; the relaxation is an upper bound, so a ratio against it
understates how close a placement comes. From below, `searched` improves a given placement one
peer's move at a time: the optimum lies between what it reaches and the relaxation.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from p2pfusion.dht.records import span_throughput
from p2pfusion.peer.balance import Capacity


def carried(edges: Iterable[tuple[int, int, float]], num_layers: int) -> float:
    """What ranges of (start, end, tokens/s) carry together, routed perfectly."""
    sums = [0.0] * num_layers
    for a, b, rate in edges:
        for layer in range(max(a, 0), min(b, num_layers)):
            sums[layer] += rate
    return min(sums, default=0.0)


@dataclass(frozen=True)
class Best:
    found: float  # what the best placement found carries (0: none found in time)
    bound: float  # what no placement can beat (the solver's dual bound, or the relaxation's value)

    @property
    def exact(self) -> bool:
        return self.bound - self.found <= 1e-3 * self.bound


def best_placement(capacities: list[Capacity], num_layers: int, relax: bool = False, seconds: float = 60.0) -> Best:
    """The best placement of these peers the solver finds in `seconds`, and what bounds every
    placement (see the module's docstring); with `relax`, the relaxation's bound only."""
    kinds = Counter(capacities)
    kinds_list = list(kinds)
    longest = max(c.max_layers for c in kinds_list)
    ranges = [(a, a + k) for k in range(1, min(longest, num_layers) + 1) for a in range(num_layers - k + 1)]
    # variables: n[kind, range] (peers of that kind on that range), then f[range] (the flow through it)
    placed = [(i, j) for i, kind in enumerate(kinds_list) for j, (a, b) in enumerate(ranges) if b - a <= kind.max_layers]
    flow0 = len(placed)
    size = flow0 + len(ranges)
    rows = len(kinds_list) + len(ranges) + (num_layers - 1)
    matrix = lil_matrix((rows, size))
    lower, upper = np.zeros(rows), np.zeros(rows)
    for v, (i, j) in enumerate(placed):
        a, b = ranges[j]
        matrix[i, v] = 1.0  # at most as many peers of a kind as the fleet has
        matrix[len(kinds_list) + j, v] = -span_throughput(kinds_list[i].compute_rate, kinds_list[i].network_rate, b - a)
    upper[:len(kinds_list)] = [kinds[k] for k in kinds_list]
    base = len(kinds_list) + len(ranges)  # the first boundary's row
    for j, (a, b) in enumerate(ranges):
        matrix[len(kinds_list) + j, flow0 + j] = 1.0  # a range carries no more than its peers do
        lower[len(kinds_list) + j] = -np.inf
        if b < num_layers:
            matrix[base + b - 1, flow0 + j] += 1.0  # what ends at a boundary goes on from it
        if a > 0:
            matrix[base + a - 1, flow0 + j] -= 1.0
    objective = np.zeros(size)
    for j, (a, _) in enumerate(ranges):
        if a == 0:
            objective[flow0 + j] = -1.0
    integrality = np.zeros(size)
    if not relax:
        integrality[:flow0] = 1
    result = milp(
        objective, constraints=LinearConstraint(matrix.tocsr(), lower, upper), integrality=integrality,
        bounds=Bounds(np.zeros(size), np.full(size, np.inf)), options={"time_limit": seconds, "mip_rel_gap": 1e-4},
    )
    if result.x is None:  # no integer placement found in time: the relaxation bounds it
        return Best(0.0, best_placement(capacities, num_layers, relax=True).bound)
    found = -float(result.fun)
    if relax:
        return Best(0.0, found)
    bound = -float(getattr(result, "mip_dual_bound", None) or result.fun)
    return Best(found, max(bound, found))


def enumerated_best(capacities: list[Capacity], num_layers: int) -> float:
    """The best placement by trying every one (each peer: no range, or any range it can hold); for
    a handful of peers and layers only."""
    choices = [
        [None, *[(a, a + k) for k in range(1, min(c.max_layers, num_layers) + 1) for a in range(num_layers - k + 1)]]
        for c in capacities
    ]
    best = 0.0
    for placement in itertools.product(*choices):
        edges = [(r[0], r[1], c.throughput(r[1] - r[0])) for r, c in zip(placement, capacities) if r is not None]
        best = max(best, carried(edges, num_layers))
    return best


def searched(
    capacities: list[Capacity], ranges: list[tuple[int, int] | None], num_layers: int, seconds: float, rng: random.Random,
) -> tuple[float, list[tuple[int, int] | None]]:
    """The placement a central search reaches from `ranges` (each peer's or None), and its flow: one peer
    at a time, in random order, moves to the range (any start, any length it holds) that most
    raises the flow, then the sorted per-layer throughputs (leximin), until no single move does or
    `seconds` have run. It makes moves the swarm's own policy does not (from any start, however
    small the gain, at no reload cost), and what it reaches is a placement: a lower bound on the
    optimum, where the relaxation gives an upper one."""
    placed = {i: r for i, r in enumerate(ranges) if r is not None}
    # float sums drift with the order they are added in: they are compared in coarser grains, so
    # rounding noise never passes for a gain
    grain = sum(capacities[i].throughput(1) for i in placed) / 2**20 or 1.0

    def score() -> tuple[int, list[int]]:
        """What the placement carries (its weakest layer), then its sorted layers, in grains."""
        sums = [0.0] * num_layers
        for i, (a, b) in placed.items():
            rate = capacities[i].throughput(b - a)
            for layer in range(a, b):
                sums[layer] += rate
        return round(min(sums) / grain), sorted(round(s / grain) for s in sums)

    best = score()
    deadline = time.monotonic() + seconds
    moved = True
    while moved and time.monotonic() < deadline:
        moved = False
        for i in rng.sample(sorted(placed), len(placed)):
            here, reach = placed[i], min(capacities[i].max_layers, num_layers)
            for candidate in [(a, a + k) for a in range(num_layers) for k in range(1, min(reach, num_layers - a) + 1)]:
                placed[i] = candidate
                trial = score()
                if trial > best:
                    best, here, moved = trial, candidate, True
            placed[i] = here
            if time.monotonic() >= deadline:
                break
    flow = carried([(a, b, capacities[i].throughput(b - a)) for i, (a, b) in placed.items()], num_layers)
    return flow, [placed.get(i) for i in range(len(ranges))]
