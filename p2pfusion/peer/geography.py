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

from p2pfusion.dht.coverage import planned
from p2pfusion.dht.records import PeerRecord

ME = ""  # the joining peer, in the trips below


class LocalTrips:
    """The round trip of the shortest route around the model for a client beside this peer, if it
    served [start, end) too (seconds; inf when no route covers every layer). Only peers this one
    measured, and itself, are stops: a client would not route through peers far enough to be
    unknown. The stops are read from the records once, as a claim prices many ranges."""

    def __init__(self, records: list[PeerRecord], num_layers: int, near: Mapping[str, float]):
        self.num_layers = num_layers
        self.near = near
        self.typical = statistics.median(near.values())
        stops = [r for r in map(planned, records) if r.serving and r.peer_id in near and r.end <= num_layers]
        self.ranges = {r.peer_id: (r.start, r.end) for r in stops}
        self.by_id = {r.peer_id: r for r in stops}

    def _away(self, peer: str) -> float:  # from the client, who stands where this peer does
        return 0.0 if peer == ME else self.near[peer]

    def _hop(self, a: str, b: str) -> float:
        if ME in (a, b):
            return self._away(b if a == ME else a)
        claimed = self.by_id[a].round_trip_with(self.by_id[b])
        return self.typical if claimed is None else claimed

    def trip(self, start: int, end: int) -> float:
        ranges = self.ranges | {ME: (start, end)}
        # the shortest trip from the client to the end of each stop's range, stops in order of their starts
        arrive: dict[str, float] = {}
        for peer in sorted(ranges, key=lambda p: ranges[p]):
            first, _ = ranges[peer]
            if first == 0:
                arrive[peer] = self._away(peer)
            else:
                before = [arrive[p] + self._hop(p, peer) for p in arrive if ranges[p][1] == first]
                if before:
                    arrive[peer] = min(before)
        return min((t + self._away(p) for p, t in arrive.items() if ranges[p][1] == self.num_layers), default=math.inf)
