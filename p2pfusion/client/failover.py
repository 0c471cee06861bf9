"""A session that outlives its peers: when one dies or leaves, route around it and replay.

The client keeps every input it sent (the embeddings of the tokens so far, their position ids).
When a peer fails, it bans that peer (with growing back-off), reports it in the DHT so a warm
backup can take over, finds a new route among the online peers and warm backups, gives the new
hops the session's adapter, and sends the whole history again as one prefill step, with the
pending step's inputs at its end. Each hop of the new route rebuilds its KV cache from those
inputs, so the generation goes on exactly as it would have. Training sessions
(p2pfusion.client.training) use the same connecting and failing over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch

from p2pfusion.client.adapters import RemoteParameters
from p2pfusion.client.catalog import model_records
from p2pfusion.client.health import PeerHealth
from p2pfusion.client.routing import find_route
from p2pfusion.client.session import InferenceSession
from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.errors import PeerFailed, RouteError
from p2pfusion.net.compression import AUTO, Purpose
from p2pfusion.net.links import LinkBook

log = logging.getLogger(__name__)

FAILOVER_TIMEOUT = 120.0  # how long a session waits for the swarm to cover its layers again
RETRY_DELAY = 0.5
AVOID_SECONDS = 30.0  # a leaving peer's record says so within a record's lifetime
MIN_STEP_TIMEOUT = 10.0
LONG_STEP_TIMEOUT = 120.0


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
    compression: str = AUTO
    # peers this client will not route through: caught computing wrong results, by its own
    # verification or by enough other clients' reports (p2pfusion.client.verify)
    distrusted: set[str] = field(default_factory=set)

    def session(
        self, max_length: int, params: RemoteParameters | None = None, purpose: Purpose = Purpose.INFERENCE
    ) -> ResilientSession:
        return ResilientSession(self, max_length, params, purpose)


class ResilientSession:
    def __init__(
        self,
        access: SwarmAccess,
        max_length: int,
        params: RemoteParameters | None = None,
        purpose: Purpose = Purpose.INFERENCE,
    ):
        self.access = access
        self.max_length = max_length
        self.params = params  # the adapter every route of this session gets
        self.purpose = purpose
        self.session: InferenceSession | None = None
        self.history: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (inputs, position ids) per step
        self.recoveries = 0
        # peers that told this session they are leaving: peer id -> (its record's `since`, when told)
        self._avoid: dict[str, tuple[float, float]] = {}
        self._known: dict[str, PeerRecord] = {}  # the records of the last lookup
        self._step_seconds: float | None = None
        self._reports: set[asyncio.Task] = set()

    async def open(self) -> ResilientSession:
        await self.connect(recovering=False)
        return self

    async def connect(self, recovering: bool) -> None:
        deadline = time.monotonic() + FAILOVER_TIMEOUT
        last: Exception | None = None
        while True:
            try:
                access = self.access
                records = await model_records(access.swarm, access.model, access.name)
                self._known = {r.peer_id: r for r in records}
                avoid = access.health.banned(records) | self._avoided(records) | access.distrusted
                route = find_route(records, access.num_layers, access.health.observed, avoid, recovering, self.max_length)
                self.session = await InferenceSession(
                    access.swarm.transport, route, self.max_length, access.compression, access.links, self.purpose
                ).open()
                await self.update_params(self.params)
                return
            except PeerFailed as exc:
                await self.drop()
                self.failed(exc)
                last, recovering = exc, True
            except RouteError as exc:
                if not recovering:
                    raise
                if last is None or str(last) != str(exc):
                    log.warning("waiting for the swarm to recover: %s", exc)
                last = exc
            if time.monotonic() > deadline:
                raise RouteError(f"the swarm did not recover within {FAILOVER_TIMEOUT:.0f} s: {last}")
            await asyncio.sleep(RETRY_DELAY)

    async def update_params(self, params: RemoteParameters | None) -> None:
        """Give the current route new adapter values (nothing is sent when they did not change)."""
        self.params = params
        if params is not None and self.session is not None and self.session.adapter != params.message.digest:
            await self.session.set_adapter(params.message, params.flat)

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

    def _since(self, peer_id: str) -> float:
        record = self._known.get(peer_id)
        return 0.0 if record is None else record.since

    def failed(self, exc: PeerFailed) -> None:
        if exc.peer_id is None:
            log.warning("%s", exc)
            return
        ban = self.access.health.failed(exc.peer_id, self._since(exc.peer_id))
        log.warning("%s; avoiding that peer for %.0f s", exc, ban)
        task = asyncio.create_task(self.access.swarm.report_unreachable(self.access.model, exc.peer_id, str(exc)))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    def _timeout(self, tokens: int) -> float:
        if tokens > 1 or self._step_seconds is None:
            return LONG_STEP_TIMEOUT
        return max(MIN_STEP_TIMEOUT, 20 * self._step_seconds)

    async def step(
        self, hidden: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Like InferenceSession.step, but a failed or leaving peer costs a replay, not the generation."""
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
                out = await self.session.step(inputs, self._timeout(inputs.shape[1]), mask, ids)
            except PeerFailed as exc:
                self.failed(exc)
                self.recoveries += 1
                await self.drop()
                continue
            self._observe(inputs.shape[1])
            self.history.append((hidden, positions))
            return out[:, -hidden.shape[1]:] if replay else out

    async def rewind(self, length: int) -> None:
        """Forget every step past the first `length` positions: the next step opens a new route and
        replays the kept history (a verifier found the later outputs wrong)."""
        kept, position = [], 0
        for hidden, positions in self.history:
            take = min(hidden.shape[1], length - position)
            if take <= 0:
                break
            kept.append((hidden[:, :take], None if positions is None else positions[:, :take]))
            position += take
        self.history = kept
        await self.drop()

    @property
    def position(self) -> int:
        return sum(hidden.shape[1] for hidden, _ in self.history)

    def _replayed(self, hidden: torch.Tensor, positions: torch.Tensor | None):
        """The whole history and the new step as one step, with every token's position id."""
        steps = [*self.history, (hidden, positions)]
        inputs = torch.cat([h for h, _ in steps], dim=1)
        if all(p is None for _, p in steps):
            return inputs, None
        ids, offset = [], 0
        for h, p in steps:
            ids.append(p if p is not None else torch.arange(offset, offset + h.shape[1]).expand(h.shape[0], -1))
            offset += h.shape[1]
        return inputs, torch.cat(ids, dim=1)

    def _observe(self, tokens: int) -> None:
        """Each hop's own compute time, plus an equal share of what the client saw beyond them (the wire)."""
        session = self.session
        spans = {r.peer_id: r.span for r in session.route}
        overhead = max(session.seconds - sum(s for _, s in session.timings), 0.0) / max(len(session.timings), 1)
        for peer_id, seconds in session.timings:
            if peer_id in spans:
                self.access.health.observe(peer_id, spans[peer_id], seconds + overhead, tokens)
        if tokens == 1:
            previous = self._step_seconds
            self._step_seconds = session.seconds if previous is None else 0.8 * previous + 0.2 * session.seconds

    async def drop(self) -> None:
        if self.session is not None:
            await self.session.close()
        self.session = None

    async def close(self) -> None:
        if self.session is not None:
            for record in self.session.route:
                self.access.health.succeeded(record.peer_id)
        await self.drop()
        if self._reports:
            await asyncio.wait(self._reports, timeout=5)
