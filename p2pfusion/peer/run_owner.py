"""Whom a training replica obeys: the driver of its run's charter (dht/records.py, `RunCharter`),
and the replicas the charter lists.

A stream's peer id is proven (libp2p's own, or a direct hello's proof: net/transport.py), so a
request is judged by who sent it. `refusal` (pure) says why a request may not be served; the
`Charters` book keeps the run's charter, read from the DHT: the one of the driver the replica was
told (`run-peer --run-driver`), else the oldest, which is then the only one it follows. It reads
again, at most every REREAD_SECONDS per asker, when someone it does not know asks: a replica the driver has
just admitted, or a driver that has just started.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter

from p2pfusion.dht.records import PeerRecord, RunCharter
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.net import run_messages as t

log = logging.getLogger(__name__)

REREAD_SECONDS = 1.0
MAX_ASKED = 1024
LR_SLACK = 1e-9  # relative: a learning rate the driver computed may round past the bound it wrote
STEERING = (t.ApplyStep, t.DiscardStep, t.OuterStep)


def agreed(answers: list[tuple[t.StateEnd, PeerRecord]], least_round: int = 0) -> list[tuple[t.StateEnd, PeerRecord]]:
    """The replicas to copy a stage's state from, in the order to try them: those holding the
    state (outer step and digest of its weights) that most replicas at `least_round` or later hold,
    the later state first among equals. A replica cannot get its weights copied by claiming to be
    ahead: the others outvote it."""
    answers = [a for a in answers if a[0].round >= least_round]
    held = Counter((where.round, where.digest) for where, _ in answers)
    return sorted(answers, key=lambda a: (-held[a[0].round, a[0].digest], -a[0].round, -a[0].step, a[1].peer_id))


def refusal(request: object, charter: RunCharter | None, who: str | None, me: str, joining: bool = False) -> str | None:
    """Why replica `me` may not serve `request` from peer `who` (None: unproven) under `charter`, or
    None when it may. `request` is a run message, or "session" for a training session's Open;
    `joining`: `who` announces a record of the run (a replica that joins an open run)."""
    if isinstance(request, t.Status):
        return None  # where a replica is: no secret, and it changes nothing
    if charter is None and isinstance(request, t.FetchState):
        return None  # no driver has started the run: its state is the model's own weights
    if charter is None:
        return "the run has no charter yet: its driver writes one when it starts"
    if who is None:
        return "the sender proved no peer id"
    driver = who == charter.driver
    if isinstance(request, STEERING) and not driver:
        return f"only the run's driver {charter.driver} steers its replicas"
    if isinstance(request, t.ApplyStep) and request.lr > charter.max_lr * (1 + LR_SLACK):
        return f"learning rate {request.lr:g} is over the run's bound {charter.max_lr:g}"
    if isinstance(request, t.OuterStep):
        if request.lr > charter.max_outer_lr * (1 + LR_SLACK):
            return f"outer learning rate {request.lr:g} is over the run's bound {charter.max_outer_lr:g}"
        strangers = sorted(set(request.group) - set(charter.replicas) - {me})
        if strangers:
            return f"the averaging group names peers the run does not list: {', '.join(strangers[:3])}"
    listed = who in charter.replicas
    if isinstance(request, t.FetchState) and not (driver or listed or (charter.open and joining)):
        return "the run's state is for its driver and its replicas"
    if request == "session" and not (driver or listed):
        return "training sessions come from the run's driver (or a replica relaying them)"
    return None


class Charters:
    """The charter of one run, as this replica follows it."""

    def __init__(self, swarm: SwarmNode, model: str, run: str, driver: str | None = None):
        self.swarm, self.model, self.run = swarm, model, run
        self.driver = driver  # the driver this replica was told to follow; None: the run's oldest charter's
        self.charter: RunCharter | None = None
        self._asked: dict[str | None, float] = {}  # a peer it did not know -> when that made it read

    def knows(self, who: str | None) -> bool:
        charter = self.charter
        return charter is not None and (who == charter.driver or who in charter.replicas)

    async def current(self, who: str | None = None) -> RunCharter | None:
        """The charter, read again first when `who` is someone it does not name (at most every
        REREAD_SECONDS for each such peer)."""
        now = time.monotonic()
        if not self.knows(who) and now - self._asked.get(who, -math.inf) >= REREAD_SECONDS:
            if len(self._asked) >= MAX_ASKED:
                self._asked = {p: t for p, t in self._asked.items() if now - t < REREAD_SECONDS}
            self._asked[who] = now
            await self._read()
        return self.charter

    async def _read(self) -> None:
        found = [c for c in await self.swarm.charters(self.model, self.run) if self.driver in (None, c.driver)]
        if found:  # oldest first: with no driver named, the run is its first creator's, for good
            if self.driver is None:
                self.driver = found[0].driver
                log.info("training run %s is driven by %s", self.run, self.driver)
            self.charter = found[0]
