"""Serve one pipeline stage: sessions pushed on to the next hop, with a KV cache each for inference,
and gradients passed back upstream for training.

A bad request fails only its own session (or only its own step, when the stream is still
readable); every other session on this peer goes on. Every stream is bounded: its frames by
`peer.limits` (checked before anything is read or allocated), its silences by timeouts, and the
memory its sessions reserve by `peer.admission`. See p2pfusion.net.messages for the protocol.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from p2pfusion.dht.records import DEFAULT_SESSION_LIMIT
from p2pfusion.errors import PeerBusy, PeerFailed, PeerUnreachable, RequestError, SessionExpired
from p2pfusion.models.stage import Stage
from p2pfusion.net import messages as m
from p2pfusion.net.clients import Source
from p2pfusion.net.codecs import pack
from p2pfusion.net.compression import AUTO, Compression, Purpose
from p2pfusion.net.framing import BadTensor, read_frame, write_frame
from p2pfusion.net.links import LinkBook
from p2pfusion.net.payloads import flatten
from p2pfusion.net.penalties import Refusals
from p2pfusion.net.receipts import ReceiptChain, ReceiptKey
from p2pfusion.net.transport import Transport
from p2pfusion.peer.admission import Reservation, refusal, vouched_origin
from p2pfusion.peer.batching import fairness_unit
from p2pfusion.peer.compute import StageCompute
from p2pfusion.peer.directory import HopDirectory, dial_addrs
from p2pfusion.peer.heap import HeapTrimmer
from p2pfusion.peer.limits import ServingLimits, StreamLimits, session_limits, stream_limits, token_bytes
from p2pfusion.peer.metrics import StageMetrics
from p2pfusion.peer.relay import relay, screen
from p2pfusion.peer.session import Session
from p2pfusion.peer.sinks import SUBSCRIBE_WAIT, ResultStreams
from p2pfusion.peer.streams import error_for, send_quietly, step_of, write
from p2pfusion.peer.threads import DecodeSettings

log = logging.getLogger(__name__)

ONWARD_WAIT = 30.0  # for the next hop's answer to an Open (it answers once the rest of the route is up)


class StageServer:
    def __init__(
        self,
        stage: Stage,
        transport: Transport,
        links: LinkBook,
        directory: HopDirectory,
        limits: ServingLimits,
        model_layers: int,
        session_limit: int = DEFAULT_SESSION_LIMIT,
        compression: Compression = AUTO,
        decode: DecodeSettings | None = None,
        training_memory: int = 1 << 30,
        *,
        metrics: StageMetrics,
    ):
        self.stage = stage
        self.transport = transport
        self.links = links
        self.directory = directory
        self.limits = limits
        self.model_layers = model_layers
        self.compression = compression  # what this peer's operator forces, unless the client does
        self.peer_id = transport.peer_id
        self.receipt_key = ReceiptKey(transport.identity)
        self.session_limit = session_limit  # the longest session it accepts
        self.tokens_done = 0  # tokens computed since start, for the load this peer announces
        self.sessions_opened = 0  # since start, for the peer's periodic report
        self.sessions: dict[str, Session] = {}
        self.results = ResultStreams()
        self.bad_tensors = Refusals()
        self.compute = StageCompute(decode, training_memory, limits.prefill_chunk, lambda: len(self.sessions) > 1)
        self.heap = HeapTrimmer(lambda: self.compute.idle)
        self.draining = False
        self.training_run: str | None = None  # a training replica's run: it serves that run's micro-batches only
        self._backward_ran: Callable[[], None] = lambda: None
        self._admit_training: Callable[[Source], Awaitable[None]] | None = None  # who may open its sessions
        self._streams: tuple[Stage, StreamLimits] | None = None
        self.metrics = metrics
        metrics.watch(self)

    def serve_run(
        self, run: str, on_backward: Callable[[], None], admit: Callable[[Source], Awaitable[None]]
    ) -> None:
        """Serve as a replica of training run `run`: training sessions only, opened by those
        `admit` lets in (it raises RequestError for others), and `on_backward()` after each
        backward pass (its weights' gradients have grown)."""
        self.training_run, self._backward_ran, self._admit_training = run, on_backward, admit

    @property
    def graph_bytes(self) -> int:
        """Activations kept for training sessions' backward passes."""
        return self.compute.graph_bytes

    @property
    def streams(self) -> StreamLimits:
        """Frame limits of this stage's streams (a move to other layers changes them)."""
        if self._streams is None or self._streams[0] is not self.stage:
            self._streams = (self.stage, stream_limits(self.stage, self.model_layers))
        return self._streams[1]

    def reservation(self, msg: m.Open) -> int:
        """Bytes a session reserves: the KV cache it may grow to (of the layers it runs here), or a
        training session's saved inputs. `msg` passed `_check_open`."""
        stage = self.stage.first_layers(msg.route[0].end)
        if msg.purpose == Purpose.TRAINING:
            return m.MAX_SAVED * m.MAX_STEP_TOKENS * stage.hidden_size * stage.dtype.itemsize
        return msg.batch * msg.length * token_bytes(stage)

    async def start(self) -> None:
        await self.transport.add_handler(m.PROTOCOL, self._handle)

    async def stop(self) -> None:
        await self.transport.remove_handler(m.PROTOCOL)
        self.heap.close()
        self.compute.shutdown()

    async def drain(self, timeout: float) -> None:
        """Refuse new sessions, tell current clients to move, and let their steps in flight finish."""
        self.draining = True
        for session in list(self.sessions.values()):
            await send_quietly(session.upstream, m.Leaving(peer_id=self.peer_id))
        deadline = time.monotonic() + timeout
        while self.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: Source) -> None:
        """`source` names who opened the stream: its address is the unit of the per-client caps,
        its client the unit of fair scheduling."""
        try:
            try:
                async with asyncio.timeout(self.limits.first_frame_timeout):
                    header, _ = await read_frame(reader, self.streams.first)
            except TimeoutError:
                raise RequestError(f"no request within {self.limits.first_frame_timeout:g} s of connecting") from None
            message = m.from_header(header)
            serve = StageServer._OPENERS.get(type(message))
            if serve is None:
                raise RequestError(f"unknown session: a {message.kind!r} message came before 'open'")
            await serve(self, message, reader, writer, source)
        except EOFError:
            pass
        except (PeerBusy, SessionExpired) as exc:  # the client's share, or its silence: no fault of anyone
            self.metrics.error(exc)
            log.info("%s", exc)
            await send_quietly(writer, error_for(exc))
        except PeerFailed as exc:
            self.metrics.error(exc)
            log.warning("%s", exc)
            await send_quietly(writer, error_for(exc))
        except RequestError as exc:
            self.metrics.error(exc)
            log.warning("rejected a request from %s: %s", source, exc)
            await send_quietly(writer, m.Error(message=str(exc)))
        except ConnectionError as exc:  # expected whenever a client quits mid-session: Ctrl-C, a closed socket
            log.info("a client went away mid-session (%s: %s)", type(exc).__name__, exc)
        except Exception as exc:  # a bug or a broken connection must cost one request, not the peer
            log.exception("request failed")
            self.metrics.error(exc)
            await send_quietly(writer, m.Error(message=f"internal error on peer: {exc}"))
        finally:
            writer.close()

    async def _serve_ping(self, msg: m.Ping, reader, writer, source: Source) -> None:
        reply = m.Error("this peer is leaving the swarm", failed_peer=self.peer_id) if self.draining else m.Ack()
        await write(writer, m.to_header(reply))

    async def _serve_subscriber(self, msg: m.Subscribe, reader, writer, source: Source) -> None:
        """The client's stream to the last hop: results go out on it, training gradients come in."""
        self.results.attach(msg.session_id, writer)
        try:
            await write(writer, m.to_header(m.Ack()))
            await self._serve_gradients(msg.session_id, reader, writer, source.address)
        finally:
            self.results.detach(msg.session_id)

    def _check_open(self, msg: m.Open) -> None:
        if not msg.route:
            raise RequestError("open: empty route")
        hop = msg.route[0]
        if hop.peer_id != self.peer_id:
            raise RequestError(f"open: route names peer {hop.peer_id}, not this one")
        if hop.start != self.stage.start or not hop.start < hop.end <= self.stage.end:
            # the client's view of the swarm is stale (this peer moved): it should look again. A
            # route may leave this peer before its last layer, never enter it after its first
            raise PeerFailed(
                f"open: this peer serves layers {self.stage.start}:{self.stage.end}, not {hop.start}:{hop.end}",
                self.peer_id,
            )
        if msg.length > self.session_limit:
            raise RequestError(f"open: a session here holds at most {self.session_limit} tokens, got {msg.length}")
        if msg.session_id in self.sessions:
            raise RequestError(f"open: session {msg.session_id} already exists")
        if self.training_run is not None and msg.purpose != Purpose.TRAINING:
            raise RequestError(f"open: this peer trains run {self.training_run!r} and serves its training sessions only")
        if self.draining:
            raise PeerFailed("open: this peer is leaving the swarm", self.peer_id)

    async def _vouched_origin(self, msg: m.Open, source: Source) -> str | None:
        """The client's address, where a listed peer relays the session (peer.admission.vouched_origin)."""
        if msg.origin is None or source.peer is None:
            return None
        start = msg.route[0].start if msg.route else self.stage.start
        return vouched_origin(msg.origin, await self.directory.serves(source.peer), start)

    def _admit(self, msg: m.Open, source: str) -> int:
        """The bytes the session reserves; PeerBusy (with a retry hint) when the budget, the session
        cap or this source's share lacks room now, RequestError when the session never fits here."""
        request = Reservation(source, self.reservation(msg))
        held = [Reservation(s.source, s.reserved) for s in self.sessions.values()]
        refused = refusal(self.limits.budget, held, request)
        if refused is None:
            return request.nbytes
        if refused.retry_after is None:
            raise RequestError(f"open: peer {self.peer_id}: {refused.reason}")
        self.metrics.refused_busy()
        raise PeerBusy(f"peer {self.peer_id} busy: {refused.reason}", self.peer_id, refused.retry_after)

    async def _serve_session(self, msg: m.Open, reader, writer, source: Source) -> None:
        self._check_open(msg)
        if self._admit_training is not None:
            await self._admit_training(source)
        origin = await self._vouched_origin(msg, source)
        caps = origin or source.address
        # a listed peer speaks for its client: the session is charged as at its first hop; anyone
        # else's claim divides only its own share
        unit = fairness_unit(source.fairness, msg.client) if origin is None else msg.client or origin
        stage = self.stage.first_layers(msg.route[0].end)
        session = Session(
            msg.session_id, msg.length, stage, writer, msg.purpose,
            compression=msg.compression if msg.compression != AUTO else self.compression,
            upstream_link=msg.link, source=caps, client=unit, batch=msg.batch,
            reserved=self._admit(msg, caps),
            downstream_peers=frozenset(hop.peer_id for hop in msg.route[1:]),
            frame_limits=session_limits(stage, self.model_layers, msg.batch, msg.length),
            receipts=ReceiptChain(self.receipt_key, msg.session_id, stage.start, stage.end, stage.format.value),
        )
        self.sessions[msg.session_id] = session
        self.sessions_opened += 1
        try:
            await self._connect_onward(session, msg)
            await write(writer, m.to_header(m.Ack()))
            while await self._on_frame(session, await self._next_frame(session, reader, writer), writer):
                pass
        except EOFError:  # a hop before us sends Close; a stream that just ends lost its client
            log.info("a client went away mid-session (session %s ended without a close)", session.session_id[:8])
        finally:
            await self._end(session)

    async def _end(self, session: Session) -> None:
        self.sessions.pop(session.session_id, None)
        self.compute.forget()
        for inputs in session.end():
            self.compute.release_graph(inputs)
        if session.downstream is not None:
            await send_quietly(session.downstream, m.Close())
            session.downstream.close()
        await self.heap.session_ended(session.reserved, len(self.sessions))

    async def _connect_onward(self, session: Session, msg: m.Open) -> None:
        if len(msg.route) == 1:
            session.to_client(await self.results.wait(msg.session_id), msg.client_link)
            return
        nxt = msg.route[1]
        announced = await self.directory(nxt.peer_id)
        if announced is None:
            raise PeerFailed(f"next hop {nxt.peer_id} ({nxt.start}:{nxt.end}) has no record in the swarm", nxt.peer_id)
        addrs = dial_addrs(nxt.data_addrs, announced)
        if session.compression == AUTO:
            session.use_link(await self.links.get(nxt.peer_id, addrs))
        onward = dataclasses.replace(
            msg, route=msg.route[1:], link=session.link, client=session.end_client, origin=session.source
        )
        try:
            reader, writer = await self.transport.open(nxt.peer_id, addrs, m.PROTOCOL)
        except PeerUnreachable as exc:
            raise PeerFailed(f"next hop {nxt.peer_id} ({nxt.start}:{nxt.end}) unreachable: {exc}", nxt.peer_id) from exc
        try:
            await write_frame(writer, m.to_header(onward))
            async with asyncio.timeout(ONWARD_WAIT):
                header, _ = await read_frame(reader, self.streams.first)
            reply = m.from_header(header)
        except (OSError, EOFError, TimeoutError, RuntimeError, RequestError) as exc:  # RuntimeError: uvloop, closed
            writer.close()
            raise PeerFailed(f"next hop {nxt.peer_id} ({nxt.start}:{nxt.end}) did not open the session: {exc!r}",
                             nxt.peer_id) from exc
        if not isinstance(reply, m.Ack):
            writer.close()
            m.raise_for_error(screen(reply, session.downstream_peers, nxt.peer_id))
            raise PeerFailed(f"next hop {nxt.peer_id} answered an open with {reply.kind!r}", nxt.peer_id)
        session.to_next_hop(writer, nxt.peer_id, asyncio.create_task(
            relay(session, reader, self.streams.relay, self._on_backward)
        ))

    async def _next_frame(self, session: Session, reader, writer):
        """The session's next good frame; a bad tensor costs its step only. Silence past the idle
        timeout expires the session."""
        while True:
            try:
                async with asyncio.timeout(self.limits.idle_timeout):
                    return await read_frame(reader, session.frame_limits)
            except TimeoutError:
                raise SessionExpired(
                    f"session {session.session_id[:8]} expired on peer {self.peer_id} after "
                    f"{self.limits.idle_timeout:g} s without a step; open it again", self.peer_id,
                ) from None
            except BadTensor as exc:
                await self._refuse_tensor(exc, writer, session.source)

    async def _refuse_tensor(self, exc: BadTensor, writer, source: str) -> None:
        """Answer a bad tensor; a source that keeps sending them waits before its stream is read on."""
        self.metrics.error(exc)
        await send_quietly(writer, m.Error(message=str(exc), step=step_of(exc.header)))
        await asyncio.sleep(self.bad_tensors.add(source, time.monotonic()))

    async def _on_frame(self, session: Session, frame, writer) -> bool:
        """One frame of a session; False at its Close. Its tensors go when this returns: nothing is
        held while the session waits for its next frame."""
        arrived = time.perf_counter()
        header, tensor = frame
        message = m.from_header(header)
        take = StageServer._IN_SESSION.get(type(message))
        if take is None:
            raise RequestError(f"unexpected {message.kind!r} message inside a session")
        return await take(self, session, message, tensor, writer, arrived)

    async def _on_close(self, session: Session, message: m.Close, tensor, writer, arrived: float) -> bool:
        return False

    async def _on_step(self, session: Session, message: m.Step, tensor, writer, arrived: float) -> bool:
        try:
            inputs = session.check_step(message, tensor)
            session.keep(inputs.keep)
            out, seconds = await self.compute.forward(session, inputs)
        except RequestError as exc:
            self.metrics.error(exc)
            await write(writer, m.to_header(m.Error(message=str(exc), step=message.step)))
            return True
        if session.training:
            self.compute.keep_graph(inputs)
        session.ran(message, inputs, seconds)
        positions = inputs.hidden.shape[0] * inputs.hidden.shape[1]
        self.tokens_done += positions
        timings = [*message.timings, (self.peer_id, seconds)]
        packed = session.pack(out)
        signed = session.sign(message, inputs.hidden, out, packed)
        if session.downstream is not None:
            onward = m.to_header(dataclasses.replace(message, timings=timings, **signed))
            await self._send_onward(session, onward, packed)
        else:
            await write(session.sink, m.to_header(m.Result(message.step, timings, **signed)), packed)
        self.metrics.step(session, arrived, seconds, positions)
        self.heap.step_done(self.stage.quantized_on_cpu)
        return True

    async def _on_params(self, session: Session, message: m.Params, flat: torch.Tensor | None, writer, arrived) -> bool:
        """Keep this stage's part of the session's parameters; pass the rest on. Bad parameters end
        the session (its steps would run on the wrong ones)."""
        rest = session.set_params(message, flat)
        if not rest:
            return True
        if session.downstream is None:
            raise RequestError(f"adapter parameter {next(iter(rest))} is for a layer past the end of this route")
        entries = [(name, list(value.shape)) for name, value in rest.items()]
        onward = m.Params(message.digest, message.scaling, entries)
        await self._send_onward(session, m.to_header(onward), pack(flatten(list(rest.values()))))
        return True

    @staticmethod
    async def _send_onward(session: Session, header: dict, payload) -> None:
        """A write to a next hop that died names that hop, so the client routes around it rather than
        giving up on the session."""
        try:
            await write_frame(session.downstream, header, payload)
        except (ConnectionError, RuntimeError) as exc:  # RuntimeError: uvloop's write on a closed transport
            raise PeerFailed(f"the next hop {session.next_peer} closed the session: {exc}", session.next_peer) from exc

    async def _on_backward(self, session_id: str, message: m.Backward, grad: torch.Tensor | None, reply) -> None:
        """Compute a step's input gradient and send it upstream; a bad one answers with an Error."""
        arrived = time.perf_counter()
        session = self.sessions.get(session_id)
        if session is None:
            # it ended here (its upstream went away): the client opens it again and replays
            gone = m.Error(message=f"backward: session {session_id} is no longer open here", step=message.step, code=m.ErrorCode.EXPIRED)
            self.metrics.error("expired")
            await send_quietly(reply, gone)
            return
        try:
            inputs, grad = session.take_saved(message.step, grad)
            (grad_in, param_grads), seconds = await self.compute.backward(session, inputs, grad)
        except RequestError as exc:
            self.metrics.error(exc)
            await send_quietly(session.upstream, m.Error(message=str(exc), step=message.step))
            return
        session.backward_ran(seconds)
        self._backward_ran()
        if param_grads:  # before the input's gradient, so the client has them all when that comes
            entries = [(name, list(g.shape)) for name, g in zip(inputs.params.names, param_grads)]
            header = m.to_header(m.ParamGrads(message.step, entries))
            await write(session.upstream, header, pack(flatten(param_grads)))
        timings = [*message.timings, (self.peer_id, seconds)]
        await write(session.upstream, m.to_header(m.Backward(message.step, timings)), session.pack(grad_in, upstream=True))
        self.metrics.step(session, arrived, seconds, inputs.hidden.shape[0] * inputs.hidden.shape[1], backward=True)

    async def _serve_gradients(self, session_id: str, reader, writer, source: str) -> None:
        """On the client's stream to the last hop: take gradients until the client closes it, or
        until no session uses it (none opened within SUBSCRIBE_WAIT, or it ended)."""
        while True:
            wait = self.limits.idle_timeout if session_id in self.sessions else SUBSCRIBE_WAIT
            try:
                async with asyncio.timeout(wait):
                    header, tensor = await read_frame(reader, self.streams.results)
            except TimeoutError:
                if session_id in self.sessions:
                    continue
                return
            except BadTensor as exc:
                await self._refuse_tensor(exc, writer, source)
                continue
            except (EOFError, ConnectionError):
                return
            message = m.from_header(header)
            if not isinstance(message, m.Backward):
                raise RequestError(f"unexpected {message.kind!r} message on a result stream")
            await self._on_backward(session_id, message, tensor, writer)
            del header, tensor  # not held while the stream waits for its next gradient


    # what a stream's first frame may open, and what may come inside a session
    _OPENERS = {m.Subscribe: _serve_subscriber, m.Open: _serve_session, m.Ping: _serve_ping}
    _IN_SESSION = {m.Step: _on_step, m.Params: _on_params, m.Close: _on_close}
