"""Checking a session's results against other peers, and catching the peer that computed wrong.

A `Verifier` wraps one ResilientSession. It keeps the final hidden states the route returned for
every position. A check sends the positions since the last check through a second route that
avoids the session's peers where the swarm allows (its *shadow* session, kept open between checks,
so a check costs those positions only) and compares (client/checks/policy.py). On a mismatch it replays
the inputs hop by hop in sessions of one hop: hop k gets the agreed output of hop k-1, and its
output is compared with other peers of the same layers (a witness, then a third opinion to decide,
or else the client's own computation of those layers from its copy of the weights). The peer
found wrong is distrusted, reported in the DHT with the evidence, and the caller rewinds to the
first wrong position. `Distrust` (client/checks/distrust.py) keeps the peers not routed through.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time

import torch

from p2pfusion.client.checks.distrust import REPORT_TIMEOUT, Distrust
from p2pfusion.client.checks.policy import (
    Culprit,
    alternative_route,
    digest,
    first_mismatch,
    hop_tolerance,
    judge,
    relative_errors,
    tolerance,
    unchecked_layers,
    witness_chain,
)
from p2pfusion.client.route.failover import LONG_STEP_TIMEOUT, ResilientSession, cut, joined
from p2pfusion.client.route.session import RouteSession
from p2pfusion.dht.records import MAX_WITNESSES, FaultReport, PeerRecord
from p2pfusion.errors import PeerFailed, RouteError
from p2pfusion.models.source import ModelSource
from p2pfusion.models.stage import Stage, load_stage

log = logging.getLogger(__name__)

ATTEMPTS = 3  # checking routes tried before a check gives up
QUIET_SECONDS = 30.0  # a swarm with no second route is looked at again after this long
LOCAL_BYTES = 2 << 30  # the most weight bytes the client loads to compute a disputed hop itself


class Verifier:
    def __init__(
        self, session: ResilientSession, distrust: Distrust, source: ModelSource, rate: float, dtype: torch.dtype,
        seed: int | None = None,
    ):
        self.session = session
        self.access = session.access
        self.distrust = distrust
        self.source = source
        self.rate = rate
        self.dtype = dtype
        self.bar = tolerance(self.access.compression, dtype)
        self.hop_bar = hop_tolerance(self.access.compression, dtype)
        self.outputs: list[torch.Tensor] = []  # the route's output per step, beside session.history
        self.routes: list[tuple[PeerRecord, ...]] = []  # the route that computed each step
        self.mask: torch.Tensor | None = None  # the last step's, covering the whole sequence
        self.checked = 0  # positions whose outputs another route confirmed
        self.caught: list[str] = []
        self._shadow: RouteSession | None = None
        self._shadow_reused: set[str] = set()
        self._shadow_length = 0
        self._quiet_until = 0.0
        self._known: dict[str, PeerRecord] = {}
        self._warned: set[tuple[int, int]] = set()
        self._local: dict[tuple[int, int], Stage] = {}
        self._rng = random.Random(seed)
        if self.bar == math.inf:
            log.warning("top-k compression loses too much to check peers' results: verification is off")

    async def step(
        self, hidden: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = await self.session.step(hidden, mask, positions)
        self.outputs.append(out)
        self.routes.append(tuple(self.session.session.route))
        self.mask = mask
        return out

    async def maybe_check(self) -> int | None:
        """Check at random, with the verifier's rate, and at the first call (which learns whether
        anything can check this session); see `check`."""
        if self.checked == 0 or self._rng.random() < self.rate or time.monotonic() < self._quiet_until:
            return await self.check()
        return None

    async def check(self) -> int | None:
        """Compare the outputs since the last check with another route's. Returns None when they
        agree (or nothing can check them), else the first wrong position, to rewind to."""
        for _ in range(ATTEMPTS):
            start, end = self.checked, self.session.position
            if start >= end or self.bar == math.inf or time.monotonic() < self._quiet_until:
                self.checked = end
                return None
            try:
                other = await self._shadow_outputs(start, end)
                if other is None:
                    self.checked = end
                    return None
                claimed = torch.cat(self.outputs, dim=1)[:, start:end]
                errors = relative_errors(claimed, other, self._window_mask(start, end))
                bad = first_mismatch(errors, self.bar)
                if bad is None:
                    self.checked = end
                    return None
                rewind = await self._mismatch(start + bad, end, float(errors.max()))
            except PeerFailed as exc:
                self.session.failed(exc)
                await self._drop_shadow()
                continue
            except RouteError as exc:  # the swarm's records could not be read: no check this time
                log.warning("could not check the results of positions %d:%d: %s", start, end, exc)
                self.checked = end
                return None
            if rewind is not None:
                return rewind
        log.warning("could not check the results of positions %d:%d: the checking routes failed", start, end)
        self.checked = end
        return None

    async def rewind(self, length: int) -> None:
        """Forget the outputs past `length` positions, with the session's inputs."""
        await self.session.rewind(length)
        self.outputs = cut(self.outputs, length)
        self.routes = self.routes[:len(self.outputs)]
        self.checked = min(self.checked, length)
        await self._drop_shadow()

    async def close(self) -> None:
        await self._drop_shadow()

    # the checking route

    async def _records(self) -> list[PeerRecord]:
        records = await self.access.records(self.session.first)  # with a trusted set, only its peers ever check a hop
        self._known = {r.peer_id: r for r in records}
        formats = {r.weights for r in records}  # the routes compared may take any of them
        self.bar = tolerance(self.access.compression, self.dtype, formats)
        self.hop_bar = hop_tolerance(self.access.compression, self.dtype, formats)
        return records

    def _avoided(self, records: list[PeerRecord]) -> set[str]:
        return self.access.health.banned(records) | self.access.distrusted

    def _peers_of(self, start: int, end: int) -> set[str]:
        """The peers that computed positions [start, end)."""
        peers, position = set(), 0
        for out, route in zip(self.outputs, self.routes):
            if position < end and position + out.shape[1] > start:
                peers.update(r.peer_id for r in route)
            position += out.shape[1]
        return peers

    def _route_at(self, position: int) -> tuple[PeerRecord, ...]:
        at = 0
        for out, route in zip(self.outputs, self.routes):
            at += out.shape[1]
            if position < at:
                return route
        return self.routes[-1]

    async def _shadow_outputs(self, start: int, end: int) -> torch.Tensor | None:
        primary = self._peers_of(start, end)
        if self._shadow is not None and {r.peer_id for r in self._shadow.route} & primary - self._shadow_reused:
            await self._drop_shadow()  # the session moved onto the shadow's peers
        if self._shadow is None:
            records = await self._records()
            await self.distrust.refresh()
            observed = self.access.health.observed
            route = alternative_route(
                records, self.access.num_layers, primary, self._avoided(records), observed, self.session.length,
                self.session.first,
            )
            reused = set() if route is None else {r.peer_id for r in route} & primary
            self._warn_unchecked([] if route is None else unchecked_layers(route, primary))
            if route is None or len(reused) == len(route):
                self._quiet_until = time.monotonic() + QUIET_SECONDS
                return None
            self._shadow = await self._open(route, self.session.length)
            self._shadow_reused, self._shadow_length = reused, 0
        inputs, positions = self._inputs(self._shadow_length, end)
        mask = None if self.mask is None else self.mask[:, :end]
        out = await self._shadow.step(inputs, LONG_STEP_TIMEOUT, mask, positions)
        done, self._shadow_length = self._shadow_length, end
        return out[:, start - done:]

    def _warn_unchecked(self, ranges: list[tuple[int, int]]) -> None:
        new = [r for r in ranges if r not in self._warned]
        if new:
            self._warned.update(new)
            named = ", ".join(f"{a}:{b}" for a, b in new)
            log.warning("layers %s cannot be verified: no other peer serves them", named)

    async def _drop_shadow(self) -> None:
        shadow, self._shadow, self._shadow_length = self._shadow, None, 0
        if shadow is not None:
            await shadow.close()

    async def _open(self, route: list[PeerRecord], length: int) -> RouteSession:
        access = self.access
        session = await RouteSession(access.swarm.transport, route, length, access.compression, access.links).open()
        params = None if self.session.params is None else self.session.params.layers(route[0].start, route[-1].end)
        if params is not None:
            await session.set_params(params)
        return session

    def _inputs(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The session's inputs (embeddings, position ids or None) for positions [start, end)."""
        hidden, ids = joined(self.session.history)
        return hidden[:, start:end], None if ids is None else ids[:, start:end]

    def _window_mask(self, start: int, end: int) -> torch.Tensor | None:
        return None if self.mask is None else self.mask[:, start:end]

    def _ban(self, peers: set[str]) -> None:
        """Avoid peers for a while without accusing them (the evidence names none of them alone)."""
        for peer in peers - set(self.caught):
            self.access.health.failed(peer, self._known[peer].since if peer in self._known else 0.0)

    # finding the peer at fault

    async def _mismatch(self, position: int, end: int, error: float) -> int | None:
        """The route's output at `position` differs from the checking route's: find out who is wrong.
        Returns the position to rewind to, or None when the checking route was the wrong one."""
        checker = set() if self._shadow is None else {r.peer_id for r in self._shadow.route}
        await self._drop_shadow()
        route = self._route_at(position)
        log.info("results at position %d differ between two routes (relative error %.2g); checking hop by hop", position, error)
        agreed, caught = await self._localize(list(route), end)
        if caught & {r.peer_id for r in route}:
            return position
        claimed = torch.cat(self.outputs, dim=1)[:, position:end]
        mask = self._window_mask(position, end)
        if agreed is not None and first_mismatch(relative_errors(claimed, agreed[:, position:end], mask), self.bar) is None:
            self._ban(checker - {r.peer_id for r in route})  # the checking route erred, and not on replay
            return None
        suspects = {r.peer_id for r in route} - self._shadow_reused
        log.warning(
            "the results at position %d were wrong, but no peer repeated the error; avoiding peers %s for a while",
            position, ", ".join(sorted(suspects)),
        )
        self._ban(suspects)
        return position

    async def _localize(self, route: list[PeerRecord], end: int) -> tuple[torch.Tensor | None, set[str]]:
        """Replay positions [0, end) hop by hop; the agreed final output (None: a hop had no answer
        at all) and the peers caught lying."""
        records = await self._records()
        hidden, positions = self._inputs(0, end)
        mask = None if self.mask is None else self.mask[:, :end]
        caught: set[str] = set()
        for hop in route:
            claimed = await self._opinion([hop], hop, hidden, positions, mask, end)
            avoid = self._avoided(records) | {hop.peer_id}
            witness = witness_chain(records, hop.start, hop.end, avoid, self.access.health.observed, end)
            seen = await self._opinion(witness, hop, hidden, positions, mask, end)
            if claimed is None or seen is None:  # no second opinion, or the hop refused to answer
                hidden = claimed if claimed is not None else seen
                if hidden is None:
                    return None, caught
                continue
            if self._agree(claimed, seen, mask):
                hidden = claimed
                continue
            witnesses = {r.peer_id for r in witness or []}
            third_chain = witness_chain(records, hop.start, hop.end, avoid | witnesses, self.access.health.observed, end)
            third = None if witness is None else await self._opinion(third_chain, hop, hidden, positions, mask, end)
            verdict = Culprit.PRIMARY if witness is None else judge(
                False, None if third is None else self._agree(claimed, third, mask),
                None if third is None else self._agree(seen, third, mask),
            )
            others = witnesses | {r.peer_id for r in third_chain or []}
            if verdict == Culprit.PRIMARY:
                await self._convict(hop, hidden, claimed, seen, mask, others)
                caught.add(hop.peer_id)
                hidden = seen
            elif verdict == Culprit.WITNESS and len(witness) == 1:
                await self._convict(witness[0], hidden, seen, claimed, mask, {hop.peer_id} | (others - witnesses))
                caught.add(witness[0].peer_id)
                hidden = claimed
            elif verdict == Culprit.WITNESS:  # one of the witness's chain: not one peer to accuse
                self._ban(witnesses)
                hidden = claimed
            else:
                log.warning(
                    "peer %s and peers %s disagree on layers %d:%d and nothing decides between them; avoiding both for a while",
                    hop.peer_id, ", ".join(sorted(witnesses)), hop.start, hop.end,
                )
                self._ban({hop.peer_id} | witnesses)
                hidden = claimed
        return hidden, caught

    def _agree(self, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None) -> bool:
        return first_mismatch(relative_errors(a, b, mask), self.hop_bar) is None

    async def _opinion(
        self, chain: list[PeerRecord] | None, hop: PeerRecord, hidden: torch.Tensor, positions, mask, end: int
    ) -> torch.Tensor | None:
        """What `chain` computes for `hop`'s layers from `hidden` (None: the client's own
        computation, when it may hold those layers); None when no one could answer."""
        if chain is None:
            return self._compute_locally(hop, hidden, positions, mask)
        try:
            session = await self._open(chain, end)
            try:
                return await session.step(hidden, LONG_STEP_TIMEOUT, mask, positions)
            finally:
                await session.close()
        except PeerFailed as exc:
            self.session.failed(exc)
            return None

    def _compute_locally(self, hop: PeerRecord, hidden: torch.Tensor, positions, mask) -> torch.Tensor | None:
        if self.session.params is not None:
            return None  # the adapter's hooks are the peers' to apply
        span = (hop.start, hop.end)
        if span not in self._local:
            weights = sum(f.stat().st_size for f in self.source.folder.glob("*.safetensors"))
            if weights * (hop.end - hop.start) / self.access.num_layers > LOCAL_BYTES:
                return None
            log.info("computing layers %d:%d here to check peers' results", *span)
            self._local[span] = load_stage(self.source, hop.start, hop.end)
        out = self._local[span].forward(hidden.float(), 0, None, mask, positions)
        return out.to(hidden.dtype)

    async def _convict(
        self, peer: PeerRecord, hidden: torch.Tensor, wrong: torch.Tensor, right: torch.Tensor,
        mask: torch.Tensor | None, witnesses: set[str],
    ) -> None:
        """Distrust a peer caught computing wrong, tell the user, and report it with the evidence."""
        error = float(relative_errors(wrong, right, mask).max())
        error = error if math.isfinite(error) else 1e30
        self.distrust.catch(peer.peer_id)
        self.caught.append(peer.peer_id)
        named = ", ".join(sorted(witnesses)) or "this client's own computation"
        log.warning(
            "peer %s returned wrong results for layers %d:%d (relative error %.2g against %s); no longer using it",
            peer.peer_id, peer.start, peer.end, error, named,
        )
        report = FaultReport(
            peer_id=peer.peer_id, start=peer.start, end=peer.end, error=error, input_digest=digest(hidden),
            output_digest=digest(wrong), witnesses=tuple(sorted(witnesses - {peer.peer_id}))[:MAX_WITNESSES],
            time=time.time(),
        )
        try:
            await asyncio.wait_for(self.access.swarm.report_faulty(self.access.model, report), REPORT_TIMEOUT)
        except (TimeoutError, OSError, ValueError) as exc:
            log.warning("could not report peer %s: %r", peer.peer_id, exc)
