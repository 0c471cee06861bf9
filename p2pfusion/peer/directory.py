"""Where a peer may dial its next hop: only the data addresses in that hop's own signed record.

An `Open` names the next hop's addresses, but whoever sent it chose them: a peer that dialled
them would scan ports for anyone. So it dials the route's addresses only where the next hop's own
record lists them too (or the record's, if none is), and at most MAX_DIALED of them; a next hop
with no record is refused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.net.transport import MAX_DIALED

FRESH = 5.0  # seconds a lookup of the model's records is reused
RETRY = 1.0  # a peer missing from them is looked up again at most this often


def dial_addrs(named: list[str], announced: list[str], limit: int = MAX_DIALED) -> list[str]:
    """The addresses to dial, of those a route `named` and the hop's record `announced`."""
    both = [addr for addr in named if addr in announced]
    return (both or announced)[:limit]


class HopDirectory:
    """Peer id -> its announced data addresses (None: no record), from the model's records, kept
    FRESH seconds; a miss looks again, at most once per RETRY seconds, one lookup at a time."""

    def __init__(self, lookup: Callable[[], Awaitable[list[PeerRecord]]], clock: Callable[[], float] = time.monotonic):
        self._lookup = lookup
        self._clock = clock
        self._addrs: dict[str, list[str]] = {}
        self._fetched = -float("inf")
        self._pending: asyncio.Task | None = None

    async def __call__(self, peer_id: str) -> list[str] | None:
        age = self._clock() - self._fetched
        if age > FRESH or (peer_id not in self._addrs and age > RETRY):
            await self._refresh()
        return self._addrs.get(peer_id)

    async def _refresh(self) -> None:
        if self._pending is None:
            self._pending = asyncio.create_task(self._lookup())
        task = self._pending
        try:
            records = await asyncio.shield(task)
        finally:
            if self._pending is task and task.done():
                self._pending = None
        self._addrs = {r.peer_id: list(r.data_addrs) for r in records if r.state != PeerState.OFFLINE}
        self._fetched = self._clock()
