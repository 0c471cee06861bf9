"""Stage-level load balancing: which layers a peer serves. Pure functions of the DHT's records.

The swarm's capacity at a layer is the summed throughput of the peers serving it; the swarm's
*bottleneck* is the smallest of these. A peer serving `k` layers shares its compute among them,
so serving more layers covers more but adds less to each (see `span_throughput`). The bottleneck
is what routes carry together, routed perfectly: a route enters a peer at its first layer and may
leave it at any later one (client/route/planner.py), so tokens pass from one peer to another
wherever the second starts inside the first's range. Drawn as a flow network whose nodes are the
layer boundaries, each range an edge from its start to its end, leaving early is an unbounded
edge from each boundary back to the one before (a path that runs a peer to its end and steps back
to `y` is a route that left it at `y`). A cut that crosses such an edge is unbounded, so the
finite cuts are the boundaries' prefixes, each crossed by the ranges that serve one layer: the
maximum flow is the weakest layer's throughput (tests/test_sim_fleet.py checks it against the
network built the long way). It counts a hop cut short at the whole range's rate, so what routes
carry is at least this.

A joining peer picks the range that maximizes the sorted vector of per-layer throughputs
lexicographically (leximin): first the bottleneck, then the next weakest layer, and so on. That
covers a swarm that carries nothing yet, raises the weakest stage first and spreads equal peers
evenly. A range starts where a route can reach and may end anywhere: the next joiner starts
there. A peer that knows its round trips to others prefers, among ranges nearly as good
(GEO_SLACK), the one that shortens routes near it most (peer/geography.py): routes then stay in
one region (the FusionLLM seed groups devices by their links for the same reason).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from p2pfusion.dht.coverage import layer_throughputs, planned, with_span
from p2pfusion.dht.records import PeerRecord, PeerState, span_throughput
from p2pfusion.peer.geography import LocalTrips

# Decimal places kept when comparing throughputs, so float noise does not decide a choice.
PRECISION = 9
# The share of each layer's throughput (sorted, each to each, so the bottleneck's too) a claim may
# give up to shorten the routes near the peer: in simulated 3-region swarms routes came out a fifth
# to a quarter shorter, the bottleneck the same on average (docs/benchmarks.md)
GEO_SLACK = 0.1


@dataclass(frozen=True)
class Capacity:
    """What a peer can offer: its measured rates and how many layers fit in its memory."""

    compute_rate: float
    network_rate: float | None
    max_layers: int

    def throughput(self, span: int) -> float:
        return span_throughput(self.compute_rate, self.network_rate, span)


@dataclass(frozen=True)
class Placement:
    start: int
    end: int
    backup: bool = False


def layer_replicas(records: Iterable[PeerRecord], num_layers: int, states: tuple[PeerState, ...]) -> list[int]:
    counts = [0] * num_layers
    for r in map(planned, records):
        if r.state in states:
            for layer in range(r.start, min(r.end, num_layers)):
                counts[layer] += 1
    return counts


def bottleneck(records: Iterable[PeerRecord], num_layers: int) -> float:
    return min(layer_throughputs(records, num_layers), default=0.0)


def _starts(totals: list[float]) -> set[int]:
    """Layers where a hop may start, given each layer's throughput: 0, and every layer a route
    can reach, where someone's range ends or passes (a route may leave that peer there), the first
    layer of a gap included."""
    return {0} | {layer for layer in range(1, len(totals)) if totals[layer - 1] > 0}


def _candidates(totals: list[float], max_layers: int) -> np.ndarray:
    """Ranges (rows of start, end) that start where a hop may start and hold up to `max_layers`.
    They may end anywhere: a range that ends where nobody starts yet is where the next joiner
    starts (requiring ends that someone already starts at let early peers with much memory and
    little speed fix the stages for good: a simulated fleet then reached a tenth of its best
    placement)."""
    starts = np.array(sorted(_starts(totals)), dtype=np.int64)[:, None]
    ends = starts + np.arange(1, max_layers + 1)
    inside = ends <= len(totals)
    return np.column_stack([np.broadcast_to(starts, ends.shape)[inside], ends[inside]])


@dataclass(frozen=True)
class _Scores:
    """Each candidate's per-layer throughputs with it, sorted (leximin), how many of its ends meet
    others', and its start. The best is the greatest by those, in that order, then by the earlier
    start, then by its place in the list (the first of equals wins). A claim prices thousands of
    ranges, so they are scored at once."""

    after: np.ndarray
    aligned: np.ndarray
    starts: np.ndarray

    @classmethod
    def of(cls, records: list[PeerRecord], totals: list[float], me: Capacity, ranges: np.ndarray) -> "_Scores":
        num_layers = len(totals)
        starts, ends = ranges[:, 0], ranges[:, 1]
        added = np.array([me.throughput(span) for span in range(num_layers + 1)])[ends - starts]
        layers = np.arange(num_layers)
        inside = (layers >= starts[:, None]) & (layers < ends[:, None])
        after = np.sort(np.round(np.array(totals) + inside * added[:, None], PRECISION), axis=1)
        bounds = [0, num_layers, *(x for r in map(planned, records) if r.serving for x in (r.start, r.end))]
        aligned = np.isin(starts, bounds).astype(int) + np.isin(ends, bounds)
        return cls(after, aligned, starts)

    def best(self, among: np.ndarray | None = None) -> int:
        # keep the candidates greatest by each key in turn rather than sorting them all: the
        # weakest layer alone mostly leaves a handful, and a full sort was half a look's time
        kept = np.arange(len(self.starts)) if among is None else np.sort(among)
        for key in (*self.after.T, self.aligned, -self.starts):
            values = key[kept]
            kept = kept[values == values.max()]
            if len(kept) == 1:
                break
        return int(kept[0])


def choose_range(
    records: list[PeerRecord], num_layers: int, me: Capacity, near: Mapping[str, float] | None = None,
    totals: list[float] | None = None,
) -> tuple[int, int]:
    """The contiguous range that most raises the per-layer throughputs (leximin: the bottleneck,
    what the swarm carries, first). Given `near` (this peer's round trips to other peers, by peer
    id), the range that puts it on the shortest route for a client beside it (peer/geography.py)
    wins over the best if its sorted throughputs come within GEO_SLACK of the best's, each to
    each: it serves every layer, and leaves no stage weaker for the peers that join later.
    `totals`: the records' `layer_throughputs`, when the caller has summed them already."""
    if num_layers < 1 or me.max_layers < 1:
        raise ValueError("num_layers and max_layers must be positive")
    totals = layer_throughputs(records, num_layers) if totals is None else totals
    ranges = _candidates(totals, min(me.max_layers, num_layers))
    scores = _Scores.of(records, totals, me, ranges)
    best = scores.best()
    if near:
        fair = np.flatnonzero((scores.after >= (1 - GEO_SLACK) * scores.after[best]).all(axis=1))
        trip = np.round(LocalTrips(records, num_layers, near).trips(ranges[fair]), 6)
        best = scores.best(fair[trip == trip.min()])
    return int(ranges[best, 0]), int(ranges[best, 1])


