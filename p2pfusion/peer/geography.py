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


def local_trip(records: list[PeerRecord], num_layers: int, near: Mapping[str, float], start: int, end: int) -> float:
    """The round trip of the shortest route around the model for a client beside this peer, if it
    served [start, end) too (seconds; inf when no route covers every layer). Only peers this one
    measured, and itself, are stops: a client would not route through peers far enough to be
    unknown."""
    typical = statistics.median(near.values())
    stops = [r for r in map(planned, records) if r.serving and r.peer_id in near and r.end <= num_layers]
    ranges = {r.peer_id: (r.start, r.end) for r in stops} | {ME: (start, end)}
    by_id = {r.peer_id: r for r in stops}

    def away(peer: str) -> float:  # from the client, who stands where this peer does
        return 0.0 if peer == ME else near[peer]

    def hop(a: str, b: str) -> float:
        if ME in (a, b):
            return away(b if a == ME else a)
        claimed = by_id[a].round_trip_with(by_id[b])
        return typical if claimed is None else claimed

    # the shortest trip from the client to the end of each stop's range, stops in order of their starts
    arrive: dict[str, float] = {}
    for peer in sorted(ranges, key=lambda p: ranges[p]):
        first, _ = ranges[peer]
        if first == 0:
            arrive[peer] = away(peer)
        else:
            before = [arrive[p] + hop(p, peer) for p in arrive if ranges[p][1] == first]
            if before:
                arrive[peer] = min(before)
    return min((t + away(p) for p, t in arrive.items() if ranges[p][1] == num_layers), default=math.inf)
