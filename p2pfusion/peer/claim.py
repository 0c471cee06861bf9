"""Which layers a joining peer serves when the user does not say: a pure function.

The rule for now: the first range of layers that no online or joining peer serves, at most
`max_layers` long. If every layer is served, the layers with the fewest peers. The
throughput-aware balancer replaces this rule later.
"""

from __future__ import annotations

from p2pfusion.dht.records import PeerRecord, PeerState


def replicas(records: list[PeerRecord], num_layers: int) -> list[int]:
    counts = [0] * num_layers
    for r in records:
        if r.state in (PeerState.ONLINE, PeerState.JOINING):
            for layer in range(r.start, min(r.end, num_layers)):
                counts[layer] += 1
    return counts


def choose_layers(records: list[PeerRecord], num_layers: int, max_layers: int) -> tuple[int, int]:
    if num_layers < 1 or max_layers < 1:
        raise ValueError("num_layers and max_layers must be positive")
    counts = replicas(records, num_layers)
    least = min(counts)
    start = counts.index(least)
    end = start
    while end < num_layers and counts[end] == least and end - start < max_layers:
        end += 1
    return start, end