def utilization(records: list[PeerRecord], num_layers: int, totals: list[float] | None = None) -> float:
    """The busiest layer's demand over its capacity (0 for an idle swarm). `totals` as in `choose_range`."""
    totals = layer_throughputs(records, num_layers) if totals is None else totals
    demand = [0.0] * num_layers
    for r in map(planned, records):
        if r.serving:
            for layer in range(r.start, min(r.end, num_layers)):
                demand[layer] += r.load
    return max((d / t for d, t in zip(demand, totals) if t > 0), default=0.0)


def stage_most_at_risk(records: list[PeerRecord], num_layers: int, max_layers: int) -> tuple[int, int] | None:
    """The served stage with the fewest replicas (backups included), then the least throughput."""
    current = [planned(r) for r in records]
    stages = sorted({(r.start, r.end) for r in current if r.serving and r.span <= max_layers and r.end <= num_layers})
    if not stages:
        return None
    totals = layer_throughputs(records, num_layers)
    replicas = layer_replicas(records, num_layers, (PeerState.ONLINE, PeerState.JOINING, PeerState.BACKUP))
    return min(stages, key=lambda s: (min(replicas[s[0]:s[1]]), round(min(totals[s[0]:s[1]]), PRECISION), s))


def backup_stage(records: list[PeerRecord], num_layers: int, me: PeerRecord, max_layers: int) -> tuple[int, int] | None:
    """The stage a warm backup should keep warm instead of its own, or None: the stage most at
    risk (`stage_most_at_risk`), when it has at least two replicas fewer than the backup's stage.

    Peers that join at once all see the same stage most at risk and pile onto it. Of a stage's
    backups, half the difference go, those that would promote last (every backup ranks them alike,
    so no more go than the difference needs); a backup that announced its move counts where it goes.
    """
    target = stage_most_at_risk(records, num_layers, max_layers)
    if target is None or target == (me.start, me.end):
        return None
    replicas = layer_replicas(records, num_layers, (PeerState.ONLINE, PeerState.JOINING, PeerState.BACKUP))
    excess = (min(replicas[me.start:me.end]) - min(replicas[target[0]:target[1]])) // 2
    if excess < 1:
        return None
    mine = [r for r in map(planned, records) if r.state == PeerState.BACKUP and (r.start, r.end) == (me.start, me.end)]
    mine = [r for r in mine if r.peer_id != me.peer_id] + [me]
    # the reverse of the order in which backups promote (peer/backup.py's promotion_rank)
    last_first = sorted(mine, key=lambda r: (-r.compute_rate, r.peer_id), reverse=True)
    leaving = {r.peer_id for r in last_first[:excess]}
    return target if me.peer_id in leaving else None


