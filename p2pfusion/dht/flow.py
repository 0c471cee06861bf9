"""What a swarm's peers carry together, routed perfectly: the maximum flow of tokens from layer
boundary 0 to the last, each serving peer an edge from its range's start to its end with its
throughput as capacity. Layer-by-layer sums (dht/coverage.py) overstate it where ranges do not
chain. Routes may also leave a peer before its last layer (client/route/planner.py), which this
does not count: what routes carry is at least this.

`FlowRoom` says what a new range would add: tokens that can still reach its start, and still
leave its end, once the present flow runs (an upper bound on its gain: the two paths might share
an edge). Pure. scipy's max-flow (Dinic, compiled) takes integer capacities below 2**31, so rates
are scaled to fixed point: a part in 2**30 of the swarm's total, far below what any choice here
turns on.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from p2pfusion.dht.coverage import planned
from p2pfusion.dht.records import PeerRecord

FIXED_POINT = float(1 << 30)  # the swarm's total rate, in units of the integer capacities


def _capacities(edges: Iterable[tuple[int, int, float]], num_layers: int) -> tuple[np.ndarray, float]:
    """The boundaries' capacity matrix in fixed point, and the rate of one unit."""
    kept = [(a, b, rate) for a, b, rate in edges if 0 <= a < b <= num_layers and rate > 0]
    unit = (sum(rate for _, _, rate in kept) or 1.0) / FIXED_POINT
    matrix = np.zeros((num_layers + 1, num_layers + 1), dtype=np.int64)
    for a, b, rate in kept:
        matrix[a, b] += int(rate / unit)
    return matrix, unit


def _graph(matrix: np.ndarray) -> csr_matrix:
    return csr_matrix(matrix.astype(np.int32))


def _flow(graph: csr_matrix, source: int, sink: int):
    return maximum_flow(graph, source, sink, method="dinic")


def max_flow(edges: Iterable[tuple[int, int, float]], num_layers: int) -> float:
    """The maximum flow from boundary 0 to `num_layers` over (start, end, capacity) edges."""
    matrix, unit = _capacities(edges, num_layers)
    return _flow(_graph(matrix), 0, num_layers).flow_value * unit


def serving_edges(records: Iterable[PeerRecord], num_layers: int) -> list[tuple[int, int, float]]:
    return [(r.start, r.end, r.throughput) for r in map(planned, records) if r.serving and r.end <= num_layers]


def swarm_flow(records: Iterable[PeerRecord], num_layers: int) -> float:
    """What the serving peers of these records carry at most, routed perfectly."""
    return max_flow(serving_edges(records, num_layers), num_layers)


class FlowRoom:
    """The swarm's flow, and at each boundary how much more could reach it from 0 (`into`) and
    leave it for the last (`out_of`) with that flow running."""

    def __init__(self, records: Iterable[PeerRecord], num_layers: int):
        self.num_layers = num_layers
        matrix, self._unit = _capacities(serving_edges(records, num_layers), num_layers)
        result = _flow(_graph(matrix), 0, num_layers)
        self.flow = result.flow_value * self._unit
        self._residual = _graph(matrix - result.flow.toarray())  # a pushed unit may also be pushed back
        # most boundaries no path reaches (or leaves for the last) once the flow runs: their room
        # is nothing, found by one search each way rather than a max flow per boundary
        self._reached = set(breadth_first_order(self._residual, 0, return_predecessors=False).tolist())
        backwards = self._residual.T.tocsr()
        self._reaching = set(breadth_first_order(backwards, num_layers, return_predecessors=False).tolist())
        # each boundary's room is worked out when first asked for: candidates start at few of them
        self._into: dict[int, float] = {0: np.inf}
        self._out_of: dict[int, float] = {num_layers: np.inf}

    def into(self, boundary: int) -> float:
        if boundary not in self._into:
            self._into[boundary] = self._room(0, boundary, boundary in self._reached)
        return self._into[boundary]

    def out_of(self, boundary: int) -> float:
        if boundary not in self._out_of:
            self._out_of[boundary] = self._room(boundary, self.num_layers, boundary in self._reaching)
        return self._out_of[boundary]

    def _room(self, source: int, sink: int, connected: bool) -> float:
        return _flow(self._residual, source, sink).flow_value * self._unit if connected else 0.0

    def gain(self, start: int, end: int, rate: float) -> float:
        """At most what a peer carrying `rate` through [start, end) would add to the flow."""
        into = self.into(start)
        return float(min(rate, into, self.out_of(end))) if into > 0 else 0.0
