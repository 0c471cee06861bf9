"""Driving a training run of the swarm's own weights (docs/training.md).

The driver holds the data, the tokenizer, the embeddings and the LM head (frozen). Each inner step
splits its batch into micro-batches, one per chain of replicas (client/run/replicas.py), runs their
forward and backward passes through the chains (training sessions of the inference protocol, with
no compression), and then tells every replica it used to take its optimizer step. Every
`sync_every` steps it starts the outer step, stage by stage, with the replicas that answer.

Churn: a replica that fails during a step costs that step only: the driver tells the others to
drop its gradients and runs the whole step again on the replicas left, so the gradients are those
of an undisturbed step. A replica that fails during an outer step is left out and the round runs
again with the others. While a stage has no replica at the driver's round (a joiner catches up by
copying another replica's state), the driver waits for one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import replace

import torch
from torch import nn

from p2pfusion.client.route.pieces import split_batch
from p2pfusion.client.route.session import RouteSession
from p2pfusion.client.route.tasks import all_or_first_error
from p2pfusion.client.run.config import RunConfig
from p2pfusion.client.run.replicas import astray, chains, served, split_rows, stages
from p2pfusion.dht.records import MAX_REPLICAS, PeerRecord, PeerState, RunCharter
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.dht.validation import RUN_TTL
from p2pfusion.errors import P2PFusionError, PeerFailed, RequestError, RouteError
from p2pfusion.models.source import ModelSource
from p2pfusion.net import probe
from p2pfusion.net import run_messages as t
from p2pfusion.net.compression import Codec, Purpose
from p2pfusion.net.run_calls import call, fetch_state, status
from p2pfusion.net.seals import convicted

log = logging.getLogger(__name__)

PASS_TIMEOUT = 600.0  # one micro-batch's forward or backward through its chain
OUTER_TIMEOUT = 900.0  # an outer step: pseudo-gradients, the all-reduce, the Nesterov step
LOST_PROBE_TIMEOUT = 3.0  # seconds a replica of a failed chain is asked to echo at most
AVOID_SECONDS = 60.0  # a replica that failed is left out this long (or until it answers a status)
EVICT_SECONDS = 600.0  # a replica whose pseudo-gradient the others' robust means left out
ROUND_ATTEMPTS = 3


class TrainingRun:
    def __init__(self, swarm: SwarmNode, source: ModelSource, head: nn.Module, num_layers: int, config: RunConfig):
        config.check()
        self.swarm = swarm
        self.source = source
        self.head = head
        self.num_layers = num_layers
        self.config = config
        self.step = 0  # inner steps the run has taken
        self.round = 0  # outer steps
        self.redone = 0  # steps run again after a replica failed
        self._avoid: dict[str, float] = {}  # peer id -> until when it is left out
        # peer id -> the round it said it was at: replicas are asked once per round, and a step
        # through one that has failed since is run again without it
        self._ready: dict[str, int] = {}
        # (start, end) -> the outer weights' digest most of that stage's replicas took the last outer
        # step to: a replica holding others copies theirs, and takes no step until it has
        self._agreed: dict[tuple[int, int], bytes] = {}
        self._waiting_since: float | None = None
        self.charter: RunCharter | None = None  # as this driver last wrote it
        self._written_at = -math.inf

    async def start(self) -> None:
        """Take up the run where its replicas are, as the driver its charter names (a run another
        driver created first is a RequestError: its replicas obey that driver only)."""
        config, me = self.config, self.swarm.writer_id
        charters = await self.swarm.charters(self.source.key, config.run)
        if charters and charters[0].driver != me:
            raise RequestError(
                f"training run {config.run} of {self.source.name} belongs to driver {charters[0].driver}; its replicas "
                f"obey that driver only. Drive it with that driver's identity file, or start a run of another name"
            )
        created = charters[0].created if charters else time.time()
        self.charter = RunCharter(
            self.source.key, config.run, me, [], config.replicas is None, config.max_lr or config.lr, config.outer_lr,
            config.sync_every, created,
        )
        log.info("driving training run %s as %s", config.run, me)
        answers = await self._statuses(await self._online())
        if not answers:
            raise RouteError(f"no replica of training run {self.config.run} of {self.source.name} answers")
        self.round = max(a.round for a in answers.values())
        self.step = max(a.step for a in answers.values() if a.round == self.round)

    async def _online(self) -> list[PeerRecord]:
        """The admitted replicas online now, written into the charter first when it lacks some."""
        now, allowed = time.monotonic(), self.config.replicas
        records = [
            r for r in await self.swarm.lookup(self.source.key, self.config.run)
            if r.state == PeerState.ONLINE and (allowed is None or r.peer_id in allowed)
        ]
        await self._write_charter({r.peer_id for r in records})
        return [r for r in records if not self._sits_out(r.peer_id, now)]

    async def _write_charter(self, online: set[str]) -> None:
        """List `online` in the charter (with those listed before, as room allows), and write it
        when that changed it or it is due again."""
        listed = set(self.charter.replicas)
        if online <= listed and time.monotonic() - self._written_at < RUN_TTL / 3:
            return
        kept = sorted(online) + sorted(listed - online)
        self.charter = replace(self.charter, replicas=kept[:MAX_REPLICAS])
        if not await self.swarm.publish_charter(self.charter):
            log.warning("training run %s: no DHT node stored its charter; replicas may refuse this driver", self.config.run)
        self._written_at = time.monotonic()

    async def _statuses(self, records: list[PeerRecord]) -> dict[str, t.StateEnd]:
        answers = await asyncio.gather(
            *[status(self.swarm.transport, r.peer_id, r.data_addrs, self._status_request(r)) for r in records],
            return_exceptions=True,
        )
        out = {}
        for record, answer in zip(records, answers):
            if isinstance(answer, t.StateEnd) and (answer.start, answer.end) == (record.start, record.end):
                out[record.peer_id] = answer
            elif isinstance(answer, BaseException) and not isinstance(answer, P2PFusionError):
                raise answer
            else:
                self._sit_out(record.peer_id, AVOID_SECONDS)
        return out

    def _status_request(self, record: PeerRecord) -> t.Status:
        return t.Status(self.config.run, self.round, self._agreed.get((record.start, record.end), b""))

    def _in_step(self, record: PeerRecord, where: t.StateEnd) -> bool:
        """At the driver's round, with the outer weights most of its stage's replicas hold."""
        agreed = self._agreed.get((record.start, record.end))
        return where.round == self.round and (agreed is None or where.digest == agreed)

    async def averaged_bytes(self) -> int:
        """The bytes the averaging rounds of the replicas online now moved, as they report them."""
        return sum(a.averaged_bytes for a in (await self._statuses(await self._online())).values())

    async def replicas(self) -> list[list[PeerRecord]]:
        """The run's stages, of the replicas at the driver's round; waits while some layers have none."""
        deadline = time.monotonic() + self.config.wait
        while True:
            records = await self._online()
            unknown = {r.peer_id: r for r in records if self._ready.get(r.peer_id) != self.round}
            for peer_id, answer in (await self._statuses(list(unknown.values()))).items():
                # a replica copying the others' weights is asked again at the next step
                self._ready[peer_id] = answer.round if self._in_step(unknown[peer_id], answer) else -1
            current = [r for r in records if self._ready.get(r.peer_id) == self.round]
            try:
                tiled = stages(current, self.num_layers)
                if self._waiting_since is not None:
                    log.info("training run %s goes on after %.0f s", self.config.run, time.monotonic() - self._waiting_since)
                    self._waiting_since = None
                return tiled
            except RouteError as exc:
                if time.monotonic() > deadline:
                    raise RouteError(f"training run {self.config.run}: {exc}, for {self.config.wait:.0f} s") from None
                if self._waiting_since is None:
                    self._waiting_since = time.monotonic()
                    log.warning("training run %s: %s; waiting for a replica to join or catch up", self.config.run, exc)
                await asyncio.sleep(1.0)

    async def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None, lr: float) -> float:
        """One inner step on the batch; its mean loss over the labelled tokens."""
        if not 0 <= lr <= self.charter.max_lr:
            raise RequestError(f"learning rate {lr} is outside the run's bounds [0, max_lr={self.charter.max_lr}]")
        hidden = self._embed(input_ids)
        while True:
            routes = chains(await self.replicas(), input_ids.shape[0])
            parts = split_rows(input_ids.shape[0], len(routes))
            jobs = [self._micro(route, hidden[a:b], labels[a:b], None if mask is None else mask[a:b]) for route, (a, b) in zip(routes, parts)]
            try:
                results = await all_or_first_error(jobs)
                break
            except PeerFailed as exc:
                await self._lost(exc, routes)
            except P2PFusionError:  # the step is not taken: what its other micro-batches left goes too
                await self._discard(routes, set())
                raise
        passes: dict[str, int] = {}
        for route, (_, _, chunks) in zip(routes, results):
            for record in route:
                passes[record.peer_id] = passes.get(record.peer_id, 0) + chunks
        await self._apply(routes, passes, lr)
        self.step += 1
        if self.step % self.config.sync_every == 0:
            await self.outer_step()
        tokens = sum(n for _, n, _ in results)
        return sum(loss * n for loss, n, _ in results) / max(tokens, 1)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.head.get_input_embeddings()(input_ids).float()

    async def _forward(self, route: list[PeerRecord], hidden: torch.Tensor, mask) -> tuple[RouteSession, list, torch.Tensor]:
        """The chain's output for `hidden`, sent in pieces the peers take (a training session, no
        compression; the caller closes it): the session, (step, sequences) per piece, the output."""
        batch, tokens = hidden.shape[:2]
        pieces = split_batch(hidden, mask, torch.arange(tokens).expand(batch, -1))
        session = RouteSession(self.swarm.transport, route, tokens, Codec.NONE, None, Purpose.TRAINING, batch)
        await session.open()
        try:
            steps = [(await session.submit(c.hidden, c.mask, c.positions), c.hidden.shape[0]) for c in pieces]
            return session, steps, torch.cat([await session.result(s, PASS_TIMEOUT) for s, _ in steps])
        except BaseException:
            await session.close()
            raise

    async def _micro(self, route: list[PeerRecord], hidden, labels, mask) -> tuple[float, int, int]:
        """A micro-batch's forward and backward through one chain: its mean loss, labelled tokens, passes."""
        session, steps, out = await self._forward(route, hidden, mask)
        try:
            out.requires_grad_(True)
            with torch.enable_grad():
                loss = self.head(inputs_embeds=out, labels=labels).loss
                loss.backward()
            if not torch.isfinite(out.grad).all():
                raise RequestError(f"the loss is not finite at step {self.step}: the step is not taken")
            for (s, _), g in zip(steps, out.grad.split([rows for _, rows in steps])):
                await session.submit_backward(s, g.contiguous())
            for s, _ in steps:
                await session.backward_result(s, PASS_TIMEOUT)
        finally:
            await session.close()
        return loss.item(), int((labels[:, 1:] != -100).sum()), len(steps)

    async def _lost(self, exc: PeerFailed, routes: list[list[PeerRecord]]) -> None:
        """Leave out the replicas that failed, drop the step's gradients on the others."""
        peers = {r.peer_id: r for route in routes for r in route}
        gone = {exc.peer_id} if exc.peer_id in peers else set()
        if not gone:  # a silent chain: ask each of its replicas
            # a frozen replica is judged by the others' echo times: wrongly left out, a replica
            # only sits out until it answers a status
            silent = await probe.silent_peers(
                self.swarm.transport, {p: r.data_addrs for p, r in peers.items()}, LOST_PROBE_TIMEOUT, {},
                unknown_like_first=True,
            )
            gone = set(silent)
        for peer_id in gone:
            self._sit_out(peer_id, AVOID_SECONDS)
            self._ready.pop(peer_id, None)
        self.redone += 1
        log.warning(
            "training run %s: replica %s failed during step %d (%s); running the step again on the others",
            self.config.run, ", ".join(sorted(gone)) or "?", self.step, exc,
        )
        await self._discard(routes, gone)

    async def _discard(self, routes: list[list[PeerRecord]], gone: set[str]) -> None:
        peers = {r.peer_id: r for route in routes for r in route if r.peer_id not in gone}
        drop = t.DiscardStep(self.config.run, self.step)
        await asyncio.gather(*[call(self.swarm.transport, p, r.data_addrs, drop) for p, r in peers.items()], return_exceptions=True)

    async def _apply(self, routes: list[list[PeerRecord]], passes: dict[str, int], lr: float) -> None:
        config, counts = self.config, served(routes)
        records = {r.peer_id: r for route in routes for r in route}
        answers = await asyncio.gather(*[
            call(self.swarm.transport, p, r.data_addrs, t.ApplyStep(
                config.run, self.round, self.step, passes[p], counts[p], lr, *config.betas, config.eps, config.weight_decay,
            ))
            for p, r in records.items()
        ], return_exceptions=True)
        for peer_id, answer in zip(records, answers):
            if isinstance(answer, P2PFusionError):  # it goes on with the others; it catches up at the next round
                self._sit_out(peer_id, AVOID_SECONDS)
                self._ready.pop(peer_id, None)
                log.warning("training run %s: replica %s did not take step %d: %s", config.run, peer_id, self.step, answer)
            elif isinstance(answer, BaseException):
                raise answer

    async def outer_step(self) -> None:
        """Average each stage's replicas and take the outer step; stages go at once."""
        await asyncio.gather(*[self._average(stage) for stage in await self.replicas()])
        self.round += 1

    async def _average(self, members: list[PeerRecord]) -> None:
        """The stage's outer step. Members that fail it are asked again among themselves; those
        still failing after ROUND_ATTEMPTS are left out (they catch up by copying the state the
        others agree on), unless no member of the stage took the step."""
        layers, done = f"{members[0].start}:{members[0].end}", {}
        try:
            await self._attempts(members, layers, done)
        finally:
            self._reconcile(members[0], layers, done)

    async def _attempts(self, members: list[PeerRecord], layers: str, done: dict[str, tuple[t.OuterDone, bytes]]) -> None:
        """`done` gets each member's answer, beside the round (group id) it took the step in."""
        config, took, key = self.config, 0, self.source.key
        for attempt in range(ROUND_ATTEMPTS):
            group = [r.peer_id for r in members]
            round_id = t.group_id(key, config.run, members[0].start, members[0].end, self.round, attempt, group)
            request = t.OuterStep(
                config.run, self.round, group, attempt, config.outer_lr, config.outer_momentum,
                config.averaging_timeout, config.averaging,
            )
            answers = await asyncio.gather(
                *[call(self.swarm.transport, r.peer_id, r.data_addrs, request, OUTER_TIMEOUT) for r in members],
                return_exceptions=True,
            )
            failed = [(r, a) for r, a in zip(members, answers) if isinstance(a, BaseException)]
            for record, answer in zip(members, answers):
                if not isinstance(answer, BaseException):
                    self._ready[record.peer_id] = self.round + 1
                    done[record.peer_id] = (answer, round_id)
                    took += 1
            self._evict([a for a in answers if isinstance(a, t.OuterDone)], layers)
            if not failed:
                return
            for _, answer in failed:
                if not isinstance(answer, P2PFusionError):
                    raise answer
            # a member the others' means just left out is not asked again: it sits out the run
            now = time.monotonic()
            where = await self._statuses([r for r, _ in failed if not self._sits_out(r.peer_id, now)])
            members = [r for r, _ in failed if r.peer_id in where and where[r.peer_id].round == self.round]
            log.warning(
                "training run %s: outer step %d of layers %s failed (%s); again with %d replicas",
                config.run, self.round, layers, failed[0][1], len(members),
            )
            if not members:
                return
        if not took:
            raise RouteError(f"training run {config.run}: outer step {self.round} failed {ROUND_ATTEMPTS} times")
        for record in members:
            self._sit_out(record.peer_id, AVOID_SECONDS)
            self._ready.pop(record.peer_id, None)
        log.warning("training run %s: %s failed outer step %d %d times; going on without them",
                    config.run, ", ".join(r.peer_id for r in members), self.round, ROUND_ATTEMPTS)

    def _reconcile(self, stage: PeerRecord, layers: str, done: dict[str, tuple[t.OuterDone, bytes]]) -> None:
        """Leave out of the run the members proven to have sealed two digests in a round, and
        remember the outer weights most of the others took the step to; those holding others copy
        them (asked at the next step's status) and take no step meanwhile."""
        namespace = t.averaging_namespace(self.source.key, self.config.run)
        guilty = set().union(*(convicted(answer.two_faced, namespace, gid) for answer, gid in done.values()))
        for peer in sorted(guilty):
            self._leave_out(peer)
            log.warning("training run %s: replica %s of layers %s sent different tensors to different members of "
                        "outer step %d (its two seals prove it); leaving it out of the run for %.0f s",
                        self.config.run, peer, layers, self.round, EVICT_SECONDS)
        digests = {peer: answer.digest for peer, (answer, _) in done.items() if peer not in guilty}
        agreed, others = astray(digests)
        key = (stage.start, stage.end)
        if agreed is None:
            self._agreed.pop(key, None)
            return
        self._agreed[key] = agreed
        for peer in others:
            self._ready.pop(peer, None)
        if others:
            log.warning(
                "training run %s: outer step %d left %s of layers %s with other weights than the %d replicas that "
                "agree; they copy those before their next step", self.config.run, self.round, ", ".join(others),
                layers, len(digests) - len(others),
            )

    def _leave_out(self, peer: str) -> None:
        self._sit_out(peer, EVICT_SECONDS)
        self._ready.pop(peer, None)

    def _sit_out(self, peer: str, seconds: float) -> None:
        """Leave `peer` out of routes and rounds for `seconds` at least: a later, shorter reason
        (it failed a step) never cuts short a longer one (the others' means left it out)."""
        self._avoid[peer] = max(self._avoid.get(peer, 0.0), time.monotonic() + seconds)

    def _sits_out(self, peer: str, now: float) -> bool:
        return self._avoid.get(peer, 0.0) > now

    def _evict(self, done: list[t.OuterDone], layers: str) -> None:
        """Leave out of the run, for EVICT_SECONDS, the replicas that most members' robust means
        left out: their micro-batches go to the others rather than to updates nobody uses."""
        votes = Counter(peer for answer in done for peer in set(answer.left_out))
        for peer, count in votes.items():
            if 2 * count > len(done):
                self._leave_out(peer)
                log.warning(
                    "training run %s: replica %s of layers %s sent a pseudo-gradient the others left out (not finite, "
                    "misshapen, far from theirs, pointing away from them, or not the same to all); leaving it out "
                    "of the run for %.0f s",
                    self.config.run, peer, layers, EVICT_SECONDS,
                )

    async def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None) -> float:
        """The mean loss through one chain (after an outer step, every replica holds the same weights)."""
        session, _, out = await self._forward(chains(await self.replicas(), 1)[0], self._embed(input_ids), mask)
        await session.close()  # the peers drop the forwards they kept for a backward pass
        with torch.no_grad():
            return float(self.head(inputs_embeds=out, labels=labels).loss)

    async def stage_weights(self, shapes_of) -> dict[str, torch.Tensor]:
        """Every layer's outer weights (those of the last outer step), from one replica per stage."""
        weights = {}
        for stage in await self.replicas():
            for record in stage:
                request = t.FetchState(self.config.run, self.source.key, record.start, record.end, weights_only=True)
                try:
                    parts, _ = await fetch_state(self.swarm.transport, record.peer_id, record.data_addrs, request, shapes_of(record))
                except PeerFailed as exc:
                    log.warning("replica %s could not send its weights (%s); asking another", record.peer_id, exc)
                    continue
                weights.update(parts["outer"])
                break
            else:
                raise RouteError(f"no replica of layers {stage[0].start}:{stage[0].end} sent its weights")
        return weights

