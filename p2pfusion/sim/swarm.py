"""The swarm the real policies build from a fleet: peers join one at a time, each placing itself
as a joining peer does (`place_peer`, with its round trips to up to a dozen peers), then serving
peers rebalance (`plan_move`) and backups take up their stage when demand needs it, in rounds,
until nobody moves. Demand is saturated (every serving peer's load is its throughput): the case
where placement decides what the swarm carries.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.peer.balance import Placement, place_peer
from p2pfusion.peer.rebalance import plan_move
from p2pfusion.sim.fleet import Volunteer, round_trip
from p2pfusion.sim.profiles import ModelShape

PROBED = 12  # peers a joining peer measures its links to (peer/runtime.py's LINK_PROBES)
RELOAD_SECONDS_PER_LAYER = 2.0  # a layer read from disk and set up: a gigabyte at half a GB/s
UPTIME = 3600.0  # seconds a peer expects to stay, for the rebalancer's pay-back


@dataclass
class Swarm:
    model: ModelShape
    volunteers: dict[str, Volunteer]
    records: dict[str, PeerRecord]
    rng: random.Random
    geography: bool = True

    def near(self, me: Volunteer) -> dict[str, float] | None:
        if not self.geography:
            return None
        others = [p for p in self.records if p != me.peer_id]
        probed = self.rng.sample(others, min(PROBED, len(others)))
        return {p: round_trip(me.region, self.volunteers[p].region) for p in probed}

    def join(self, me: Volunteer, serving: PeerState = PeerState.ONLINE) -> Placement:
        """The volunteer places itself; its record says `serving` (JOINING while it loads) or BACKUP."""
        self.volunteers[me.peer_id] = me
        records = list(self.records.values())
        placement = place_peer(records, self.model.layers, me.capacity, me.peer_id, near=self.near(me))
        self.put(me, placement.start, placement.end, PeerState.BACKUP if placement.backup else serving)
        return placement

    def leave(self, peer_id: str) -> None:
        self.records.pop(peer_id, None)

    def settle(self, rounds: int = 30) -> int:
        """Rounds of every peer's upkeep, in random order, until nobody moved; how many ran."""
        for done in range(1, rounds + 1):
            if not any([self._upkeep(peer_id) for peer_id in self.rng.sample(list(self.records), len(self.records))]):
                return done
        return rounds

    def _upkeep(self, peer_id: str) -> bool:
        """One peer's look at the swarm (peer/upkeep.py's rebalancing); True when it changed."""
        me, mine = self.volunteers[peer_id], self.records[peer_id]
        records = list(self.records.values())
        if mine.state == PeerState.BACKUP:
            placement = place_peer(records, self.model.layers, me.capacity, peer_id, near=self.near(me))
            if placement.backup or (placement.start, placement.end) != (mine.start, mine.end):
                return False
            self.put(me, mine.start, mine.end, PeerState.ONLINE)
            return True
        move = plan_move(
            records, self.model.layers, mine, me.capacity, RELOAD_SECONDS_PER_LAYER, UPTIME, near=self.near(me)
        )
        if move is None:
            return False
        self.put(me, move.start, move.end, PeerState.ONLINE)
        return True

    def put(self, me: Volunteer, start: int, end: int, state: PeerState) -> None:
        """The peer's record as it announces serving (or keeping warm) [start, end) in `state`."""
        record = me.record(self.model, start, end, state)
        self.records[me.peer_id] = replace(record, load=record.throughput if record.serving else 0.0)

    def announce_move(self, peer_id: str, target: tuple[int, int]) -> None:
        """The peer says it loads `target` while its present layers keep serving."""
        self.records[peer_id] = replace(self.records[peer_id], moving_to=target)


def built(fleet: list[Volunteer], model: ModelShape, rng: random.Random, geography: bool = True) -> Swarm:
    """The swarm after every volunteer of `fleet` joined, in its order (nobody rebalanced yet)."""
    swarm = Swarm(model, {}, {}, rng, geography)
    for volunteer in fleet:
        swarm.join(volunteer)
    return swarm


def fewest_hops(records: list[PeerRecord], num_layers: int) -> int:
    """The fewest peers a route through these records passes (0: none covers the model). A route
    enters a peer at its first layer and may leave it where another peer starts, or at the end."""
    serving = [r for r in records if r.serving]
    starts = {r.start for r in serving}
    reached, frontier, hops = {0}, {0}, 0
    while num_layers not in reached:
        if not frontier:
            return 0
        hops += 1
        frontier = {
            stop for r in serving if r.start in frontier
            for stop in range(r.start + 1, min(r.end, num_layers) + 1) if stop in starts or stop == num_layers
        } - reached
        reached |= frontier
    return hops
