"""Should a serving peer move to other layers? A pure cost model over the DHT's records.

Throughput here is what the swarm carries routed perfectly (dht/flow.py's maximum flow), not the
weakest layer's sum: ranges that do not chain add to the one and not to the other. A move pays
when the throughput it adds, over the time the peer is expected to
stay once the reload is done, exceeds what is lost while it reloads: the swarm's throughput, and
without overlap the traffic the peer carries now. It never leaves a layer nobody else serves. The reload time is the peer's own: it records
how long its last load took per layer. The expected stay follows the peer's uptime so far (a peer
up for an hour is likely to stay a while; one that just came may leave soon), within bounds.

Unlike a fixed-ratio rule, this never moves to the range the peer already serves, and it counts
the loss only where the move leaves a gap: when memory holds both ranges, the peer loads the new
range while the old one keeps serving.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from p2pfusion.dht.records import PeerRecord
from p2pfusion.dht.flow import swarm_flow
from p2pfusion.peer.balance import Capacity, choose_range, layer_throughputs, with_peer

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
    """The move to make, if any. `min_gain`: the least flow it must add, as a share of what this
    peer carries. `near`: this peer's round trips to others (balance.choose_range)."""
    others = [r for r in records if r.peer_id != me.peer_id]
    target = choose_range(others, num_layers, capacity, near)
    if target == (me.start, me.end):
        return None
    moved = with_peer(others, me.peer_id, *target, capacity)
    if _served(moved, num_layers) < _served(others + [me], num_layers):
        return None  # it would leave a layer nobody serves
    now = swarm_flow(others + [me], num_layers)
    after = swarm_flow(moved, num_layers)
    if after <= now * (1 + 1e-9):
        return None
    gain = float("inf") if now == 0 else after / now - 1
    # what the move adds, against what this peer carries: against the swarm's flow, a threshold
    # that stops churn among 5 peers stops every move among 100 (int8 fleets of 100 settled at
    # 0.85 of the LP bound that way, and at 0.90 with this)
    if after - now < min_gain * me.throughput:
        return None
    overlap = me.span + (target[1] - target[0]) <= capacity.max_layers
    reload = reload_seconds_per_layer * (target[1] - target[0])
    during = now if overlap else swarm_flow(others, num_layers)
    horizon = min(max(uptime, MIN_HORIZON), MAX_HORIZON)
    # the gain only starts once the new layers are loaded; a move that leaves a gap also stalls
    # the traffic this peer carries now, until its clients have moved
    benefit = (after - now) * max(horizon - reload, 0.0)
    cost = (now - during) * reload + (0.0 if overlap else me.load * reload)
    if benefit <= cost:
        return None
    return Move(target[0], target[1], overlap, gain, benefit, cost)


def _served(records: list[PeerRecord], num_layers: int) -> int:
    return sum(t > 0 for t in layer_throughputs(records, num_layers))
