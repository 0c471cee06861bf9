"""What this node knows of its links to other peers: measured on first use, kept for a while.

A hop needs its link to the next hop before it picks a codec. Peers measure a few links when
they join; anything else is measured the first time a session needs it, with a small probe
(the bandwidth of a slow link only matters to within a factor, not a percent).
"""

from __future__ import annotations

import asyncio
import logging
import time

from p2pfusion.errors import PeerFailed, RequestError
from p2pfusion.net import probe
from p2pfusion.net.compression import LinkSpeed
from p2pfusion.net.transport import Transport

log = logging.getLogger(__name__)

LINK_TTL = 600.0  # links change slowly; measure again after this long
FAILED_TTL = 30.0  # a peer that could not be measured (still loading, say) is tried again sooner
PROBE_BYTES = 256 << 10
PROBE_TIMEOUT = 5.0
MAX_LINKS = 4096  # past this many peers known, stale entries are dropped


class LinkBook:
    def __init__(self, transport: Transport):
        self.transport = transport
        self._links: dict[str, tuple[float, LinkSpeed | None]] = {}
        self._pending: dict[str, asyncio.Task] = {}

    async def get(self, peer_id: str, data_addrs: list[str]) -> LinkSpeed | None:
        """The link to `peer_id`, measuring it first if unknown or stale; None if it cannot be measured."""
        entry = self._links.get(peer_id)
        if entry is not None and _fresh(entry, time.monotonic()):
            return entry[1]
        task = self._pending.get(peer_id)
        if task is None:  # sessions opening together to one peer share one probe
            task = self._pending[peer_id] = asyncio.create_task(self._measure(peer_id, data_addrs))
            task.add_done_callback(lambda _: self._pending.pop(peer_id, None))
        return await asyncio.shield(task)

    def round_trips(self) -> dict[str, float]:
        """The last round trip measured to each peer, in seconds: stale ones too, since where a
        peer is changes far more slowly than how fast its link is."""
        return {p: e[1].rtt for p, e in self._links.items() if e[1] is not None}

    async def _measure(self, peer_id: str, data_addrs: list[str]) -> LinkSpeed | None:
        try:
            link = await probe.measure_link(self.transport, peer_id, data_addrs, PROBE_BYTES, PROBE_TIMEOUT)
        except (PeerFailed, RequestError, EOFError, OSError, TimeoutError) as exc:  # unmeasured links go uncompressed
            log.info("could not measure the link to %s: %r", peer_id, exc)
            link = None
        now = time.monotonic()
        if len(self._links) >= MAX_LINKS:
            self._links = {p: e for p, e in self._links.items() if _fresh(e, now)}
        self._links[peer_id] = (now, link)
        return link


def _fresh(entry: tuple[float, LinkSpeed | None], now: float) -> bool:
    return now - entry[0] < (LINK_TTL if entry[1] is not None else FAILED_TTL)
