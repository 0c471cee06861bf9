"""Finding the peer at fault once two routes' results disagree, and convicting it.

`Blame.localize` replays the session's inputs hop by hop in sessions of one hop: hop k gets the
agreed output of hop k-1, and its output is compared with other peers of the same layers (a
witness, then a third opinion to decide, or else the client's own computation of those layers
from its copy of the weights). The peer found wrong is distrusted and named to the user; peers
found wrong or avoided become suspects, which canaries go through (client/generate/canary.py): a user's
states are never published, and a canary's receipts are evidence others can check. Each
comparison's bar comes from the weight formats of the peers compared (client/checks/policy.py).
"""

from __future__ import annotations

import logging

import torch

from p2pfusion.client.checks.distrust import Distrust
from p2pfusion.client.checks.evidence import inconsistent, judge_hop
from p2pfusion.client.checks.policy import (
    Culprit,
    first_mismatch,
    hop_tolerance,
    judge,
    relative_errors,
    shift_tolerance,
    tolerance,
    witness_chain,
)
from p2pfusion.client.route.failover import LONG_STEP_TIMEOUT, ResilientSession
from p2pfusion.client.route.session import RouteSession
from p2pfusion.dht.records import PeerRecord
from p2pfusion.errors import PeerFailed
from p2pfusion.models.threads import in_fresh_thread
from p2pfusion.net.compression import Codec

log = logging.getLogger(__name__)


