"""What a peer knows of the others from their signed records: where it may dial its next hop, and
which peers are listed (their streams relay other clients' sessions).

An `Open` names the next hop's addresses, but whoever sent it chose them: a peer that dialled
them would scan ports for anyone. So it dials the route's addresses only where the next hop's own
record lists them too (or the record's, if none is), and at most MAX_DIALED of them; a next hop
with no record is refused. A next hop that announced since the last lookup is no fault of the
peer before it: a miss waits for the next lookup allowed (at most RETRY seconds) before refusing,
so a client that saw a newer record than its first hop does not take that hop for a liar.
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
    """The model's records, kept FRESH seconds; a miss looks again, at most once per RETRY seconds,
    one lookup at a time. Offline peers are left out."""

    def __init__(
        self, lookup: Callable[[], Awaitable[list[PeerRecord]]], clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self._lookup = lookup
        self._clock = clock
        self._sleep = sleep
        self._records: dict[str, PeerRecord] = {}
        self._offline: set[str] = set()
        self._fetched = -float("inf")
        self._pending: asyncio.Task | None = None

    async def __call__(self, peer_id: str) -> list[str] | None:
        """The next hop's announced data addresses; None: it has no record, even in a lookup made
        after the route was chosen."""
        record = await self._record(peer_id)
        if record is None and peer_id not in self._offline:
            asked = self._clock()
            await self._sleep(max(0.0, self._fetched + RETRY - asked))
            if self._fetched <= asked:
                await self._refresh()
            record = self._records.get(peer_id)
        return None if record is None else list(record.data_addrs)

    async def serves(self, peer_id: str) -> tuple[int, int] | None:
        """The layers the peer's record says it serves; None: it has no record."""
        record = await self._record(peer_id)
        return None if record is None else (record.start, record.end)

    async def _record(self, peer_id: str) -> PeerRecord | None:
        age = self._clock() - self._fetched
        if age > FRESH or (peer_id not in self._records and age > RETRY):
            await self._refresh()
        return self._records.get(peer_id)

    def listed(self, peer_id: str) -> bool:
        """Whether the last lookup found the peer's record (without waiting for a new one)."""
        return peer_id in self._records

    async def _refresh(self) -> None:
        if self._pending is None:
            self._pending = asyncio.create_task(self._lookup())
        task = self._pending
        try:
            records = await asyncio.shield(task)
        finally:
            if self._pending is task and task.done():
                self._pending = None
        self._records = {r.peer_id: r for r in records if r.state != PeerState.OFFLINE}
        self._offline = {r.peer_id for r in records if r.state == PeerState.OFFLINE}
        self._fetched = self._clock()
