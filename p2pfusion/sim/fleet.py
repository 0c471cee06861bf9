"""Drawing a fleet of volunteers: each a device, an upload link and a region, as shares of
`profiles.py` say, and what its peer would write in its record."""

from __future__ import annotations

import random
from dataclasses import dataclass

from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.peer.balance import Capacity
from p2pfusion.sim.profiles import DEVICES, LINKS, Device, Link, ModelShape, compute_rate, max_layers, network_rate

# round trips between regions (North America, Europe, Asia), seconds, and inside one
REGION_TRIPS = {(0, 1): 0.080, (0, 2): 0.150, (1, 2): 0.200}
INSIDE_REGION = 0.010
REGIONS = 3


def round_trip(a: int, b: int) -> float:
    return INSIDE_REGION if a == b else REGION_TRIPS[(min(a, b), max(a, b))]


@dataclass(frozen=True)
class Volunteer:
    peer_id: str
    device: Device
    link: Link | None
    region: int
    capacity: Capacity

    def record(self, model: ModelShape, start: int, end: int, state: PeerState = PeerState.ONLINE) -> PeerRecord:
        cap = self.capacity
        return PeerRecord(
            model.name, self.peer_id, [], start, end, state, cap.compute_rate, cap.network_rate, self.device.name,
        )


def volunteer(peer_id: str, model: ModelShape, rng: random.Random) -> Volunteer:
    device = rng.choices(DEVICES, weights=[d.share for d in DEVICES])[0]
    return equipped(peer_id, model, device, drawn_link(rng), rng.randrange(REGIONS))


def drawn_link(rng: random.Random) -> Link:
    return rng.choices(LINKS, weights=[link.share for link in LINKS])[0]


def equipped(peer_id: str, model: ModelShape, device: Device, link: Link | None, region: int) -> Volunteer:
    """A volunteer with this device and upload link (None: inside one server)."""
    capacity = Capacity(compute_rate(device, model), network_rate(link, model), min(max_layers(device, model), model.layers))
    return Volunteer(peer_id, device, link, region, capacity)


def newcomer(peer_id: str, model: ModelShape, rng: random.Random) -> Volunteer:
    """A volunteer that can hold at least one layer (a device too small to is not a peer)."""
    while (candidate := volunteer(peer_id, model, rng)).capacity.max_layers < 1:
        pass
    return candidate


def draw_fleet(peers: int, model: ModelShape, rng: random.Random) -> list[Volunteer]:
    return [newcomer(f"v{i}", model, rng) for i in range(peers)]
