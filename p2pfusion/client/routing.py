"""Pick a chain of peers that covers every layer: a pure function of the DHT's records."""

from __future__ import annotations

from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.errors import RouteError


def missing_layers(records: list[PeerRecord], num_layers: int) -> list[tuple[int, int]]:
    """Ranges [start, end) that no online peer serves."""
    covered = [False] * num_layers
    for r in records:
        if r.state == PeerState.ONLINE:
            for layer in range(r.start, min(r.end, num_layers)):
                covered[layer] = True
    gaps, start = [], None
    for layer, ok in enumerate(covered + [True]):
        if not ok and start is None:
            start = layer
        elif ok and start is not None:
            gaps.append((start, layer))
            start = None
    return gaps


def format_ranges(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}:{b}" for a, b in ranges)


def find_route(records: list[PeerRecord], num_layers: int) -> list[PeerRecord]:
    """Fewest hops first (each hop costs a network round), then the least compute time.

    A token's time through a route is the sum of its hops' times, so among routes with as many
    hops the one with the smallest sum of 1/throughput wins.

    A route is a list of peers whose ranges chain from layer 0 to num_layers. A peer may only
    start a hop at the exact layer where the previous hop ended, since its cache holds its
    whole range.
    """
    gaps = missing_layers(records, num_layers)
    if gaps:
        raise RouteError(f"no peer serves layers {format_ranges(gaps)} of this model")
    online = [r for r in records if r.state == PeerState.ONLINE and r.end <= num_layers]
    # best[layer] = (hops, seconds per token, route) of the best route from `layer` to the end
    best: dict[int, tuple[int, float, list[PeerRecord]]] = {num_layers: (0, 0.0, [])}
    for layer in range(num_layers - 1, -1, -1):
        for r in online:
            if r.start != layer or r.end not in best:
                continue
            hops, seconds, rest = best[r.end]
            candidate = (hops + 1, seconds + 1.0 / max(r.throughput, 1e-9), [r] + rest)
            if layer not in best or candidate[:2] < best[layer][:2]:
                best[layer] = candidate
    if 0 not in best:
        raise RouteError("online peers cover every layer, but their ranges do not chain from layer 0 to the end")
    return best[0][2]
