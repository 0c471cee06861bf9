"""What all sessions of one client share: its swarm node, what it has learned about peers and
links, and the records routes may use (`SwarmAccess.records`, through the client's trusted set and
its floor of weight formats). Built once per client, by client/core.py."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from p2pfusion.client.route.allowlist import trusted_records
from p2pfusion.client.route.catalog import model_records
from p2pfusion.client.route.health import PeerHealth
from p2pfusion.client.route.pings import ReachBook
from p2pfusion.client.route.planner import format_ranges, refused_only
from p2pfusion.dht.records import PeerRecord
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.models.formats import WeightFormat, accepts
from p2pfusion.net.compression import AUTO, Compression
from p2pfusion.net.links import LinkBook

log = logging.getLogger(__name__)

NOTICE_PERIOD = 30.0  # one line about busy peers per this many seconds, however many sessions meet them


@dataclass
class SwarmAccess:
    """What all sessions of one client share: its swarm node, the model's layer count, what it has
    learned about peers and links, and the codec it asked for."""

    swarm: SwarmNode
    model: str  # the model's swarm key (models/fingerprint.py)
    name: str  # the model's name for people, in messages
    num_layers: int
    health: PeerHealth
    links: LinkBook
    compression: Compression = AUTO
    # peers this client will not route through: those its own verification caught computing wrong
    # results, and those enough other clients reported (client/checks/distrust.py reads the reports)
    caught: set[str] = field(default_factory=set)
    reported: frozenset[str] = frozenset()
    # the only peers routes, failovers and checks may use (client/route/allowlist.py); None: any peer
    trusted: frozenset[str] | None = None
    # the least precise format a route may use (models/formats.py): INT4 takes every peer, FLOAT32 is --exact
    minimum: WeightFormat = WeightFormat.INT4
    reach: ReachBook = field(default_factory=ReachBook)  # peers that answered this client's pings
    routed: Counter[str] = field(default_factory=Counter)  # peer id -> this client's sessions open through it
    _said: dict[str, float] = field(default_factory=dict)  # notice kind -> when it was last logged

    @property
    def distrusted(self) -> set[str]:
        return self.caught | self.reported

    def catch(self, peer_id: str) -> None:
        self.caught.add(peer_id)

    def take_reports(self, reported: frozenset[str]) -> None:
        """The peers other clients' fault reports accuse now (those no longer accused are trusted again)."""
        self.reported = reported

    def opened(self, route: list[PeerRecord]) -> None:
        """A session of this client opened through `route` (routing spreads sessions by these counts)."""
        self.routed.update(r.peer_id for r in route)

    def closed(self, route: list[PeerRecord]) -> None:
        self.routed -= Counter(r.peer_id for r in route)

    def notice(self, kind: str, text: str) -> None:
        """A warning for the user, unless one of its kind went out lately: many sessions meeting the
        same busy swarm say so once."""
        now = time.monotonic()
        if now - self._said.get(kind, -NOTICE_PERIOD) >= NOTICE_PERIOD:
            self._said[kind] = now
            log.warning("%s", text)

    def first_time(self, kind: str) -> bool:
        """Whether no warning of this kind went out yet (one does now): for what the user is told once."""
        if kind in self._said:
            return False
        self._said[kind] = time.monotonic()
        return True

    async def records(self, first: int = 0) -> list[PeerRecord]:
        """The model's records that routing may use: every place that routes reads them here. With
        a trusted set, only its peers' records, or a TrustedGap when they no longer serve a layer
        from `first` on (the layers before it run on the client)."""
        records = await model_records(self.swarm, self.model, self.name, lambda text: self.notice("reread", text))
        accepted = [r for r in records if accepts(r.weights, self.minimum)]
        if len(accepted) < len(records):
            self._say_refused(records, accepted, first)
        records = accepted
        if self.trusted is None:
            return records
        down = self.health.banned(records) | self.distrusted
        return trusted_records(records, self.trusted, self.num_layers, self.name, down, first)

    def _say_refused(self, records: list[PeerRecord], accepted: list[PeerRecord], first: int) -> None:
        """Say which layers only peers in formats this client refuses serve: routes treat them as unserved."""
        ranges, formats = refused_only(records, accepted, self.num_layers, first)
        if ranges:
            self.notice("formats", (
                f"layers {format_ranges(ranges)} of {self.name} are served only in {', '.join(formats)}, below "
                f"the {self.minimum.value} this client accepts (--min-precision): routes leave those peers out"
            ))