class Blame:
    """What a verifier knows of the peers it compares: their records, the peers it caught, and the
    layers it computed itself."""

    def __init__(self, session: ResilientSession, distrust: Distrust, dtype: torch.dtype, batch: int | None = None):
        self.session = session
        self.access = session.access
        self.distrust = distrust
        self.dtype = dtype
        self._batch = batch  # sequences its sessions' steps carry (None: as many as the checked session's)
        self.wire: frozenset[Codec] | None = frozenset()  # the codecs the last localization's sessions used
        self.reach = 0  # positions the last localization replayed: canaries to suspects go as far
        self.caught: list[str] = []
        self._known: dict[str, PeerRecord] = {}

    @property
    def batch(self) -> int:
        return self.session.batch if self._batch is None else self._batch

    async def records(self) -> list[PeerRecord]:
        """The records of the peers that may check a hop of this session."""
        records = await self.access.records(self.session.first)  # with a trusted set, only its peers ever check a hop
        self._known = {r.peer_id: r for r in records}
        return records

    def bar(self, peers: list[PeerRecord], hop: bool = False, codecs: frozenset[Codec] | None = None) -> float:
        """The bar of a comparison between results that `peers` computed (the client's own
        computation is float32): their own signed weight formats set it, never another record of
        the swarm (one stranger's int4 record would otherwise let every liar pass), and the codecs
        the states crossed the wire in, where receipts say (None: any `auto` may pick). A hop's
        outputs compared alone get the tighter bar."""
        formats = {r.weights for r in peers}
        if hop:
            return hop_tolerance(self.access.compression, self.dtype, formats)
        return tolerance(self.access.compression, self.dtype, formats, codecs)

    def shift_bar(self, peers: list[PeerRecord], codecs: frozenset[Codec] | None = None) -> float:
        """The same for the total variation between the next-token distributions the client's
        head reads from their results."""
        return shift_tolerance(self.access.compression, self.dtype, {r.weights for r in peers}, codecs)

    def avoided(self, records: list[PeerRecord]) -> set[str]:
        return self.access.health.banned(records) | self.access.distrusted

    async def open(self, route: list[PeerRecord], length: int) -> RouteSession:
        access = self.access
        session = await RouteSession(
            access.swarm.transport, route, length, access.compression, access.links, batch=self.batch
        ).open()
        params = None if self.session.params is None else self.session.params.layers(route[0].start, route[-1].end)
        if params is not None:
            await session.set_params(params)
        return session

    def ban(self, peers: set[str]) -> None:
        """Avoid peers for a while without accusing them (the evidence names none of them alone),
        and send canaries through them."""
        for peer in peers - set(self.caught):
            self.access.health.failed(peer, self._known[peer].since if peer in self._known else 0.0)
        self.distrust.suspect(peers - set(self.caught), self.reach)

    async def localize(
        self, route: list[PeerRecord], hidden: torch.Tensor, positions: torch.Tensor | None, mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, set[str], list[PeerRecord]]:
        """Replay the session's inputs `hidden` (positions [0, end)) through `route` hop by hop;
        the agreed final output (None: a hop had no answer at all), the peers caught lying, and the
        peers whose outputs the agreed one came through."""
        end = hidden.shape[1]
        records = await self.records()
        self.wire, self.reach = frozenset(), end
        caught: set[str] = set()
        sources: list[PeerRecord] = []
        for hop in route:
            claimed = await self.opinion([hop], hop, hidden, positions, mask, end)
            avoid = self.avoided(records) | {hop.peer_id}
            witness = witness_chain(records, hop.start, hop.end, avoid, self.access.health.observed, end)
            seen = await self.opinion(witness, hop, hidden, positions, mask, end)
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
            third = None if witness is None else await self.opinion(third_chain, hop, hidden, positions, mask, end)
            verdict = Culprit.PRIMARY if witness is None else judge(
                False, None if third is None else self._agree(claimed, third, mask, [hop, *(third_chain or [])]),
                None if third is None else self._agree(seen, third, mask, [*witness, *(third_chain or [])]),
            )
            others = witnesses | {r.peer_id for r in third_chain or []}
            if verdict == Culprit.PRIMARY:
                self._convict(hop, hidden, claimed, seen, mask, others)
                caught.add(hop.peer_id)
                hidden = seen
                sources += witness or []
            elif verdict == Culprit.WITNESS and len(witness) == 1:
                self._convict(witness[0], hidden, seen, claimed, mask, {hop.peer_id} | (others - witnesses))
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

    async def opinion(
        self, chain: list[PeerRecord] | None, hop: PeerRecord, hidden: torch.Tensor, positions, mask, end: int
    ) -> torch.Tensor | None:
        """What `chain` computes for `hop`'s layers from `hidden` (None: the client's own
        computation, when it may hold those layers); None when no one could answer."""
        if chain is None:
            return self._compute_locally(hop, hidden, positions, mask)
        try:
            session = await self.open(chain, end)
            try:
                out = await session.step(hidden, LONG_STEP_TIMEOUT, mask, positions)
                used = session.signed.codecs(0, end)
                self.wire = None if used is None or self.wire is None else self.wire | used
                return out
            finally:
                await session.close()
        except PeerFailed as exc:
            self.session.failed(exc)
            return None

    async def judge_receipts(
        self, session: RouteSession, hidden: torch.Tensor, positions: torch.Tensor | None, mask: torch.Tensor | None,
    ) -> set[str]:
        """The hops of `session` that its receipts convict, against the client's own computation
        from the session's inputs `hidden` (positions [0, end)); those caught, as by a replay.
        Nothing is published: the states are the user's. Hops whose receipts are missing, do
        not hold or contradict their neighbour's are banned. Nothing is judged where the client
        cannot compute the layers, or where its computation would not be the peers' (an
        adapter's hooks, several sequences in a step)."""
        route, signed = session.route, session.signed
        if self.session.params is not None or hidden.shape[0] != 1:
            return set()
        boundaries = sorted({r.start for r in route} | {r.end for r in route})
        states = await in_fresh_thread(self.distrust.recomputer.through, hidden, route[0].start, boundaries, positions, mask)
        if states is None:
            return set()
        caught, banned = set(), inconsistent(route, signed.receipts, signed.session_id)
        for i, hop in enumerate(route):
            mine = sorted((r for r in signed.receipts if r.peer_id == hop.peer_id and r.session == signed.session_id),
                          key=lambda r: r.step)
            verdict = judge_hop(hop, mine, signed.certs.get(hop.peer_id), states[hop.start], states[hop.end])
            if not verdict.signed:
                banned |= {r.peer_id for r in route[i:]}
            elif verdict.avoid:
                banned.add(hop.peer_id)
            elif verdict.judgement is not None and hop.peer_id not in caught:
                caught.add(hop.peer_id)
                self._catch(hop.peer_id)
                log.warning(
                    "peer %s signed a wrong result for layers %d:%d at position %d of this session (relative error %.2g, "
                    "bar %.2g); no longer using it", hop.peer_id, hop.start, hop.end, verdict.receipt.offset,
                    verdict.judgement.output_error, verdict.judgement.bar,
                )
        if banned - caught:
            log.warning("peers %s sent receipts that do not hold for this session; avoiding them for a while",
                        ", ".join(sorted(banned - caught)))
            self.ban(banned - caught)
        return caught

    def _compute_locally(self, hop: PeerRecord, hidden: torch.Tensor, positions, mask) -> torch.Tensor | None:
        if self.session.params is not None:
            return None  # the adapter's hooks are the peers' to apply
        return self.distrust.recomputer.forward(hop.start, hop.end, hidden, positions, mask)

    def _convict(
        self, peer: PeerRecord, hidden: torch.Tensor, wrong: torch.Tensor, right: torch.Tensor,
        mask: torch.Tensor | None, witnesses: set[str],
    ) -> None:
        """Distrust a peer caught computing wrong and tell the user; canaries go through it next."""
        error = float(relative_errors(wrong, right, mask).max())
        self._catch(peer.peer_id)
        named = ", ".join(sorted(witnesses)) or "this client's own computation"
        log.warning(
            "peer %s returned wrong results for layers %d:%d (relative error %.2g against %s); no longer using it",
            peer.peer_id, peer.start, peer.end, error, named,
        )

    def _catch(self, peer_id: str) -> None:
        """Distrust a peer this client saw computing wrong; canaries go through it next."""
        self.distrust.catch(peer_id, self.reach)
        self.caught.append(peer_id)
