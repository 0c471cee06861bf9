"""A training replica's side of the training-run protocol (net/run_messages.py): the driver's
steps, the outer steps with the stage's other replicas, and its state for replicas that join.

Optimizer work runs on the stage's compute thread, between micro-batches, never beside them.
A request that cannot be honoured is one `Error` line, and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time

from p2pfusion.dht.records import PeerState
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.errors import ModelError, PeerFailed, RequestError
from p2pfusion.models.stage import Stage
from p2pfusion.models.threads import in_fresh_thread
from p2pfusion.net import messages as m
from p2pfusion.net import run_messages as t
from p2pfusion.net.averaging import Averaged, GroupAverager
from p2pfusion.net.clients import Source
from p2pfusion.net.codecs import pack
from p2pfusion.net.framing import FrameError, FrameLimits, read_frame
from p2pfusion.net.run_calls import fetch_state, status
from p2pfusion.peer.replica import InnerHyper, OuterHyper, Replica, weights_digest
from p2pfusion.peer.run_owner import Charters, agreed, refusal
from p2pfusion.peer.scheduler import Scheduler
from p2pfusion.peer.server import StageServer
from p2pfusion.peer.streams import send_quietly, write

log = logging.getLogger(__name__)

REQUEST_LIMITS = FrameLimits(header=64 << 10, tensor_kinds=frozenset())
OPTIMIZER = "training-driver"  # the scheduler's source for optimizer work


class ReplicaService:
    def __init__(self, replica: Replica, model: str, swarm: SwarmNode, scheduler: Scheduler, driver: str | None = None):
        self.replica = replica
        self.model = model
        self.swarm = swarm  # where it finds the stage's other replicas
        self.transport = swarm.transport
        self.scheduler = scheduler
        self.charters = Charters(swarm, model, replica.run, driver)  # whom it obeys (peer/run_owner.py)
        self.averager = GroupAverager(self.transport, t.averaging_namespace(model, replica.run), in_fresh_thread)
        self._catching_up: asyncio.Task | None = None

    async def start(self) -> None:
        await self.averager.start()
        await self.transport.add_handler(t.PROTOCOL, self._handle)

    async def stop(self) -> None:
        await self.transport.remove_handler(t.PROTOCOL)
        await self.averager.stop()
        if self._catching_up is not None:
            self._catching_up.cancel()

    async def catch_up(self, wanted: int = 0, digest: bytes = b"") -> bool:
        """Copy the state that most of the stage's other replicas the run lists agree on (by digest),
        if it is ahead of this one (or at `wanted` or later), or the state whose outer weights have
        `digest`, when given; False when no other replica answers."""
        stage, run = self.replica.stage, self.replica.run
        charter = await self.charters.current()
        records = [
            r for r in await self.swarm.lookup(self.model, run)
            if r.state == PeerState.ONLINE and (r.start, r.end) == (stage.start, stage.end)
            and r.peer_id != self.transport.peer_id and (charter is None or r.peer_id in charter.replicas)
        ]
        answers = []
        for record in records:
            try:
                answers.append((await status(self.transport, record.peer_id, record.data_addrs, t.Status(run)), record))
            except (PeerFailed, RequestError) as exc:
                log.info("replica %s of layers %d:%d did not answer: %s", record.peer_id, stage.start, stage.end, exc)
        request = t.FetchState(run, self.model, stage.start, stage.end)
        for where, record in agreed(answers, max(wanted, self.replica.round)):
            if digest and where.digest != digest:
                continue
            try:
                parts, end = await fetch_state(self.transport, record.peer_id, record.data_addrs, request, self.replica.shapes())
                if any(set(part) != set(self.replica.names) for part in parts.values()):
                    raise RequestError(f"replica {record.peer_id} holds other weights than these layers")
                if weights_digest([parts["outer"][name] for name in self.replica.names]) != where.digest:
                    raise RequestError(f"replica {record.peer_id} sent other weights than those it said it holds")
            except (PeerFailed, RequestError) as exc:
                log.warning("could not copy the state of replica %s: %s", record.peer_id, exc)
                continue
            state = {kind: [part[name] for name in self.replica.names] for kind, part in parts.items()}
            await self._compute(self.replica.load, state, end.step, end.round, end.adam_steps)
            log.info(
                "copied layers %d:%d of run %s from replica %s: outer step %d, inner step %d",
                stage.start, stage.end, run, record.peer_id, end.round, end.step,
            )
            return True
        return not records

    async def _compute(self, fn, *args):
        return await self.scheduler.run(OPTIMIZER, 1 << 20, True, fn, *args)

    async def _handle(self, reader, writer, source: Source) -> None:
        try:
            async with asyncio.timeout(10.0):
                header, _ = await read_frame(reader, REQUEST_LIMITS)
            request = t.from_header(header)
            serve = ReplicaService._SERVES.get(type(request))
            if serve is None:
                raise RequestError(f"unexpected {request.kind!r} request")
            if request.run != self.replica.run:
                raise RequestError(f"this peer trains run {self.replica.run!r}, not {request.run!r}")
            charter = await self.charters.current(source.peer)
            joining = isinstance(request, t.FetchState) and charter is not None and charter.open and \
                source.peer in {r.peer_id for r in await self.swarm.lookup(self.model, self.replica.run)}
            why = refusal(request, charter, source.peer, self.transport.peer_id, joining)
            if why is not None:
                raise RequestError(f"{request.kind}: {why}")
            if isinstance(request, t.Status) and (charter is None or source.peer != charter.driver):
                request = t.Status(request.run)  # only the driver's round sends this replica catching up
            await serve(self, request, writer)
        except (RequestError, FrameError) as exc:
            log.warning("refused a training request from %s: %s", source, exc)
            await send_quietly(writer, m.Error(message=str(exc)))
        except (EOFError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _apply(self, request: t.ApplyStep, writer) -> None:
        hyper = InnerHyper(request.lr, (request.beta1, request.beta2), request.eps, request.weight_decay)
        await self._compute(self.replica.apply, request.round, request.step, request.passes, request.chains, hyper)
        await write(writer, t.to_header(m.Ack()))

    async def _discard(self, request: t.DiscardStep, writer) -> None:
        if request.step == self.replica.step:
            await self._compute(self.replica.discard)
        await write(writer, t.to_header(m.Ack()))

    async def _outer(self, request: t.OuterStep, writer) -> None:
        averaged = await self._outer_step(request)
        await write(writer, t.to_header(t.OuterDone(averaged.left_out, self.replica.digest, averaged.two_faced)))

    async def _status(self, request: t.Status, writer) -> None:
        """Where this replica is; one behind the driver's round, or at it with other outer weights
        than most replicas took it to, starts copying theirs."""
        replica = self.replica
        behind = request.round > replica.round
        astray = bool(request.digest) and request.round == replica.round and request.digest != replica.digest
        if (behind or astray) and (self._catching_up is None or self._catching_up.done()):
            if astray:
                log.warning("outer step %d of run %s left this replica's weights unlike most replicas'; copying theirs",
                            replica.round, replica.run)
            self._catching_up = asyncio.create_task(self.catch_up(request.round, request.digest))
        await write(writer, t.to_header(self._where()))

    async def admit_session(self, source: Source) -> None:
        """A training session's Open: only the driver's, or a listed replica's relaying one."""
        why = refusal("session", await self.charters.current(source.peer), source.peer, self.transport.peer_id)
        if why is not None:
            raise RequestError(f"open: {why}")

    def _where(self) -> t.StateEnd:
        r = self.replica
        return t.StateEnd(
            r.run, r.stage.start, r.stage.end, r.step, r.round, r.micro, r.adam_steps, len(r.names),
            self.averager.wire_bytes, r.digest,
        )

    async def _outer_step(self, request: t.OuterStep) -> Averaged:
        replica = self.replica
        if request.round != replica.round:
            raise RequestError(f"outer step {request.round} asked, but this replica has taken {replica.round}")
        if replica.micro:
            raise RequestError(f"outer step {request.round}: {replica.micro} micro-batches still await their inner step")
        hyper = OuterHyper(request.lr, request.momentum)
        hyper.check()
        if request.compression not in ("none", "float16") or not 0 < request.timeout <= 600:
            raise RequestError("outer step: compression must be none or float16, timeout in (0, 600] s")
        started = time.perf_counter()
        delta = await self._compute(replica.pseudo_gradient)
        stage = replica.stage
        gid = t.group_id(self.model, replica.run, stage.start, stage.end, request.round, request.attempt, request.group)
        averaged = await self.averager.average(gid, delta, request.group, request.timeout, request.compression)
        del delta
        await self._compute(replica.outer_step, averaged.tensors, hyper)
        log.info(
            "outer step %d of run %s with %d replicas of layers %d:%d (%.1f s)",
            request.round, replica.run, len(set(request.group)), stage.start, stage.end, time.perf_counter() - started,
        )
        return averaged

    async def _send_state(self, request: t.FetchState, writer) -> None:
        replica, stage = self.replica, self.replica.stage
        if (request.model, request.start, request.end) != (self.model, stage.start, stage.end):
            raise RequestError(
                f"this replica holds layers {stage.start}:{stage.end} of {self.model}, "
                f"not {request.start}:{request.end} of {request.model}"
            )
        kinds = ("outer",) if request.weights_only else t.STATE_KINDS
        snapshot, where = await self._compute(self._snapshot, kinds)
        for kind, tensors in snapshot.items():
            for name, tensor in zip(replica.names, tensors):
                await write(writer, t.to_header(t.StatePart(kind, name)), pack(tensor))
        await write(writer, t.to_header(where))

    def _snapshot(self, kinds: tuple[str, ...]):
        state = self.replica.state()
        return {kind: [x.detach().to("cpu", copy=True) for x in state[kind]] for kind in kinds}, self._where()

    # the driver's requests, and a joining replica's, each answered on its own stream
    _SERVES = {t.ApplyStep: _apply, t.DiscardStep: _discard, t.OuterStep: _outer, t.Status: _status, t.FetchState: _send_state}


