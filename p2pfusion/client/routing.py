"""Pick a chain of peers that covers every layer: a pure function of the DHT's records and of
what this client has seen (peers' observed speeds, peers it has banned)."""

from __future__ import annotations

from collections.abc import Collection

from p2pfusion.dht.records import PeerRecord, PeerState, span_throughput
from p2pfusion.errors import RouteError


def usable(records: list[PeerRecord], banned: Collection[str] = (), backups: bool = False) -> list[PeerRecord]:
    """Peers a route may use: online ones, and warm backups when failing over."""
    states = (PeerState.ONLINE, PeerState.BACKUP) if backups else (PeerState.ONLINE,)
    return [r for r in records if r.state in states and r.peer_id not in banned]


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
) -> list[PeerRecord]:
    """Fewest hops first (each hop costs a network round), then fewest backups, then least time.

    A token's time through a route is the sum of its hops' times, so among routes with as many
    hops the one with the smallest sum of 1/throughput wins. A hop starts at the exact layer
    where the previous one ended, since a peer's cache holds its whole range.
    """
    candidates = [r for r in usable(records, banned, backups) if r.end <= num_layers]
    gaps = missing_layers(candidates, num_layers)
    if gaps:
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
