"""Checking clients' reports that a peer is unreachable, before acting on them.

Anyone may write such a report, so a peer believes one only when its own probe of the reported
peer fails too. The reported peers are probed at once, beside a peer that was not reported (the
one this peer measured the quickest link to): a killed peer refuses at once, and a frozen one,
silent after a few of its usual round trips while the other answered, is taken as gone without
waiting out the probe's timeout (net/silence.py). A verdict is kept VERIFY_TTL seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.net import probe
from p2pfusion.net.transport import Transport

VERIFY_TTL = 10.0  # seconds our check of a peer that clients reported unreachable is trusted
PROBE_TIMEOUT = 3.0  # seconds: a fresh connection across a continent
MAX_VERDICTS = 4096  # verdicts kept; reports are cheap to make up
MAX_PROBES = 64  # reported peers probed at once; the rest wait for the next look


class ReportCheck:
    """This peer's verdicts on reported peers: peer id -> (when checked, reachable)."""

    def __init__(self, transport: Transport, own_id: str, round_trips: Callable[[], dict[str, float]]):
        self.transport = transport
        self.own_id = own_id
        self.round_trips = round_trips  # the last round trip this peer measured to each other peer
        self._verdicts: dict[str, tuple[float, bool]] = {}

    async def gone(self, records: list[PeerRecord], reported: set[str]) -> set[str]:
        """The reported peers among `records` that fail our probe too (those not probed yet count
        as reachable)."""
        listed = {r.peer_id: r for r in records if r.state != PeerState.OFFLINE and r.peer_id != self.own_id}
        now, suspects = time.monotonic(), sorted(reported & set(listed))
        stale = [listed[p] for p in suspects if p not in self._verdicts or now - self._verdicts[p][0] > VERIFY_TTL]
        if stale:
            await self._probe(stale[:MAX_PROBES], [r for p, r in listed.items() if p not in reported], now)
        return {p for p in suspects if not self._verdicts.get(p, (now, True))[1]}

    async def _probe(self, targets: list[PeerRecord], unreported: list[PeerRecord], now: float) -> None:
        rtts = self.round_trips()
        asked = targets + sorted(unreported, key=lambda r: rtts.get(r.peer_id, float("inf")))[:1]
        silent = await probe.silent_peers(
            self.transport, {r.peer_id: r.data_addrs for r in asked}, PROBE_TIMEOUT, dict(rtts), unknown_like_first=True,
        )
        if len(self._verdicts) >= MAX_VERDICTS:
            self._verdicts = {p: v for p, v in self._verdicts.items() if now - v[0] <= VERIFY_TTL}
        for record in targets:
            self._verdicts[record.peer_id] = (now, record.peer_id not in silent)