async def join_run(
    swarm: SwarmNode, model: str, run: str, stage: Stage, server: StageServer, driver: str | None = None
) -> ReplicaService:
    """Make `stage` a replica of `run` (obeying `driver`, if given, else the run's charter's), with
    the current state of the stage's other replicas when there are any (never the model's own
    weights then: those would be stale), and serve the run's protocol. A ModelError when replicas
    exist but none could share its state, or when the run lists its replicas and not this one."""
    replica = Replica(stage, run)
    service = ReplicaService(replica, model, swarm, server.compute.scheduler, driver)
    charter = await service.charters.current()
    if charter is not None and not charter.open and swarm.peer_id not in charter.replicas:
        raise ModelError(
            f"training run {run} admits only the replicas its driver {charter.driver} lists, and not this peer "
            f"({swarm.peer_id}): ask the driver to add it"
        )
    if not await service.catch_up():
        raise ModelError(
            f"layers {stage.start}:{stage.end} of training run {run} have replicas, but none shared its state; "
            "not serving stale weights"
        )
    if replica.step == 0 and replica.round == 0:
        log.info("replica of layers %d:%d of run %s, from the model's weights", stage.start, stage.end, run)
    server.serve_run(run, replica.ran_backward, service.admit_session)
    await service.start()
    return service
