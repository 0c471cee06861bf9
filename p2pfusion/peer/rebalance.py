"""Should a serving peer move to other layers? A pure cost model over the DHT's records.

Throughput here is what the swarm carries routed perfectly: its weakest layer's summed throughput
(peer/balance.py says why). A move never lowers it, and never leaves a layer nobody else serves.
It rises by the move, or, where many layers share the bottleneck and no single move can raise it,
the move lifts some of them off it (the next move can then raise it). A move pays when that rise,
over the time the peer is expected to stay once the reload is done, exceeds what is lost while it
reloads: the swarm's throughput, and without overlap the traffic the peer carries now. The reload
time is the peer's own: it records how long its last load took per layer, and a move loads only
the layers it does not hold already, so a shift of a few layers costs a few layers' reload. The
expected stay follows the peer's uptime so far (a peer up for an hour is likely to stay a while;
one that just came may leave soon), within bounds.

Unlike a fixed-ratio rule, this never moves to the range the peer already serves, and it counts
the loss only where the move leaves a gap: when memory holds both ranges (their shared layers
once), the peer loads the new range while the old one keeps serving.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from p2pfusion.dht.coverage import planned, with_span
from p2pfusion.dht.records import PeerRecord
from p2pfusion.peer.balance import Capacity, choose_range, layer_throughputs

MIN_HORIZON = 60.0
MAX_HORIZON = 3600.0


@dataclass(frozen=True)
class Move:
    start: int
    end: int
    overlap: bool  # memory holds the old and the new range at once, so coverage has no gap
    gain: float  # relative rise of the bottleneck; inf when the move closes a gap
    benefit: float  # extra tokens the swarm carries over the horizon
    cost: float  # tokens lost while reloading


def plan_move(
    records: list[PeerRecord],
    num_layers: int,
    me: PeerRecord,
    capacity: Capacity,
    reload_seconds_per_layer: float,
    uptime: float,
    min_gain: float = 0.05,
    near: Mapping[str, float] | None = None,
) -> Move | None:
    """The move to make, if any. `min_gain`: the least it must add to the bottleneck, or to the
    weakest layers while the bottleneck stays (`_evened`), as a share of what this peer carries.
    `near`: this peer's round trips to others (balance.choose_range)."""
    others = [r for r in records if r.peer_id != me.peer_id]
    # the others' records are summed once, then this peer added where it is and where it would be:
    # a peer in a swarm of 1,000 looks every few minutes, and the sums were most of a look's time
    base = layer_throughputs(others, num_layers)
    target = choose_range(others, num_layers, capacity, near, base)
    if target == (me.start, me.end):
        return None
    current = planned(me)
    layers_now = with_span(base, current.start, current.end, current.throughput) if current.serving else base
    layers_after = with_span(base, *target, capacity.throughput(target[1] - target[0]))
    if _served(layers_after) < _served(layers_now):
        return None  # it would leave a layer nobody serves
    now, after = min(layers_now), min(layers_after)
    if after < now * (1 - 1e-9):
        return None  # what routes carry never drops
    gain = (float("inf") if after > 0 else 0.0) if now == 0 else after / now - 1
    # the least rise worth a move is a share of what this peer carries: a share of the swarm's
    # throughput that stops churn among 5 peers stops every move among 100
    least = min_gain * me.throughput
    rise = after - now
    if rise < least:
        rise = _evened(layers_now, layers_after, least)
        if rise <= 0:
            return None
    fresh = new_layers((me.start, me.end), target)
    overlap = me.span + fresh <= capacity.max_layers
    reload = reload_seconds_per_layer * fresh
    during = now if overlap else min(base)
    horizon = min(max(uptime, MIN_HORIZON), MAX_HORIZON)
    # the gain only starts once the new layers are loaded; a move that leaves a gap also stalls
    # the traffic this peer carries now, until its clients have moved
    benefit = rise * max(horizon - reload, 0.0)
    cost = (now - during) * reload + (0.0 if overlap else me.load * reload)
    if benefit <= cost:
        return None
    return Move(target[0], target[1], overlap, gain, benefit, cost)


def new_layers(held: tuple[int, int], target: tuple[int, int]) -> int:
    """How many of `target`'s layers a peer holding `held` must load: those it holds already it
    keeps (models/stage.py `load_stage`, `reuse`)."""
    shared = max(0, min(held[1], target[1]) - max(held[0], target[0]))
    return target[1] - target[0] - shared


def _evened(before: list[float], after: list[float], least: float) -> float:
    """How far a move raises the weakest layers when it leaves the bottleneck as it is: the rise at
    the first place where the sorted per-layer throughputs differ by more than `least`, when that
    is a rise and the sum of their logarithms grows (else 0).

    Many layers share the bottleneck in a large swarm, so no single move raises it; lifting one
    group of them off it lets the next move raise it (docs/benchmarks.md, Placement at scale). Differences within `least`
    are ties, else a move would have to lift every layer level with the bottleneck at once. The
    logarithms' sum, which every accepted move raises, rules out peers moving in a circle."""
    if min(before, default=0.0) <= 0:
        return 0.0  # a gap: only the bottleneck decides
    rise = next((a - b for a, b in zip(sorted(after), sorted(before)) if abs(a - b) > least), 0.0)
    if rise <= 0 or sum(map(math.log, after)) <= sum(map(math.log, before)) + 1e-9:
        return 0.0
    return rise


def _served(layers: list[float]) -> int:
    return sum(t > 0 for t in layers)