@dataclass(frozen=True)
class JoinPolicy:
    # Once routes cover every layer, a newcomer serves only if it raises what they carry (the
    # bottleneck) by this fraction or demand needs it; otherwise it keeps a stage warm. A
    # duplicate range that adds little speed would only split traffic, where a backup makes a
    # stage survive its peer.
    min_gain: float = 0.5
    busy: float = 0.5  # a layer whose demand passes this share of its capacity needs more servers


def place_peer(
    records: list[PeerRecord], num_layers: int, me: Capacity, peer_id: str, policy: JoinPolicy = JoinPolicy(),
    near: Mapping[str, float] | None = None,
) -> Placement:
    """Serve where it helps most; when every layer already has enough throughput, keep a stage warm instead.

    "Enough" means: routes cover every layer, this peer would raise what they carry (the
    bottleneck) by less than `policy.min_gain`, and no layer is busier than `policy.busy` of its
    capacity.
    """
    others = [r for r in records if r.peer_id != peer_id]
    totals = layer_throughputs(others, num_layers)
    start, end = choose_range(others, num_layers, me, near, totals)
    before = min(totals)
    if before <= 0:
        return Placement(start, end)
    gain = min(with_span(totals, start, end, me.throughput(end - start))) / before - 1
    if gain >= policy.min_gain or utilization(others, num_layers, totals) >= policy.busy:
        return Placement(start, end)
    stage = stage_most_at_risk(others, num_layers, me.max_layers)
    return Placement(*stage, backup=True) if stage is not None else Placement(start, end)


def reclaim(records: list[PeerRecord], num_layers: int, me: Capacity, peer_id: str, previous: tuple[int, int]) -> bool:
    """A peer that restarts with its identity takes its old range back while nobody else serves any of it."""
    start, end = previous
    if not 0 <= start < end <= num_layers or end - start > me.max_layers:
        return False
    others = [r for r in records if r.peer_id != peer_id]
    return max(layer_throughputs(others, num_layers)[start:end]) <= 0


