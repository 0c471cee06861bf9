"""A peer's periodic duties while it serves: refresh its record, watch its stage, rebalance.

- Refresh: re-announce before the record expires, with the load it carried lately and what it
  holds now (sessions, KV cache reserved, steps queued).
- Load (every second): re-announce at once when what it holds moved a lot (`load_moved`), at
  most every EARLY_GAP seconds, so that a burst of new sessions spreads over the stage's peers.
- Watch (every few seconds): a backup promotes itself when its stage loses a peer; a serving peer
  moves to close a gap in coverage that nobody else closes; a peer kept warm stops spinning while
  another peer serves from its machine.
- Report (every minute): one INFO line for the peer's operator on what it served lately.
- Links (every 30 s): measure the round trips to the peers of the stages next to its own and
  announce them (`PeerRecord.links`), so clients price the hop between two peers (client/route/planner.py).
- Heal (every 15 s): ping the known peers that the DHT's routing table lost (`SwarmNode.heal`),
  so that a node whose table emptied (after a flood, say) does not stay cut off from the swarm.
- Rebalance (every couple of minutes, with random jitter so peers do not all move at once): move
  when the cost model says the swarm gains more than the reload costs; a backup keeps another
  stage warm when that stage has far fewer replicas than its own (balance.backup_stage).
Each move is re-checked against fresh records after a random delay, since another peer may have
acted; a move to close a gap waits its turn among the peers that may close it instead.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from p2pfusion.dht.records import MAX_PEER_LINKS, PeerLink, PeerRecord, PeerState
from p2pfusion.peer.backup import (
    PROMOTION_STAGGER,
    lost_servers,
    promotion_rank,
    replaced,
    stage_servers,
)
from p2pfusion.peer.balance import backup_stage, closing_rank, layer_throughputs, place_peer, unguarded_gap
from p2pfusion.peer.limits import token_bytes
from p2pfusion.peer.rebalance import plan_move
from p2pfusion.peer.runtime import Peer
from p2pfusion.peer.server import StageServer
from p2pfusion.peer.threads import shares_host

log = logging.getLogger(__name__)

LOAD_EMA = 0.5
MOVE_JITTER = 3.0  # seconds; spreads the peers that would make the same move
GAP_STAGGER = 3.0  # seconds between the peers that may close a gap (balance.closing_rank): a DHT write is seen by then
HEAL_PERIOD = 15.0
LOAD_PERIOD = 1.0
EARLY_GAP = 2.0  # seconds between announcements made early for a change of load
LINKS_PERIOD = 30.0  # seconds between measurements of the links to the next stages' peers (LinkBook keeps each 10 min)


def holding(server: StageServer) -> dict[str, int]:
    """The load fields of the peer's record (see PeerRecord), as they are now."""
    sessions = list(server.sessions.values())
    return dict(
        sessions=len(sessions),
        queued=server.compute.scheduler.queued,
        cache_used=sum(s.reserved for s in sessions),
        cache_total=server.limits.budget.total,
        token_bytes=token_bytes(server.stage),
    )


