"""Finding the peer at fault once two routes' results disagree, and convicting it.

`Blame.localize` replays the session's inputs hop by hop in sessions of one hop: hop k gets the
agreed output of hop k-1, and its output is compared with other peers of the same layers (a
witness, then a third opinion to decide, or else the client's own computation of those layers
from its copy of the weights). The peer found wrong is distrusted, reported in the DHT with the
evidence, and named to the user. Each comparison's bar comes from the weight formats of the
peers compared (client/checks/policy.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import torch

from p2pfusion.client.checks.distrust import REPORT_TIMEOUT, Distrust
from p2pfusion.client.checks.policy import (
    Culprit, digest, first_mismatch, hop_tolerance, judge, relative_errors, tolerance, witness_chain,
)
from p2pfusion.client.route.failover import LONG_STEP_TIMEOUT, ResilientSession
from p2pfusion.client.route.session import RouteSession
from p2pfusion.dht.records import MAX_WITNESSES, FaultReport, PeerRecord
from p2pfusion.errors import PeerFailed
from p2pfusion.models.source import ModelSource
from p2pfusion.models.stage import Stage, load_stage

log = logging.getLogger(__name__)

LOCAL_BYTES = 2 << 30  # the most weight bytes the client loads to compute a disputed hop itself


class Blame:
    """What a verifier knows of the peers it compares: their records, the peers it caught, and the
    layers it computed itself."""

    def __init__(self, session: ResilientSession, distrust: Distrust, source: ModelSource, dtype: torch.dtype):
        self.session = session
        self.access = session.access
        self.distrust = distrust
        self.source = source
        self.dtype = dtype
        self.caught: list[str] = []
        self._known: dict[str, PeerRecord] = {}
        self._local: dict[tuple[int, int], Stage] = {}

    async def records(self) -> list[PeerRecord]:
        """The records of the peers that may check a hop of this session."""
        records = await self.access.records(self.session.first)  # with a trusted set, only its peers ever check a hop
        self._known = {r.peer_id: r for r in records}
        return records

    def bar(self, peers: list[PeerRecord], hop: bool = False) -> float:
        """The bar of a comparison between results that `peers` computed (the client's own
        computation is float32): their own signed weight formats set it, never another record of
        the swarm (one stranger's int4 record would otherwise let every liar pass). A hop's
        outputs compared alone get the tighter bar."""
        formats = {r.weights for r in peers}
        return (hop_tolerance if hop else tolerance)(self.access.compression, self.dtype, formats)

    def avoided(self, records: list[PeerRecord]) -> set[str]:
        return self.access.health.banned(records) | self.access.distrusted

    async def open(self, route: list[PeerRecord], length: int) -> RouteSession:
        access = self.access
        session = await RouteSession(
            access.swarm.transport, route, length, access.compression, access.links, batch=self.session.batch
        ).open()
        params = None if self.session.params is None else self.session.params.layers(route[0].start, route[-1].end)
        if params is not None:
            await session.set_params(params)
        return session

    def ban(self, peers: set[str]) -> None:
        """Avoid peers for a while without accusing them (the evidence names none of them alone)."""
        for peer in peers - set(self.caught):
            self.access.health.failed(peer, self._known[peer].since if peer in self._known else 0.0)

    async def localize(
        self, route: list[PeerRecord], hidden: torch.Tensor, positions: torch.Tensor | None, mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, set[str], list[PeerRecord]]:
        """Replay the session's inputs `hidden` (positions [0, end)) through `route` hop by hop;
        the agreed final output (None: a hop had no answer at all), the peers caught lying, and the
        peers whose outputs the agreed one came through."""
        end = hidden.shape[1]
        records = await self.records()
        caught: set[str] = set()
        sources: list[PeerRecord] = []
        for hop in route:
            claimed = await self._opinion([hop], hop, hidden, positions, mask, end)
            avoid = self.avoided(records) | {hop.peer_id}
            witness = witness_chain(records, hop.start, hop.end, avoid, self.access.health.observed, end)
            seen = await self._opinion(witness, hop, hidden, positions, mask, end)
            if claimed is None or seen is None:  # no second opinion, or the hop refused to answer
                hidden = claimed if claimed is not None else seen
                if hidden is None:
                    return None, caught, sources
                sources += [hop] if claimed is not None else witness or []
                continue
            if self._agree(claimed, seen, mask, [hop, *(witness or [])]):
                hidden = claimed
                sources.append(hop)
                continue
            witnesses = {r.peer_id for r in witness or []}
            third_chain = witness_chain(records, hop.start, hop.end, avoid | witnesses, self.access.health.observed, end)
            third = None if witness is None else await self._opinion(third_chain, hop, hidden, positions, mask, end)
            verdict = Culprit.PRIMARY if witness is None else judge(
                False, None if third is None else self._agree(claimed, third, mask, [hop, *(third_chain or [])]),
                None if third is None else self._agree(seen, third, mask, [*witness, *(third_chain or [])]),
            )
            others = witnesses | {r.peer_id for r in third_chain or []}
            if verdict == Culprit.PRIMARY:
                await self._convict(hop, hidden, claimed, seen, mask, others)
                caught.add(hop.peer_id)
                hidden = seen
                sources += witness or []
            elif verdict == Culprit.WITNESS and len(witness) == 1:
                await self._convict(witness[0], hidden, seen, claimed, mask, {hop.peer_id} | (others - witnesses))
                caught.add(witness[0].peer_id)
                hidden = claimed
            elif verdict == Culprit.WITNESS:  # one of the witness's chain: not one peer to accuse
                self.ban(witnesses)
                hidden = claimed
            else:
                log.warning(
                    "peer %s and peers %s disagree on layers %d:%d and nothing decides between them; avoiding both for a while",
                    hop.peer_id, ", ".join(sorted(witnesses)), hop.start, hop.end,
                )
                self.ban({hop.peer_id} | witnesses)
                hidden = claimed
            if hidden is claimed:
                sources.append(hop)
        return hidden, caught, sources

    def _agree(self, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None, peers: list[PeerRecord]) -> bool:
        return first_mismatch(relative_errors(a, b, mask), self.bar(peers, hop=True)) is None

    async def _opinion(
        self, chain: list[PeerRecord] | None, hop: PeerRecord, hidden: torch.Tensor, positions, mask, end: int
    ) -> torch.Tensor | None:
        """What `chain` computes for `hop`'s layers from `hidden` (None: the client's own
        computation, when it may hold those layers); None when no one could answer."""
        if chain is None:
            return self._compute_locally(hop, hidden, positions, mask)
        try:
            session = await self.open(chain, end)
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
