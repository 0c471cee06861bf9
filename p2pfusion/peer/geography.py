"""Which of the ranges a joining peer may claim puts it closest to the routes it would serve. Pure.

A client far from every peer of some stage pays that distance on every token, twice, whatever its
route. Routes stay short where each region holds a whole chain of stages. So among claims that cost
the swarm nothing (peer/balance.py decides which), a peer takes the one that most shortens the
trip of a client beside it: client -> first stage -> ... -> last stage -> client, each hop priced
by what is known of it. The joining peer knows its own round trips to the peers it measured
(`near`), which stand for a client beside it; hops between two other peers are priced by the round
trips their records announce (`PeerRecord.links`), else by the median of `near`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

import numpy as np

from p2pfusion.dht.coverage import planned
from p2pfusion.dht.records import PeerRecord

class LocalTrips:
    """The round trip of the shortest route around the model for a client beside this peer, if it
    served [start, end) too (seconds; inf when no route covers every layer). Only peers this one
    measured, and itself, are stops: a client would not route through peers far enough to be
    unknown. A route may leave a stop at any layer it serves, where the next stop starts
    (client/route/planner.py). A claim prices many ranges, so the trips through the other stops
    are worked out once: into each stop from the client, and from each stop back to it."""

    def __init__(self, records: list[PeerRecord], num_layers: int, near: Mapping[str, float]):
        self.num_layers = num_layers
        self.near = near
        self.typical = statistics.median(near.values())
        measured = [planned(r) for r in records if r.peer_id in near]  # a dozen of maybe a thousand
        stops = [r for r in measured if r.serving and r.end <= num_layers]
        self.ranges = {r.peer_id: (r.start, r.end) for r in stops}
        self.by_id = {r.peer_id: r for r in stops}
        order = sorted(self.ranges, key=self.ranges.__getitem__)
        arrive: dict[str, float] = {}  # from the client into the stop's first layer
        for peer in order:
            first = self.ranges[peer][0]
            before = [arrive[p] + self._hop(p, peer) for p in arrive if self._leads(p, first)]
            if first == 0 or before:
                arrive[peer] = near[peer] if first == 0 else min(before)
        home: dict[str, float] = {}  # from entering the stop back to the client
        for peer in reversed(order):
            after = [self._hop(peer, q) + home[q] for q in home if self._leads(peer, self.ranges[q][0])]
            if self.ranges[peer][1] == num_layers:
                after.append(near[peer])
            if after:
                home[peer] = min(after)
        self.without = min((arrive[p] + home[p] for p in arrive if p in home), default=math.inf)
        # to this peer's first layer `s` (0 from the client beside it), and from a stop starting at y
        self.into = np.array([0.0] + [
            min((t + near[p] for p, t in arrive.items() if self._leads(p, s)), default=math.inf)
            for s in range(1, num_layers + 1)
        ])
        onward = np.full(num_layers + 1, math.inf)  # home from a stop that starts at y
        for q, t in home.items():
            y = self.ranges[q][0]
            onward[y] = min(onward[y], near[q] + t)
        # home from a claim of [s, e): the least onward trip from inside it, or its own at the end
        self.home_from = np.full((num_layers + 1, num_layers + 1), math.inf)
        for s in range(num_layers):
            self.home_from[s, s + 1:] = np.minimum.accumulate(onward[s + 1:])
        self.home_from[:, num_layers] = 0.0

    def _leads(self, peer: str, boundary: int) -> bool:
        """May a route leave `peer` at `boundary`?"""
        start, end = self.ranges[peer]
        return start < boundary <= end

    def _hop(self, a: str, b: str) -> float:
        claimed = self.by_id[a].round_trip_with(self.by_id[b])
        return self.typical if claimed is None else claimed

    def trips(self, ranges: np.ndarray) -> np.ndarray:
        """The trip for each claim of `ranges` (rows of start, end), at once."""
        starts, ends = ranges[:, 0], ranges[:, 1]
        return np.minimum(self.without, self.into[starts] + self.home_from[starts, ends])