def load_moved(announced: PeerRecord, now: dict[str, int]) -> bool:
    """Whether what a peer holds moved enough since `announced` for clients to route otherwise:
    sessions by a quarter (at least one: from an idle peer, the first counts), or reserved cache by
    an eighth of the budget. The queue changes by the millisecond: the refresh carries it."""
    sessions = abs(now["sessions"] - announced.sessions) >= max(1, announced.sessions // 4)
    cache = abs(now["cache_used"] - announced.cache_used) * 8 >= max(now["cache_total"], 1)
    return sessions or cache


class Upkeep:
    def __init__(self, peer: Peer):
        self.peer = peer
        self.tasks: list[asyncio.Task] = []
        self._stage_before: set[str] | None = None
        # held while a backup promotes itself or moves to another stage: never both at once
        self._stage_change = asyncio.Lock()
        self._tokens = 0
        self._tick = time.monotonic()
        self._reported = (0, 0, time.monotonic())  # sessions opened, tokens done, when: at the last report
        self._early = 0.0  # when the load was last announced early

    async def __aenter__(self) -> Upkeep:
        options = self.peer.options
        self.tasks = [asyncio.create_task(self._every(fn, period, jitter)) for fn, period, jitter in (
            (self.refresh, options.refresh_period, 0.0),
            (self.watch, options.watch_period, 0.0),
            (self.rebalance, options.rebalance_period, 0.2),  # so peers do not all move at once
            (self.report, options.report_period, 0.0),
            (self.peer.swarm.heal, HEAL_PERIOD, 0.2),
            (self.announce_load, LOAD_PERIOD, 0.0),
            (self.measure_links, LINKS_PERIOD, 0.2),
        )]
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _every(self, fn, period: float, jitter: float) -> None:
        while True:
            await asyncio.sleep(period * random.uniform(1 - jitter, 1 + jitter))
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:  # one failed round must not stop the duty; the next round retries
                log.warning("%s failed", fn.__name__, exc_info=True)

    async def refresh(self) -> None:
        server = self.peer.server
        now = time.monotonic()
        rate = (server.tokens_done - self._tokens) / max(now - self._tick, 1e-9)
        self._tokens, self._tick = server.tokens_done, now
        load = LOAD_EMA * self.peer.record.load + (1 - LOAD_EMA) * rate
        await self.peer.announce(load=load, **holding(server))

    async def measure_links(self) -> None:
        """Measure the round trips to the peers of the stages next to this one (those a route
        joins to it) and announce them, so clients price the hops between peers they cannot ping."""
        records, gone = await self.peer.live_records()
        own = self.peer.record
        near = [r for r in records if r.peer_id not in gone and r.peer_id != own.peer_id
                and r.state != PeerState.OFFLINE and (r.end == own.start or r.start == own.end)]
        links = []
        for record in near[:MAX_PEER_LINKS]:
            link = await self.peer.links.get(record.peer_id, record.data_addrs)
            if link is not None:
                links.append(PeerLink(record.peer_id, link.rtt))
        if links != own.links:
            await self.peer.announce(links=links)

    async def announce_load(self) -> None:
        now = holding(self.peer.server)
        if time.monotonic() - self._early >= EARLY_GAP and load_moved(self.peer.record, now):
            self._early = time.monotonic()
            await self.peer.announce(**now)

    async def report(self) -> None:
        server = self.peer.server
        sessions, tokens, then = self._reported
        now = time.monotonic()
        self._reported = (server.sessions_opened, server.tokens_done, now)
        served = server.tokens_done - tokens
        stats = server.compute.stats
        log.info(
            "layers %d:%d: %d sessions open, %d opened and %d tokens served in the last %.0f s (%.1f tokens/s); "
            "since start, %d of %d queued steps ran in %d batches, %d steps of clients' cohorts",
            self.peer.record.start, self.peer.record.end, len(server.sessions), server.sessions_opened - sessions,
            served, now - then, served / max(now - then, 1e-9), stats.batched_steps, stats.steps, stats.batches,
            stats.cohort_steps,
        )

    async def _snapshot(self) -> tuple[list[PeerRecord], set[str]]:
        records, gone = await self.peer.live_records()
        mine = self.peer.record
        # our own record, as we know it now, replaces whatever the DHT returned for us
        others = [r for r in records if r.peer_id != mine.peer_id]
        return others + [mine], gone

    async def watch(self) -> None:
        records, gone = await self._snapshot()
        mine = self.peer.record
        if self.peer.server is not None:
            others = [r.data_addrs for r in records if r.peer_id != mine.peer_id and r.peer_id not in gone]
            self.peer.server.compute.share_host(shares_host(mine.data_addrs, others))
        if mine.state == PeerState.BACKUP:
            await self._watch_stage(records, gone)
        elif mine.state == PeerState.ONLINE and unguarded_gap(records, self.peer.num_layers):
            await self._close_gap(records)

    async def _close_gap(self, records: list[PeerRecord]) -> None:
        """Move to layers nobody serves (nor guards), if the cost model says so: the first of the
        peers that may (balance.closing_rank) at once, each later one after its turn if the gap is
        still open then."""
        rank = closing_rank(records, self.peer.num_layers, self.peer.record)
        if rank > 0:
            log.info("layers nobody serves: closing rank %d", rank)
            await asyncio.sleep(rank * GAP_STAGGER)
            records, _ = await self._snapshot()
            if not unguarded_gap(records, self.peer.num_layers):
                return
        await self._maybe_move(min_gain=0.0, looks=1)

    async def _watch_stage(self, records: list[PeerRecord], gone: set[str]) -> None:
        if self._stage_change.locked():
            return  # moving to another stage: the one watched so far is no longer this backup's
        async with self._stage_change:
            await self._promote_if_lost(records, gone)

    async def _promote_if_lost(self, records: list[PeerRecord], gone: set[str]) -> None:
        mine = self.peer.record
        before, self._stage_before = self._stage_before, stage_servers(records, mine.start, mine.end, gone)
        uncovered = min(layer_throughputs(records, self.peer.num_layers)[mine.start:mine.end]) <= 0
        lost = before is not None and bool(lost_servers(before, records, mine.start, mine.end, gone))
        if not (lost or uncovered):
            return
        rank = promotion_rank(records, mine)
        log.info("stage %d:%d lost a peer; promotion rank %d", mine.start, mine.end, rank)
        await asyncio.sleep(rank * PROMOTION_STAGGER)
        records, gone = await self._snapshot()
        if rank > 0 and replaced(before or set(), records, mine.start, mine.end, gone):
            log.info("another backup took over stage %d:%d", mine.start, mine.end)
            self._stage_before = stage_servers(records, mine.start, mine.end, gone)
            return
        await self.peer.announce(state=PeerState.ONLINE)
        log.info("promoted: now serving layers %d:%d", mine.start, mine.end)

    async def rebalance(self) -> None:
        mine = self.peer.record
        if mine.state == PeerState.BACKUP:
            records, _ = await self._snapshot()
            # on a worker thread, as in _decided
            placement = await asyncio.to_thread(
                place_peer, records, self.peer.num_layers, self.peer.capacity, mine.peer_id,
                near=self.peer.links.round_trips(),
            )
            if not placement.backup and (placement.start, placement.end) == (mine.start, mine.end):
                log.info("demand needs this backup's stage: serving it")
                await self.peer.announce(state=PeerState.ONLINE)
            elif placement.backup:
                await self._maybe_spread()
        elif mine.state == PeerState.ONLINE:
            await self._maybe_move(min_gain=0.05)

    async def _maybe_spread(self) -> None:
        """Keep another stage warm when it has far fewer replicas than this backup's (balance.backup_stage)."""
        if self.peer.options.layers is not None:
            return  # the user chose this stage
        peer = self.peer
        target = await self._decided(lambda records: backup_stage(records, peer.num_layers, peer.record, peer.capacity.max_layers))
        if target is None or self._stage_change.locked() or peer.record.state != PeerState.BACKUP:
            return  # nowhere to go, or it is promoting itself meanwhile
        async with self._stage_change:
            log.info("stage %d:%d has far fewer replicas than this backup's: keeping it warm instead", *target)
            await peer.move(*target, overlap=True, state=PeerState.BACKUP)
            self._stage_before = None  # the servers watched were those of the old stage

    async def _maybe_move(self, min_gain: float, looks: int = 2) -> None:
        """Move if the cost model says so (`looks`: see `_decided`)."""
        if self.peer.options.layers is not None or self.peer.options.train is not None:
            return  # the user chose these layers, or this replica's weights are trained where they are
        peer = self.peer
        move = await self._decided(lambda records: plan_move(
            records, peer.num_layers, peer.record, peer.capacity, peer.reload_seconds_per_layer,
            time.monotonic() - peer.started, min_gain, peer.links.round_trips(),
        ), looks)
        if move is None:
            return
        log.info("rebalancing: gain %.2f, benefit %.0f tokens, cost %.0f tokens", move.gain, move.benefit, move.cost)
        await peer.move(move.start, move.end, move.overlap)

    async def _decided(self, decide, looks: int = 2):
        """What `decide` (a pure policy of fresh records) says, or None: with two looks, it must say
        so now and again after a jittered pause (another peer may have acted meanwhile). On a worker
        thread: in a large swarm pricing every range takes tens of ms, which the loop relaying sessions'
        frames should not wait for."""
        for attempt in range(looks):
            records, _ = await self._snapshot()
            choice = await asyncio.to_thread(decide, records)
            if choice is None:
                return None
            if attempt < looks - 1:
                await asyncio.sleep(random.uniform(0, MOVE_JITTER))
        return choice
