"""Pick a chain of peers that covers every layer: a pure function of the DHT's records and of
what this client has seen (peers' observed speeds, peers it has banned)."""

from __future__ import annotations

from collections.abc import Collection

from p2pfusion.dht.records import PeerRecord, PeerState, span_throughput
from p2pfusion.errors import RouteError


def usable(
    records: list[PeerRecord], banned: Collection[str] = (), backups: bool = False, length: int = 0
) -> list[PeerRecord]:
    """Peers a route may use: online ones (and warm backups when failing over) that accept sessions
    of `length` tokens."""
    states = (PeerState.ONLINE, PeerState.BACKUP) if backups else (PeerState.ONLINE,)
    return [r for r in records if r.state in states and r.peer_id not in banned and r.max_length >= length]


def missing_layers(records: list[PeerRecord], num_layers: int) -> list[tuple[int, int]]:
    """Ranges [start, end) that none of these peers serves."""
    covered = [False] * num_layers
    for r in records:
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


def expected_throughput(record: PeerRecord, observed: dict[str, float]) -> float:
    """What this client expects of a peer: its own observation when it has one, not the peer's claim."""
    rate = observed.get(record.peer_id)
    return record.throughput if rate is None else span_throughput(rate, None, record.span)


def find_route(
    records: list[PeerRecord],
    num_layers: int,
    observed: dict[str, float] | None = None,
    banned: Collection[str] = (),
    backups: bool = False,
    length: int = 0,
) -> list[PeerRecord]:
    """Fewest hops first (each hop costs a network round), then fewest backups, then least time.

    A token's time through a route is the sum of its hops' times, so among routes with as many
    hops the one with the smallest sum of 1/throughput wins. A hop starts at the exact layer
    where the previous one ended, since a peer's cache holds its whole range.
    """
    candidates = [r for r in usable(records, banned, backups, length) if r.end <= num_layers]
    gaps = missing_layers(candidates, num_layers)
    if gaps:
        if length and not missing_layers(usable(records, banned, backups), num_layers):
            raise RouteError(f"no peer accepting sessions of {length} tokens serves layers {format_ranges(gaps)}")
        raise RouteError(f"no peer serves layers {format_ranges(gaps)} of this model")
    observed = observed or {}
    # best[layer] = (hops, backups, seconds per token, route) of the best route from `layer` to the end
    best: dict[int, tuple[int, int, float, list[PeerRecord]]] = {num_layers: (0, 0, 0.0, [])}
    for layer in range(num_layers - 1, -1, -1):
        for r in candidates:
            if r.start != layer or r.end not in best:
                continue
            hops, spares, seconds, rest = best[r.end]
            candidate = (
                hops + 1,
                spares + (r.state == PeerState.BACKUP),
                seconds + 1.0 / max(expected_throughput(r, observed), 1e-9),
                [r] + rest,
            )
            if layer not in best or candidate[:3] < best[layer][:3]:
                best[layer] = candidate
    if 0 not in best:
        raise RouteError("online peers cover every layer, but their ranges do not chain from layer 0 to the end")
    return best[0][3]


def session_limit(records: list[PeerRecord], num_layers: int, positions: int, banned: Collection[str] = ()) -> int:
    """The longest session (in tokens) a client can open now: the model's positions, or less where
    no route of online peers accepts more (each peer announces its own max_length). A session of
    that length has a route: `find_route(..., length=...)` picks among the peers that accept it."""
    find_route(records, num_layers, banned=banned)  # no route at all: the RouteError naming the missing layers
    lengths = sorted({r.max_length for r in usable(records, banned)})
    # if the peers accepting n tokens chain through every layer, those accepting fewer do too
    low, high = 0, len(lengths) - 1  # a route accepts lengths[low]
    while low < high:
        mid = (low + high + 1) // 2
        try:
            find_route(records, num_layers, banned=banned, length=lengths[mid])
            low = mid
        except RouteError:
            high = mid - 1
    return min(positions, lengths[low])
