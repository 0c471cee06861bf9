"""How well a model's layers are served, read from its peers' records: shared by the peers'
balancing (peer/balance.py) and the clients' view of the swarm (client/survey.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from p2pfusion.dht.records import PeerRecord


def planned(r: PeerRecord) -> PeerRecord:
    """The record as it will be once its move (if any) is done: balancing plans for that swarm."""
    if r.moving_to is None:
        return r
    return replace(r, start=r.moving_to[0], end=r.moving_to[1], moving_to=None)


def layer_throughputs(records: Iterable[PeerRecord], num_layers: int) -> list[float]:
    """Summed throughput of the serving (online or joining) peers at each layer; backups add nothing."""
    totals = [0.0] * num_layers
    for r in map(planned, records):
        if r.serving:
            rate, end = r.throughput, min(r.end, num_layers)
            # a slice per record rather than a loop per layer: a peer's look sums 1,000 records
            totals[r.start:end] = [t + rate for t in totals[r.start:end]]
    return totals


def with_span(totals: list[float], start: int, end: int, rate: float) -> list[float]:
    """`totals` with one more peer adding `rate` over [start, end): the floats `layer_throughputs`
    gives with that peer's record listed last, without summing the others again."""
    return [t + rate if start <= layer < end else t for layer, t in enumerate(totals)]
