"""Which replicas a training step's micro-batches go through: pure functions of a run's records.

A run's replicas hold stages that tile the model's layers; every replica of a stage holds the same
range. A step's batch is split by rows into micro-batches, one per chain: chain j takes replica
j mod n of a stage with n replicas, so each replica of the widest stage gets one micro-batch and
the replicas of narrower stages share theirs out evenly. After an outer step, replicas whose
weights differ from most of their stage's copy theirs (`astray`).
"""

from __future__ import annotations

from collections import Counter

from p2pfusion.dht.records import PeerRecord
from p2pfusion.errors import RouteError


def stages(records: list[PeerRecord], num_layers: int) -> list[list[PeerRecord]]:
    """The run's replicas grouped by stage, in layer order (each stage's by peer id); a RouteError
    naming the layers no replica holds, or the ranges that overlap without matching."""
    by_range: dict[tuple[int, int], list[PeerRecord]] = {}
    for record in records:
        by_range.setdefault((record.start, record.end), []).append(record)
    tiling, at = [], 0
    for start, end in sorted(by_range):
        if start < at:
            raise RouteError(f"the run's stages overlap: layers {start}:{end} cross a stage ending at layer {at}")
        if start > at:
            raise RouteError(f"no replica of the run holds layers {at}:{start}")
        tiling.append(sorted(by_range[(start, end)], key=lambda r: r.peer_id))
        at = end
    if at < num_layers:
        raise RouteError(f"no replica of the run holds layers {at}:{num_layers}")
    return tiling


def chains(tiled: list[list[PeerRecord]], rows: int) -> list[list[PeerRecord]]:
    """At most `rows` chains (a micro-batch has a row at least), as many as the widest stage has replicas."""
    count = min(rows, max(len(stage) for stage in tiled))
    return [[stage[j % len(stage)] for stage in tiled] for j in range(count)]


def split_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """Rows [a, b) of each of `parts` micro-batches, as even as whole rows allow."""
    bounds = [rows * i // parts for i in range(parts + 1)]
    return list(zip(bounds, bounds[1:]))


def served(routes: list[list[PeerRecord]]) -> Counter[str]:
    """Micro-batches per replica: the divisor of its summed gradients."""
    return Counter(record.peer_id for route in routes for record in route)


def astray(digests: dict[str, bytes]) -> tuple[bytes | None, list[str]]:
    """The outer weights (by digest) more than half of a stage's replicas hold after an outer
    step, and the replicas holding others: those copy the majority's. Every honest replica of a
    round averages the same values, so they differ only where a round went otherwise for some (a
    member that sent its tensors late to some and not others, a retry among fewer). With no
    majority, nobody is told to copy anybody."""
    digests = {peer: d for peer, d in digests.items() if d}  # a replica too old to say is no vote
    held = Counter(digests.values())
    if not held:
        return None, []
    digest, count = held.most_common(1)[0]
    if 2 * count <= len(digests):
        return None, []
    return digest, sorted(peer for peer, d in digests.items() if d != digest)

