"""Checking a sample of training forward passes (fine-tuning, `train_step`).

A training step's forward runs through a training session, whose peers keep its inputs for the
backward pass; its output goes into the user's loss and gradients. With the client's verification
rate, a forward is checked before the backward goes on: its chunks go through a second route
(`alternative_route`, with the session's parameters) as one inference prefill each, and the
outputs are compared with the bar of the two routes' formats. On a mismatch, `Blame` replays the
chunk hop by hop: a peer caught is distrusted; where no replay repeats the error, the route's
peers are avoided for a while and become suspects (canaries go through them). Either way the
caller computes the step's forward again, on a route without them, so the backward runs on
honest outputs. The backward passes themselves are not checked.
"""

from __future__ import annotations

import logging
import random

import torch

from p2pfusion.client.checks.blame import Blame
from p2pfusion.client.checks.distrust import Distrust
from p2pfusion.client.checks.policy import alternative_route, first_mismatch, relative_errors
from p2pfusion.client.route.failover import ResilientSession
from p2pfusion.client.route.pieces import Chunk

log = logging.getLogger(__name__)


class ForwardCheck:
    def __init__(self, distrust: Distrust, rate: float, dtype: torch.dtype, seed: int | None = None):
        self.distrust = distrust
        self.rate = rate
        self.dtype = dtype
        self._rng = random.Random(seed)

    async def holds(self, connection: ResilientSession, chunks: list[Chunk], outputs: list[torch.Tensor]) -> bool:
        """Whether the outputs `connection`'s route gave for `chunks` stand: True unless this
        forward was drawn for a check and it found them wrong."""
        if self._rng.random() >= self.rate:
            return True
        route = list(connection.session.route)
        primary = {r.peer_id for r in route}
        blame = Blame(connection, self.distrust, self.dtype, batch=max(c.hidden.shape[0] for c in chunks))
        records = await blame.records()
        checker = alternative_route(
            records, connection.access.num_layers, primary, blame.avoided(records), connection.access.health.observed,
            connection.length, connection.first,
        )
        if checker is None or {r.peer_id for r in checker} <= primary:
            return True  # no other peer serves these layers (the verifier warns of it in generations)
        for chunk, out in zip(chunks, outputs):
            end = chunk.hidden.shape[1]
            other = await blame.opinion(checker, route[0], chunk.hidden, chunk.positions, chunk.mask, end)
            if other is None or first_mismatch(relative_errors(out, other, chunk.mask), blame.bar([*route, *checker])) is None:
                continue
            log.info("a fine-tuning forward differs between two routes; checking hop by hop")
            agreed, caught, sources = await blame.localize(route, chunk.hidden, chunk.positions, chunk.mask)
            if caught & primary:
                return False
            if agreed is not None and first_mismatch(
                relative_errors(out, agreed, chunk.mask), blame.bar([*route, *sources])
            ) is None:
                blame.ban({r.peer_id for r in checker} - primary)  # the checking route erred
                continue
            log.warning("a fine-tuning forward was wrong, but no peer repeated the error; avoiding peers %s for a while",
                        ", ".join(sorted(primary)))
            blame.ban(primary)
            return False
        return True
