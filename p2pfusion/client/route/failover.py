"""A session that outlives its peers: when one dies or leaves, route around it and replay.

The client keeps every input it sent (the embeddings of the tokens so far, their position ids).
When a peer fails, it bans that peer (with growing back-off), reports it in the DHT so a warm
backup can take over, finds a new route among the online peers and warm backups, gives the new
hops the session's parameters, and sends the whole history again as one prefill step, with the
pending step's inputs at its end. Each hop of the new route rebuilds its KV cache from those
inputs, so the generation goes on exactly as it would have. Fine-tuning steps
(client/tune/steps.py) use the same connecting and failing over.

Before a route is used, its peers answer a ping (client/route/pings.py): a record pointing at a
tarpit costs one short timeout, shared with up to SCREEN_CONCURRENCY others, not a session's.
A busy peer is skipped for as long as its retry hint says (client/route/health.py), not banned: the
session takes another peer of those layers, or waits for room, saying which on stderr once. An
expired session is opened again at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from p2pfusion.client.route.access import SwarmAccess
from p2pfusion.client.route.allowlist import TrustedGap
from p2pfusion.client.route.claims import FalseClaim
from p2pfusion.client.route.params import SessionParams
from p2pfusion.client.route.pings import SCREEN_CONCURRENCY
from p2pfusion.client.route.planner import expected_throughput, find_route, gaps_closing, pinned, usable
from p2pfusion.client.route.session import RouteSession
from p2pfusion.client.route.watch import watched
from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.errors import PeerBusy, PeerFailed, PeerRefused, RouteError, SessionExpired
from p2pfusion.net import messages as m
from p2pfusion.net.compression import Purpose

log = logging.getLogger(__name__)

FAILOVER_TIMEOUT = 120.0  # how long a session waits for the swarm to cover its layers again
RETRY_DELAY = 0.5
GAP_POLL = 2.0  # seconds between reads of the records while peers load a session's missing layers
AVOID_SECONDS = 30.0  # a leaving peer's record says so within a record's lifetime
MIN_STEP_TIMEOUT = 10.0
LONG_STEP_TIMEOUT = 120.0
SCREEN_BUDGET = 10.0  # the most a route's search spends pinging peers before it takes what it has


class ResilientSession:
    def __init__(
        self,
        access: SwarmAccess,
        length: int,
        params: SessionParams | None = None,
        purpose: Purpose = Purpose.INFERENCE,
        batch: int = 1,
        first: int = 0,
        through: str | None = None,
    ):
        self.access = access
        self.length = length  # the most positions it holds
        self.params = params  # the parameters every route of this session gets
        self.purpose = purpose
        self.batch = batch  # sequences per step the peers make room for; a wider step opens again
        self.first = first  # the layer routes start at: the client runs those before it (client/generate/local_layers.py)
        self.through = through  # a peer every route must use, even one avoided (a canary's suspect: client/generate/canary.py)
        self.session: RouteSession | None = None
        self.history: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (inputs, position ids) per step
        self.recoveries = 0
        # peers that told this session they are leaving: peer id -> (its record's `since`, when told)
        self._avoid: dict[str, tuple[float, float]] = {}
        self._known: dict[str, PeerRecord] = {}  # the records of the last lookup
        self._step_seconds: float | None = None
        self._reports: set[asyncio.Task] = set()
        self._busy: PeerBusy | None = None  # the last busy answer, until a route avoids its peer
        self._misbehaved: set[str] = set()  # hops that sent this session frames they may not send
        self._refused: str | None = None  # a peer's error for the pending step, while other peers retry it

    async def open(self) -> ResilientSession:
        await self.connect(recovering=False)
        return self

    async def connect(self, recovering: bool) -> None:
        deadline = time.monotonic() + FAILOVER_TIMEOUT
        last: Exception | None = None
        records: list[PeerRecord] = []
        avoid: set[str] = set()
        while True:
            delay = RETRY_DELAY
            try:
                access = self.access
                records = await access.records(self.first)
                self._known = {r.peer_id: r for r in records}
                avoid = access.health.banned(records) | self._avoided(records) | access.distrusted | access.health.skipped()
                if self.through is not None:
                    records = pinned(records, self.through)
                    avoid.discard(self.through)
                route = await self._route(records, avoid, recovering)
                opening = RouteSession(
                    access.swarm.transport, route, self.length, access.compression, access.links, self.purpose,
                    self.batch,
                ).open()
                # a hop frozen since its last ping would hold the opening for ACK_TIMEOUT, blamed on the first hop
                self.session = await watched(
                    opening, route, access.reach, access.swarm.transport, self._step_seconds, lambda: self._reference(route),
                )
                access.opened(route)
                self._routed_around()
                await self.update_params(self.params)
                return
            except PeerFailed as exc:
                await self.drop()
                self.failed(exc)
                last, recovering = exc, True
            except TrustedGap:  # no trusted peer to wait for, and other peers are never an option
                raise
            except RouteError as exc:
                room = access.health.room_at()
                if not recovering and room is None:
                    # the route's search may have banned peers that did not answer a ping
                    if not gaps_closing(records, access.num_layers, avoid | access.health.banned(records), self.first):
                        raise
                    access.notice("coming", f"{exc}; peers are getting ready to serve them: waiting up to {FAILOVER_TIMEOUT:.0f} s")
                    recovering, last = True, exc  # a warm backup may serve meanwhile
                if room is not None:  # every route needs a busy peer: wait for the first to have room
                    delay = max(room - time.monotonic(), RETRY_DELAY)
                    why = "" if self._busy is None else f" ({self._busy})"
                    access.notice("wait", f"every route needs a busy peer{why}; waiting for room, "
                                          f"{delay:.0f} s at first, for up to {FAILOVER_TIMEOUT:.0f} s")
                elif last is None or str(last) != str(exc):
                    log.warning("waiting for the swarm to recover: %s", exc)
                # a gap that only busy peers' layers make is their being busy, not a gap
                last = exc if self._busy is None else self._busy
            if time.monotonic() > deadline:
                if isinstance(last, PeerBusy):
                    raise PeerBusy(f"peers stayed busy for {FAILOVER_TIMEOUT:.0f} s: {last}", last.peer_id, last.retry_after)
                raise RouteError(f"the swarm did not recover within {FAILOVER_TIMEOUT:.0f} s: {last}")
            await asyncio.sleep(max(min(delay, deadline - time.monotonic()), 0.0))

    async def _route(self, records: list[PeerRecord], avoid: set[str], backups: bool) -> list[PeerRecord]:
        """The best route among peers that answer a ping. Each round pings the route's unpinged
        peers together with the likeliest alternatives (all at once, each with a short timeout),
        bans those that do not answer, and routes again, until every hop answered or
        SCREEN_BUDGET is spent (then the route goes as it is: opening it has its own timeouts)."""
        access, avoid = self.access, set(avoid)
        reach, observed = access.reach, access.health.observed
        deadline = time.monotonic() + SCREEN_BUDGET
        while True:
            route = find_route(
                records, access.num_layers, observed=observed, banned=avoid, backups=backups, length=self.length,
                rtts=reach.rtts, batch=self.batch, own=access.routed, first=self.first,
            )
            unpinged = [r for r in route if not reach.fresh(r.peer_id)]
            if not unpinged or time.monotonic() > deadline:
                return route
            named = {r.peer_id for r in unpinged}
            others = [r for r in usable(records, avoid, backups=backups, length=self.length)
                      if r.peer_id not in named and not reach.fresh(r.peer_id) and r.start >= self.first]
            others.sort(key=lambda r: -expected_throughput(r, observed) * r.span)  # the likeliest next choices
            asked = unpinged + others[:SCREEN_CONCURRENCY - len(unpinged)]
            silent, unheard = await reach.screen_for_route(
                access.swarm.transport, asked, lambda heard: self._routable(records, avoid, heard, backups),
                self._silent, reach.quickest(records, avoid),
            )
            for peer_id in silent:
                access.health.failed(peer_id, self._since(peer_id))
            if silent:
                log.warning("%d peers did not answer a ping; avoiding them", len(silent))
            if unheard:
                log.info("%d peers did not answer a ping at once; routing without them this time", len(unheard))
            avoid |= silent | unheard

    def _routable(self, records: list[PeerRecord], avoid: set[str], heard: set[str], backups: bool) -> bool:
        """Whether the peers that answered a ping (lately, or just now) make a route by themselves."""
        reach = self.access.reach
        answered = [r for r in records if r.peer_id not in avoid and (r.peer_id in heard or reach.fresh(r.peer_id))]
        try:
            find_route(answered, self.access.num_layers, backups=backups, length=self.length, batch=self.batch,
                       first=self.first)
        except RouteError:
            return False
        return True

    def _silent(self, peer_id: str) -> None:
        """A peer the route's search stopped waiting for did not answer its ping either."""
        ban = self.access.health.failed(peer_id, self._since(peer_id))
        log.warning("peer %s did not answer a ping; avoiding it for %.0f s", peer_id, ban)

    async def update_params(self, params: SessionParams | None) -> None:
        """Give the current route new parameter values (nothing is sent when they did not change)."""
        self.params = params
        if params is not None and self.session is not None and self.session.params_digest != params.digest:
            await self.session.set_params(params)

    def _avoided(self, records: list[PeerRecord]) -> set[str]:
        """Peers told us they were leaving; we take them back after AVOID_SECONDS, or at once when a
        newer record says they serve again (they came back, or moved and moved back)."""
        now = time.monotonic()
        serving = {r.peer_id: r.since for r in records if r.state in (PeerState.ONLINE, PeerState.BACKUP)}
        self._avoid = {
            peer: (since, told) for peer, (since, told) in self._avoid.items()
            if now - told < AVOID_SECONDS and serving.get(peer, since) <= since
        }
        return set(self._avoid)

    def _reference(self, route: list[PeerRecord]) -> PeerRecord | None:
        """A peer off the route that answered lately: the one pinged beside a route's hops."""
        return self.access.reach.quickest(list(self._known.values()), {r.peer_id for r in route})

    def _since(self, peer_id: str) -> float:
        record = self._known.get(peer_id)
        return 0.0 if record is None else record.since

    def failed(self, exc: PeerFailed) -> None:
        """Learn from a failure: a busy peer is skipped a moment, a hop that passed on a false claim
        is banned, and a peer that failed is banned and reported for warm backups to take over."""
        if isinstance(exc, PeerBusy):
            if exc.peer_id is not None:
                self.access.health.was_busy(exc.peer_id, exc.retry_after)
                self._busy = exc
            return
        if isinstance(exc, SessionExpired):
            log.info("%s; opening the session again", exc)
            return
        if exc.peer_id is None:
            log.warning("%s", exc)
            return
        ban = self.access.health.failed(exc.peer_id, self._since(exc.peer_id))
        log.warning("%s; avoiding that peer for %.0f s", exc, ban)
        if isinstance(exc, FalseClaim):  # it answers: nothing for a backup to take over
            return
        task = asyncio.create_task(self.access.swarm.report_unreachable(self.access.model, exc.peer_id, str(exc)))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    def _routed_around(self) -> None:
        """Say once that a busy peer's layers went to another peer (not when it had room again)."""
        busy, self._busy = self._busy, None
        record = None if busy is None else self._known.get(busy.peer_id)
        if record is None or busy.peer_id in {r.peer_id for r in self.session.route}:
            return
        instead = [r.peer_id for r in self.session.route if r.start < record.end and record.start < r.end]
        self.access.notice("around", f"{busy}; layers {record.start}:{record.end} go to {', '.join(instead)} instead")

    def _timeout(self, tokens: int) -> float:
        if tokens > 1 or self._step_seconds is None:
            return LONG_STEP_TIMEOUT
        return max(MIN_STEP_TIMEOUT, 20 * self._step_seconds)

    async def step(
        self, hidden: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
        together: m.Cohort | None = None,
    ) -> torch.Tensor:
        """Like RouteSession.step, but a failed or leaving peer costs a replay, not the generation
        (a replay goes alone: it is no step of `together`)."""
        if hidden.shape[0] > self.batch:  # the hops made room for fewer sequences: open for these
            self.batch = hidden.shape[0]
            await self.drop()
        while True:
            if self.session is None:
                await self.connect(recovering=True)
            leaving = self.session.poll_notices()
            if leaving:
                log.info("peers %s are leaving; moving this session", sorted(leaving))
                self._avoid.update({peer: (self._since(peer), time.monotonic()) for peer in leaving})
                await self.drop()
                continue
            replay = self.session.position == 0 and self.history
            inputs, ids = (hidden, positions) if not replay else self._replayed(hidden, positions)
            try:
                step = self.session.step(inputs, self._timeout(inputs.shape[1]), mask, ids, None if replay else together)
                route = self.session.route
                out = await watched(
                    step, route, self.access.reach, self.access.swarm.transport, self._step_seconds,
                    lambda: self._reference(route),
                )
            except PeerFailed as exc:
                self.failed(exc)
                self.recoveries += not isinstance(exc, SessionExpired)
                await self.drop()
                continue
            except PeerRefused as exc:
                if not self._second_opinion(exc):
                    raise
                await self.drop()
                continue
            self._refused = None
            self._observe(inputs.shape[1])
            self.history.append((hidden, positions))
            return out[:, -hidden.shape[1]:] if replay else out

    def _second_opinion(self, exc: PeerRefused) -> bool:
        """Whether to try a step a peer refused again, through other peers: once per step, and only
        where the swarm has a route avoiding some of this one's peers. Any hop may have made the
        error up, and an honest refusal (a request of ours at fault) comes back from any route."""
        if self._refused is not None:
            return False
        records, access = list(self._known.values()), self.access
        avoid = access.health.banned(records) | self._avoided(records) | access.distrusted | access.health.skipped()
        others = set()
        for record in self.session.route:  # every hop that has a stand-in
            try:
                find_route(records, access.num_layers, observed=access.health.observed,
                           banned=avoid | others | {record.peer_id}, backups=True, length=self.length, first=self.first)
                others.add(record.peer_id)
            except RouteError:
                continue
        if not others:
            return False
        log.warning("a peer refused a step (%s); asking other peers", exc)
        self._refused = str(exc)
        now = time.monotonic()
        self._avoid.update({peer: (self._since(peer), now) for peer in others})
        return True

    def keep(self, length: int) -> None:
        """Forget the positions past `length` on this route too (a speculative step's rejected
        drafts): the hops drop them from their caches with the next step, and a replay leaves them out."""
        self._cut_history(length)
        if self.session is not None:
            self.session.keep(length)

    async def rewind(self, length: int) -> None:
        """Forget every step past the first `length` positions: the next step opens a new route and
        replays the kept history (a verifier found the later outputs wrong)."""
        self._cut_history(length)
        await self.drop()

    def _cut_history(self, length: int) -> None:
        kept = cut([hidden for hidden, _ in self.history], length)
        self.history = [(h, None if p is None else p[:, :h.shape[1]]) for h, (_, p) in zip(kept, self.history)]

    @property
    def position(self) -> int:
        return sum(hidden.shape[1] for hidden, _ in self.history)

    def _replayed(self, hidden: torch.Tensor, positions: torch.Tensor | None):
        """The whole history and the new step as one step, with every token's position id."""
        return joined([*self.history, (hidden, positions)])

    def _observe(self, tokens: int) -> None:
        """This client's own time for a one-token step, shared by the route's layers: no peer's
        word about its own speed, or another's, enters what the client expects of peers."""
        session = self.session
        if tokens != 1 or session.seconds <= 0:
            return
        layers = sum(r.span for r in session.route)
        for record in session.route:
            self.access.health.observe(record.peer_id, record.span, session.seconds * record.span / layers)
        previous = self._step_seconds
        self._step_seconds = session.seconds if previous is None else 0.8 * previous + 0.2 * session.seconds

    def _settle_strays(self) -> None:
        """A hop that sent frames it may not send is banned once its route is dropped: the frames
        were dropped, so the session went on, but later routes avoid that hop a while."""
        for peer_id in set(self.session.strays) - self._misbehaved:
            self._misbehaved.add(peer_id)
            ban = self.access.health.failed(peer_id, self._since(peer_id))
            log.warning("peer %s sent frames its stream may not carry; avoiding it for %.0f s", peer_id, ban)

    async def drop(self) -> None:
        if self.session is not None:
            self._settle_strays()
            self.access.closed(self.session.route)
            await self.session.close()
        self.session = None

    async def close(self) -> None:
        if self.session is not None:
            self._settle_strays()
            for record in self.session.route:
                if record.peer_id not in self._misbehaved | self.session.liars:
                    self.access.health.succeeded(record.peer_id)
        await self.drop()
        if self._reports:
            await asyncio.wait(self._reports, timeout=5)


def cut(steps: list[torch.Tensor], length: int) -> list[torch.Tensor]:
    """Steps' tensors [batch, tokens, ...] cut to the sequence's first `length` positions."""
    kept, position = [], 0
    for step in steps:
        take = min(step.shape[1], length - position)
        if take <= 0:
            break
        kept.append(step[:, :take])
        position += take
    return kept


def joined(steps: list[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps' inputs as one step: their hidden states, and every token's position id (None when
    no step had explicit ones: then they are the sequence positions)."""
    inputs = torch.cat([h for h, _ in steps], dim=1)
    if all(p is None for _, p in steps):
        return inputs, None
    ids, offset = [], 0
    for h, p in steps:
        ids.append(p if p is not None else torch.arange(offset, offset + h.shape[1]).expand(h.shape[0], -1))
        offset += h.shape[1]
    return inputs, torch.cat(ids, dim=1)
