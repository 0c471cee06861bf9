"""Volunteers coming and going, and the swarm the real policies keep through it.

Sessions last an exponential time (median `session_median`); newcomers arrive as a Poisson
process at the rate that keeps the fleet's size steady. Departures are crashes, the worst case:
the peer stops at once and its record stays in the others' view until it expires (RECORD_TTL).
The peers' timers are the peer's own (peer/runtime.py's options, peer/upkeep.py, peer/backup.py):
- a newcomer places itself (`place_peer`) and serves once its layers are loaded;
- every watch period, a backup whose stage lost a peer promotes, in rank order, and a serving
  peer that sees a layer nobody serves nor guards plans a move to it (`plan_move`, no minimum
  gain, in `closing_rank` order); its record says where it goes (`moving_to`) while it loads;
- every rebalance period, a backup takes up its stage if demand needs it, and a serving peer moves
  if the cost model says so.
A join takes RELOAD_SECONDS_PER_LAYER per layer, and a move as long per layer it did not hold
(a peer keeps the layers its old and new ranges share). What the swarm carries is its weakest
layer's throughput, summed over the live peers that have loaded and serve it (the maximum flow,
sim/optimum.py); `Timeline.gaps` times every stretch in which some layer had no live serving peer
while the live fleet's memory could hold the model.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from p2pfusion.dht.records import PeerState
from p2pfusion.dht.validation import RECORD_TTL
from p2pfusion.peer.backup import PROMOTION_STAGGER, promotion_rank, replaced, stage_servers
from p2pfusion.peer.balance import closing_rank, place_peer, unguarded_gap
from p2pfusion.peer.rebalance import new_layers, plan_move
from p2pfusion.peer.runtime import PeerOptions
from p2pfusion.peer.upkeep import GAP_STAGGER
from p2pfusion.sim.fleet import Volunteer
from p2pfusion.sim.optimum import carried
from p2pfusion.sim.swarm import RELOAD_SECONDS_PER_LAYER, Swarm

_PEER_DEFAULTS = {f.name: f.default for f in fields(PeerOptions)}
SIM_WATCH_PERIOD = _PEER_DEFAULTS["watch_period"]
SIM_REBALANCE_PERIOD = _PEER_DEFAULTS["rebalance_period"]
SESSION_MEDIAN = 5400.0  # seconds: volunteers stay an hour and a half, half of them longer


@dataclass
class Timeline:
    swarm: Swarm
    draw: Callable[[str], Volunteer]  # a newcomer that can hold a layer, by peer id (fleet.newcomer)
    session_median: float = SESSION_MEDIAN
    now: float = 0.0
    serving: dict[str, tuple[int, int]] = field(default_factory=dict)  # loaded and live ranges
    alive: set[str] = field(default_factory=set)
    busy: set[str] = field(default_factory=set)  # loading (a join or a move): no other decision
    joined: dict[str, float] = field(default_factory=dict)
    gaps: list[float] = field(default_factory=list)  # lengths of the stretches with an unserved layer
    _gap_since: float | None = None
    _events: list = field(default_factory=list)
    _seq: itertools.count = field(default_factory=itertools.count)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1_000_000))

    @property
    def rng(self) -> random.Random:
        return self.swarm.rng

    @property
    def layers(self) -> int:
        return self.swarm.model.layers

    def start(self) -> None:
        """Take over a settled swarm: its online peers serve, and everyone's timers start."""
        for peer_id, record in self.swarm.records.items():
            self.alive.add(peer_id)
            self.joined[peer_id] = 0.0
            if record.state == PeerState.ONLINE:
                self.serving[peer_id] = (record.start, record.end)
            self._timers(peer_id)
        self._at(self._arrival_gap(), self._arrive)

    def run_until(self, until: float, every: float, sample: Callable[[Timeline], None]) -> None:
        """Play events up to `until`, calling `sample` every `every` seconds."""
        next_sample = self.now + every
        while self._events and self._events[0][0] <= until:
            when, _, action, args = heapq.heappop(self._events)
            while next_sample <= when:
                self.now = next_sample
                sample(self)
                next_sample += every
            self.now = when
            action(*args)
            self._track_gap()
        while next_sample <= until:
            self.now = next_sample
            sample(self)
            next_sample += every
        self.now = until
        self._track_gap(closing=True)

    def flow(self) -> float:
        caps = self.swarm.volunteers
        return carried([(a, b, caps[p].capacity.throughput(b - a)) for p, (a, b) in self.serving.items()], self.layers)

    def live_capacities(self):
        return [self.swarm.volunteers[p].capacity for p in sorted(self.alive)]

    # --- scheduling

    def _at(self, when: float, action, *args) -> None:
        heapq.heappush(self._events, (when, next(self._seq), action, args))

    def _arrival_gap(self) -> float:
        mean_session = self.session_median / math.log(2)
        return self.rng.expovariate(len(self.alive) / mean_session if self.alive else 1.0)

    def _timers(self, peer_id: str) -> None:
        self._at(self.now + self.rng.expovariate(math.log(2) / self.session_median), self._depart, peer_id)
        self._at(self.now + SIM_REBALANCE_PERIOD * self.rng.uniform(0.8, 1.2), self._upkeep, peer_id)

    # --- events

    def _arrive(self) -> None:
        self._at(self.now + self._arrival_gap(), self._arrive)
        me = self.draw(f"v{next(self._ids)}")
        self.alive.add(me.peer_id)
        self.joined[me.peer_id] = self.now
        placement = self.swarm.join(me, serving=PeerState.JOINING)
        self._load(me.peer_id, (placement.start, placement.end), online=not placement.backup)
        self._timers(me.peer_id)

    def _load(self, peer_id: str, target: tuple[int, int], online: bool, held: tuple[int, int] = (0, 0)) -> None:
        """`held`: the layers the peer holds already, which it keeps."""
        self.busy.add(peer_id)
        self._at(self.now + RELOAD_SECONDS_PER_LAYER * new_layers(held, target), self._loaded, peer_id, target, online)

    def _loaded(self, peer_id: str, target: tuple[int, int], online: bool) -> None:
        if peer_id not in self.alive:
            return
        self.busy.discard(peer_id)
        record = self.swarm.records[peer_id]
        if online or record.state == PeerState.ONLINE:  # a backup may have been promoted meanwhile
            self.swarm.put(self.swarm.volunteers[peer_id], *target, PeerState.ONLINE)
            self.serving[peer_id] = target

    def _depart(self, peer_id: str) -> None:
        self.alive.discard(peer_id)
        self.busy.discard(peer_id)
        self.serving.pop(peer_id, None)
        self._at(self.now + RECORD_TTL, self._expire, peer_id)

    def _expire(self, peer_id: str) -> None:
        """The crashed peer's record is gone from everyone's view: backups and serving peers react."""
        record = self.swarm.records.get(peer_id)
        if record is None:
            return
        self.swarm.leave(peer_id)
        records = list(self.swarm.records.values())
        gap = unguarded_gap(records, self.layers)
        for other in records:
            if other.peer_id not in self.alive:
                continue
            pause = self.rng.uniform(0, SIM_WATCH_PERIOD)
            if other.state == PeerState.BACKUP and other.start < record.end and record.start < other.end:
                before = stage_servers(records, other.start, other.end) | {peer_id}
                rank = promotion_rank(records, other)
                self._at(self.now + pause + rank * PROMOTION_STAGGER, self._promote, other.peer_id, before, rank)
            elif other.state == PeerState.ONLINE and gap:
                rank = closing_rank(records, self.layers, other)
                self._at(self.now + pause + rank * GAP_STAGGER, self._close_gap, other.peer_id)

    def _promote(self, peer_id: str, before: set[str], rank: int) -> None:
        record = self.swarm.records.get(peer_id)
        if peer_id not in self.alive or record is None or record.state != PeerState.BACKUP:
            return
        if rank > 0 and replaced(before, list(self.swarm.records.values()), record.start, record.end, set()):
            return
        self._serve(peer_id)

    def _serve(self, peer_id: str) -> None:
        """A backup takes up its stage (at once if its layers are loaded, else once they are)."""
        record = self.swarm.records[peer_id]
        self.swarm.put(self.swarm.volunteers[peer_id], record.start, record.end, PeerState.ONLINE)
        if peer_id not in self.busy:
            self.serving[peer_id] = (record.start, record.end)

    def _close_gap(self, peer_id: str) -> None:
        if self._may_decide(peer_id) and unguarded_gap(list(self.swarm.records.values()), self.layers):
            self._maybe_move(peer_id, min_gain=0.0)

    def _upkeep(self, peer_id: str) -> None:
        if peer_id not in self.alive:
            return
        self._at(self.now + SIM_REBALANCE_PERIOD * self.rng.uniform(0.8, 1.2), self._upkeep, peer_id)
        if not self._may_decide(peer_id, PeerState.BACKUP):
            return
        record, me = self.swarm.records[peer_id], self.swarm.volunteers[peer_id]
        if record.state == PeerState.BACKUP:
            placement = place_peer(list(self.swarm.records.values()), self.layers, me.capacity, peer_id,
                                   near=self.swarm.near(me))
            if not placement.backup and (placement.start, placement.end) == (record.start, record.end):
                self._serve(peer_id)
        else:
            self._maybe_move(peer_id, min_gain=0.05)

    def _may_decide(self, peer_id: str, *states: PeerState) -> bool:
        record = self.swarm.records.get(peer_id)
        return (peer_id in self.alive and peer_id not in self.busy and record is not None
                and record.state in (PeerState.ONLINE, *states))

    def _maybe_move(self, peer_id: str, min_gain: float) -> None:
        record, me = self.swarm.records[peer_id], self.swarm.volunteers[peer_id]
        move = plan_move(list(self.swarm.records.values()), self.layers, record, me.capacity,
                         RELOAD_SECONDS_PER_LAYER, self.now - self.joined[peer_id], min_gain, self.swarm.near(me))
        if move is None:
            return
        target, held = (move.start, move.end), (record.start, record.end)
        if move.overlap:
            self.swarm.announce_move(peer_id, target)
        else:
            self.swarm.put(me, *target, PeerState.JOINING)
            self.serving.pop(peer_id, None)
        self._load(peer_id, target, online=True, held=held)

    # --- coverage

    def _track_gap(self, closing: bool = False) -> None:
        held = sum(self.swarm.volunteers[p].capacity.max_layers for p in self.alive) >= self.layers
        starts = [0] * (self.layers + 1)
        for a, b in self.serving.values():
            starts[a] += 1
            starts[b] -= 1
        covered = all(c > 0 for c in itertools.accumulate(starts[:-1]))
        gap = held and not covered
        if gap and self._gap_since is None:
            self._gap_since = self.now
        elif self._gap_since is not None and (not gap or closing):
            self.gaps.append(self.now - self._gap_since)
            self._gap_since = None
