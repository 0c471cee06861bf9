"""A session that outlives its peers: when one dies or leaves, route around it and replay.

The client keeps every input it sent (the embeddings of the tokens so far). When a peer fails, it
bans that peer (with growing back-off), reports it in the DHT so a warm backup can take over, finds
a new route among the online peers and warm backups, and sends the whole history again as one
prefill step, with the pending step's inputs at its end. Each hop of the new route rebuilds its KV
cache from those inputs, so the generation goes on exactly as it would have.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from p2pfusion.client.health import PeerHealth
from p2pfusion.client.routing import find_route
from p2pfusion.client.session import InferenceSession
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.errors import PeerFailed, RouteError
from p2pfusion.net.compression import AUTO
from p2pfusion.net.links import LinkBook

log = logging.getLogger(__name__)

FAILOVER_TIMEOUT = 120.0  # how long a session waits for the swarm to cover its layers again
RETRY_DELAY = 0.5
MIN_STEP_TIMEOUT = 10.0
LONG_STEP_TIMEOUT = 120.0


class ResilientSession:
    def __init__(
        self,
        swarm: SwarmNode,
        model: str,
        num_layers: int,
        max_length: int,
        health: PeerHealth,
        links: LinkBook,
        compression: str = AUTO,
        failover_timeout: float = FAILOVER_TIMEOUT,
    ):
        self.swarm = swarm
        self.model = model
        self.num_layers = num_layers
        self.max_length = max_length
        self.health = health
        self.links = links
        self.compression = compression
        self.failover_timeout = failover_timeout
        self.session: InferenceSession | None = None
        self.history: list[torch.Tensor] = []
        self.recoveries = 0
        self._avoid: set[str] = set()  # peers that told this session they are leaving
        self._step_seconds: float | None = None
        self._reports: set[asyncio.Task] = set()

    async def open(self) -> ResilientSession:
        await self._connect(recovering=False)
        return self

    async def _connect(self, recovering: bool) -> None:
        deadline = time.monotonic() + self.failover_timeout
        last: Exception | None = None
        while True:
            try:
                records = await self.swarm.lookup(self.model)
                route = find_route(
                    records, self.num_layers, self.health.observed, self.health.banned() | self._avoid, recovering
                )
                self.session = await InferenceSession(
                    self.swarm.transport, route, self.max_length, self.compression, self.links
                ).open()
                return
            except PeerFailed as exc:
                self._failed(exc)
                last, recovering = exc, True
            except RouteError as exc:
                if not recovering:
                    raise
                if last is None or str(last) != str(exc):
                    log.warning("waiting for the swarm to recover: %s", exc)
                last = exc
            if time.monotonic() > deadline:
                raise RouteError(f"the swarm did not recover within {self.failover_timeout:.0f} s: {last}")
            await asyncio.sleep(RETRY_DELAY)

    def _failed(self, exc: PeerFailed) -> None:
        if exc.peer_id is None:
            log.warning("%s", exc)
            return
        ban = self.health.failed(exc.peer_id)
        log.warning("%s; avoiding that peer for %.0f s", exc, ban)
        task = asyncio.create_task(self.swarm.report_unreachable(self.model, exc.peer_id, str(exc)))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    def _timeout(self, tokens: int) -> float:
        if tokens > 1 or self._step_seconds is None:
            return LONG_STEP_TIMEOUT
        return max(MIN_STEP_TIMEOUT, 20 * self._step_seconds)

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Like InferenceSession.step, but a failed or leaving peer costs a replay, not the generation."""
        while True:
            if self.session is None:
                await self._connect(recovering=True)
            leaving = self.session.poll_notices()
            if leaving:
                log.info("peers %s are leaving; moving this session", sorted(leaving))
                self._avoid |= leaving
                await self._drop()
                continue
            replay = self.session.position == 0 and self.history
            inputs = torch.cat([*self.history, hidden], dim=1) if replay else hidden
            try:
                out = await self.session.step(inputs, self._timeout(inputs.shape[1]))
            except PeerFailed as exc:
                self._failed(exc)
                self.recoveries += 1
                await self._drop()
                continue
            self._observe(inputs.shape[1])
            self.history.append(hidden)
            return out[:, -hidden.shape[1]:] if replay else out

    def _observe(self, tokens: int) -> None:
        """Each hop's own compute time, plus an equal share of what the client saw beyond them (the wire)."""
        session = self.session
        spans = {r.peer_id: r.span for r in session.route}
        overhead = max(session.seconds - sum(s for _, s in session.timings), 0.0) / max(len(session.timings), 1)
        for peer_id, seconds in session.timings:
            if peer_id in spans:
                self.health.observe(peer_id, spans[peer_id], seconds + overhead, tokens)
        if tokens == 1:
            previous = self._step_seconds
            self._step_seconds = session.seconds if previous is None else 0.8 * previous + 0.2 * session.seconds

    async def _drop(self) -> None:
        if self.session is not None:
            await self.session.close()
        self.session = None

    async def close(self) -> None:
        if self.session is not None:
            for record in self.session.route:
                self.health.succeeded(record.peer_id)
        await self._drop()
        if self._reports:
            await asyncio.wait(self._reports, timeout=5)