def yields_to(records: list[PeerRecord], me: PeerRecord) -> bool:
    """Two peers that joined at once may have claimed overlapping layers, each before it saw the other.
    Both see both claims, so both agree on one order: the earlier claim (then the lower peer id) keeps
    its layers, and the later one chooses again. A claim's time is its record's `since`, which a
    finished load keeps, so the earlier claimant may already serve. (A peer that served before our
    claim was counted when we chose: choosing again gives the same layers.)"""
    return any(
        r.peer_id != me.peer_id and r.serving and r.start < me.end and me.start < r.end
        and (r.since, r.peer_id) < (me.since, me.peer_id)
        for r in map(planned, records)
    )


def unguarded_gap(records: list[PeerRecord], num_layers: int) -> bool:
    """Is some layer served by nobody, with no warm backup about to take it over? (A serving peer that
    moved to close a gap a backup closes anyway would only open another.)"""
    served = layer_throughputs(records, num_layers)
    guarded = layer_replicas(records, num_layers, (PeerState.BACKUP,))
    return any(t <= 0 and not g for t, g in zip(served, guarded))


def closing_rank(records: list[PeerRecord], num_layers: int, me: PeerRecord) -> int:
    """My place among the online peers that may close a gap in coverage: those not moving whose
    every layer another peer serves too (the others cannot leave without opening another gap),
    fastest first, then by peer id. Every peer ranks them alike, so rank 0 moves at once and each
    later one waits its turn (GAP_STAGGER) and moves only if the gap is still open then."""
    online = [r for r in records if r.state == PeerState.ONLINE and r.moving_to is None]
    replicas = layer_replicas(online, num_layers, (PeerState.ONLINE,))
    candidates = [r for r in online if r.peer_id != me.peer_id and all(replicas[i] >= 2 for i in range(r.start, min(r.end, num_layers)))]
    ordered = sorted([*candidates, me], key=lambda r: (-r.compute_rate, r.peer_id))
    return [r.peer_id for r in ordered].index(me.peer_id)


def choose_model(models: dict[str, tuple[list[PeerRecord], int]]) -> str:
    """Of the models a peer may serve (key -> the model's records and its layer count), the one
    that needs it most: the largest share of layers nobody serves, then the busiest (demand over
    capacity), then the fewest serving peers; the first listed on a tie."""
    def need(key: str) -> tuple[float, float, int]:
        records, num_layers = models[key]
        served = layer_throughputs(records, num_layers)
        gaps = sum(t <= 0 for t in served) / num_layers
        peers = sum(1 for r in map(planned, records) if r.serving)
        return gaps, utilization(records, num_layers), -peers

    return max(models, key=need)  # max keeps the first of equals


def training_stage(records: list[PeerRecord], num_layers: int, max_layers: int) -> tuple[int, int] | None:
    """Which stage of a training run a joining replica takes, from the run's records: the first
    layers no replica holds (from there, as many as fit), else the stage with the fewest replicas.
    Replicas of one stage average their weights, so a joiner copies an existing range exactly; None
    when every stage is longer than `max_layers`."""
    stages: dict[tuple[int, int], int] = {}
    for r in records:
        if r.state in (PeerState.ONLINE, PeerState.JOINING):
            stages[(r.start, r.end)] = stages.get((r.start, r.end), 0) + 1
    held = [False] * num_layers
    for start, end in stages:
        held[start:end] = [True] * (end - start)
    if not all(held):
        start = held.index(False)
        end = start
        while end < num_layers and not held[end] and end - start < max_layers:
            end += 1
        return start, end
    fitting = [(count, start, end) for (start, end), count in stages.items() if end - start <= max_layers]
    return min(fitting)[1:] if fitting else None


def misfit(records: list[PeerRecord], start: int, end: int) -> tuple[int, int] | None:
    """A stage of the run that [start, end) overlaps without matching it (its replicas could not
    average with a replica of these layers, and no route could chain both), or None."""
    for r in records:
        if r.state in (PeerState.ONLINE, PeerState.JOINING) and r.start < end and start < r.end and (r.start, r.end) != (start, end):
            return r.start, r.end
    return None
