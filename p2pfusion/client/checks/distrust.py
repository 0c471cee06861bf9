"""Which peers a client stops routing through, beyond those its own checks caught: the peers that
enough distinct other clients reported in the DHT for wrong results (client/checks/policy.py,
`distrusted_by_reports`), read again every REFRESH_SECONDS."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from p2pfusion.client.checks.policy import distrusted_by_reports
from p2pfusion.client.route.access import SwarmAccess

log = logging.getLogger(__name__)

REFRESH_SECONDS = 30.0  # how often other clients' fault reports are read again
REPORT_TIMEOUT = 10.0


class Distrust:
    """The fault reports side of a client's distrust; `access` keeps the set routes avoid."""

    def __init__(self, access: SwarmAccess):
        self.access = access
        self._read_at = -math.inf

    async def refresh(self) -> None:
        if time.monotonic() - self._read_at < REFRESH_SECONDS:
            return
        self._read_at = time.monotonic()
        try:
            reports = await asyncio.wait_for(self.access.swarm.fault_reports(self.access.model), REPORT_TIMEOUT)
        except (TimeoutError, OSError) as exc:
            log.debug("cannot read fault reports: %r", exc)
            return
        self.access.take_reports(frozenset(distrusted_by_reports(reports)))

    def catch(self, peer_id: str) -> None:
        """This client's own verification caught `peer_id` computing wrong results."""
        self.access.catch(peer_id)
