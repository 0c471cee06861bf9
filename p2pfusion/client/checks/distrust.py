"""Which peers a client stops routing through, beyond those its own checks caught: the peers that a
fault report in the DHT convicts, by this client's own judgement of the report's evidence
(client/checks/evidence.py), read again every REFRESH_SECONDS from the key of each peer the
model's records list (dht/records.py, `fault_key`). Reports are evidence, not votes:
one that holds convicts however few wrote it; one that does not convicts nobody and discredits
its signer (its reports not judged yet are no longer judged). And the peers it suspects: those whose results it saw
wrong without evidence to show, which canaries (client/generate/canary.py) go through."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time

import msgpack

from p2pfusion.client.checks.evidence import judge_report
from p2pfusion.client.checks.local import Recomputer
from p2pfusion.client.route.access import SwarmAccess
from p2pfusion.dht.records import FaultReport, PeerRecord, PeerState
from p2pfusion.models.threads import in_fresh_thread
from p2pfusion.net.wire import encode

log = logging.getLogger(__name__)

REFRESH_SECONDS = 30.0  # how often other clients' fault reports are read again
REPORT_TIMEOUT = 10.0
JUDGED_PER_READ = 4  # new reports judged per read: each costs a canary's computation here
MAX_SUSPECTS = 64
MAX_ACCUSED_READ = 64  # peers whose fault reports one read fetches (a key each)


def evidence_key(report: FaultReport) -> bytes:
    """What a verdict is remembered by: all of the evidence (a copy with one field changed is
    another evidence, judged on its own)."""
    return hashlib.sha256(msgpack.packb(encode(report.evidence), use_bin_type=True)).digest()


class Distrust:
    """The fault reports side of a client's distrust; `access` keeps the set routes avoid."""

    def __init__(self, access: SwarmAccess, recomputer: Recomputer):
        self.access = access
        self.recomputer = recomputer
        self.suspects: dict[str, tuple[int, int]] = {}  # peer id -> (canaries still owed to it, positions they reach)
        self.discredited: set[str] = set()  # signers of reports that did not hold
        self.proven: set[str] = set()  # peers this client's own canaries convicted: no more canaries owed
        self._verdicts: dict[bytes, bool] = {}  # a report's evidence, by digest -> whether it convicts
        self._read_at = -math.inf
        self.read_once = False  # a read of the reports has ended, its verdicts applied (or it failed)

    async def refresh(self) -> None:
        if time.monotonic() - self._read_at < REFRESH_SECONDS:
            return
        self._read_at = time.monotonic()
        swarm, model = self.access.swarm, self.access.model
        try:
            records = await asyncio.wait_for(swarm.lookup(model), REPORT_TIMEOUT)
            reports = await asyncio.wait_for(swarm.fault_reports(model, self._accused(records)), REPORT_TIMEOUT)
        except (TimeoutError, OSError) as exc:
            log.debug("cannot read fault reports: %r", exc)
            self.read_once = True
            return
        await self.judge(reports)
        self.read_once = True

    def _accused(self, records: list[PeerRecord]) -> list[str]:
        """The peers whose reports are read: those listed, the ones this client routes through first."""
        listed = {r.peer_id for r in records if r.state in (PeerState.ONLINE, PeerState.BACKUP)}
        return sorted(listed, key=lambda peer: -self.access.routed[peer])[:MAX_ACCUSED_READ]

    async def judge(self, reports: list[tuple[str, FaultReport]]) -> None:
        """Convict the peers that reports which hold accuse (JUDGED_PER_READ new ones at most)."""
        fresh = 0
        for reporter, report in reports:
            key = evidence_key(report)
            if reporter in self.discredited or key in self._verdicts or fresh >= JUDGED_PER_READ:
                continue
            fresh += 1
            judgement = await in_fresh_thread(judge_report, report, self.recomputer)
            if judgement is None:
                continue  # the model is too large to judge here: no verdict either way
            self._verdicts[key] = judgement.guilty
            if not judgement.guilty:
                self.discredited.add(reporter)
                log.warning(
                    "a fault report against peer %s does not hold (its evidence: input off by %.2g, output by %.2g); "
                    "ignoring the reports of %s", report.peer_id, judgement.input_error, judgement.output_error, reporter,
                )
        # evidence that held convicts, whoever wrote it and whatever else its writer wrote
        convicted = {report.peer_id for _, report in reports if self._verdicts.get(evidence_key(report))}
        self.access.take_reports(frozenset(convicted))

    def catch(self, peer_id: str, reach: int = 0) -> None:
        """This client's own verification caught `peer_id` computing wrong results within the
        first `reach` positions of a session."""
        self.access.catch(peer_id)
        self.suspect({peer_id}, reach)

    def suspect(self, peers: set[str], reach: int = 0, canaries: int = 2) -> None:
        """Peers whose results this client saw wrong, within a session's first `reach` positions,
        without evidence others could check: canaries go through each, at least as far (a liar
        may lie only past some length), to catch it signing a wrong receipt."""
        for peer in peers - self.proven:
            if peer in self.suspects or len(self.suspects) < MAX_SUSPECTS:
                owed, far = self.suspects.get(peer, (0, 0))
                self.suspects[peer] = (max(owed, canaries), max(far, reach))

    def convict(self, peer_id: str) -> None:
        """A canary's receipts proved `peer_id` wrong: distrusted, and suspected no more."""
        self.access.catch(peer_id)
        self.proven.add(peer_id)
        self.suspects.pop(peer_id, None)

    def next_suspect(self) -> tuple[str, int] | None:
        """A suspect a canary is owed to, counted as served, and how far the canary should reach."""
        for peer, (owed, reach) in self.suspects.items():
            if owed > 0:
                self.suspects[peer] = (owed - 1, reach)
                return peer, reach
        return None
