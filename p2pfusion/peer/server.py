"""Serve one pipeline stage: sessions pushed on to the next hop, with a KV cache each for inference,
and gradients passed back upstream for training.

A bad request fails only its own session (or only its own step, when the stream is still
readable); every other session on this peer goes on. See p2pfusion.net.messages for the protocol.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from p2pfusion.errors import PeerFailed, RequestError
from p2pfusion.models.stage import Stage
from p2pfusion.net import messages as m
from p2pfusion.net.codecs import pack
from p2pfusion.net.compression import AUTO
from p2pfusion.net.framing import BadTensor, FrameError, read_frame, write_frame
from p2pfusion.net.links import LinkBook
from p2pfusion.net.payloads import flatten
from p2pfusion.net.transport import Transport
from p2pfusion.peer.session import Session, StepInputs

log = logging.getLogger(__name__)

SUBSCRIBE_WAIT = 10.0
SMALL_STEP_ROWS = 8  # steps of at most this many positions (batch x tokens) run on `decode_threads`


class StageServer:
    def __init__(
        self,
        stage: Stage,
        transport: Transport,
        links: LinkBook,
        max_length: int = 2048,
        compression: str = AUTO,
        decode_threads: int | None = None,
        training_memory: int = 1 << 30,
    ):
        self.stage = stage
        self.transport = transport
        self.links = links
        self.compression = compression  # what this peer's operator forces, unless the client does
        self.peer_id = transport.peer_id
        self.max_length = max_length
        self.tokens_done = 0  # tokens computed since start, for the load this peer announces
        self.sessions_opened = 0  # since start, for the peer's periodic report
        self.sessions: dict[str, Session] = {}
        self._sinks: dict[str, asyncio.StreamWriter] = {}
        self._sink_ready: dict[str, asyncio.Event] = {}
        # One compute thread: torch already uses every core per op, and steps must not interleave.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")
        self._queued = 0  # steps given to the compute thread and not yet done
        self._all_threads = torch.get_num_threads()
        self._decode_threads = decode_threads or self._all_threads
        self.draining = False
        # activations kept between training steps' forward and backward passes, across sessions;
        # beyond this, a backward pass computes its forward again instead
        self.training_memory = training_memory
        self.graph_bytes = 0

    async def start(self) -> None:
        await self.transport.add_handler(m.PROTOCOL, self._handle)

    async def stop(self) -> None:
        await self.transport.remove_handler(m.PROTOCOL)
        self._compute.shutdown(wait=True)

    async def drain(self, timeout: float) -> None:
        """Refuse new sessions, tell current clients to move, and let their steps in flight finish."""
        self.draining = True
        for session in list(self.sessions.values()):
            await _send_quietly(session.upstream, m.Leaving(peer_id=self.peer_id))
        deadline = time.monotonic() + timeout
        while self.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header, _ = await read_frame(reader)
            message = m.from_header(header)
            if isinstance(message, m.Subscribe):
                await self._serve_subscriber(message, reader, writer)
            elif isinstance(message, m.Open):
                await self._serve_session(message, reader, writer)
            elif isinstance(message, m.Ping):
                reply = m.Error("this peer is leaving the swarm", failed_peer=self.peer_id) if self.draining else m.Ack()
                await _write(writer, m.to_header(reply))
            else:
                raise RequestError(f"unknown session: a {message.kind!r} message came before 'open'")
        except EOFError:
            pass
        except PeerFailed as exc:
            log.warning("%s", exc)
            await _send_quietly(writer, m.Error(message=str(exc), failed_peer=exc.peer_id))
        except RequestError as exc:
            log.warning("rejected a request: %s", exc)
            await _send_quietly(writer, m.Error(message=str(exc)))
        except ConnectionError as exc:  # expected whenever a client quits mid-session: Ctrl-C, a closed socket
            log.info("a client went away mid-session (%s: %s)", type(exc).__name__, exc)
        except Exception as exc:  # a bug or a broken connection must cost one request, not the peer
            log.exception("request failed")
            await _send_quietly(writer, m.Error(message=f"internal error on peer: {exc}"))
        finally:
            writer.close()

    async def _serve_subscriber(self, msg: m.Subscribe, reader, writer) -> None:
        """The client's stream to the last hop: results go out on it, training gradients come in."""
        self._sinks[msg.session_id] = writer
        self._sink_ready.setdefault(msg.session_id, asyncio.Event()).set()
        try:
            await _write(writer, m.to_header(m.Ack()))
            await self._serve_gradients(msg.session_id, reader, writer)
        finally:
            self._sinks.pop(msg.session_id, None)
            self._sink_ready.pop(msg.session_id, None)

    def _check_open(self, msg: m.Open) -> None:
        if not msg.route:
            raise RequestError("open: empty route")
        hop = msg.route[0]
        if hop.peer_id != self.peer_id:
            raise RequestError(f"open: route names peer {hop.peer_id}, not this one")
        if (hop.start, hop.end) != (self.stage.start, self.stage.end):
            # the client's view of the swarm is stale (this peer moved): it should look again
            raise PeerFailed(
                f"open: this peer serves layers {self.stage.start}:{self.stage.end}, not {hop.start}:{hop.end}",
                self.peer_id,
            )
        if not 0 < msg.max_length <= self.max_length:
            raise RequestError(f"open: max_length must be in 1..{self.max_length}, got {msg.max_length}")
        if msg.session_id in self.sessions:
            raise RequestError(f"open: session {msg.session_id} already exists")
        if self.draining:
            raise PeerFailed("open: this peer is leaving the swarm", self.peer_id)

    async def _serve_session(self, msg: m.Open, reader, writer) -> None:
        self._check_open(msg)
        session = Session(
            msg.session_id, msg.max_length, self.stage, writer, msg.purpose,
            compression=msg.compression if msg.compression != AUTO else self.compression,
            upstream_link=msg.link,
        )
        if not session.training:
            session.cache = self.stage.new_cache()
        self.sessions[msg.session_id] = session
        self.sessions_opened += 1
        try:
            await self._connect_onward(session, msg)
            await _write(writer, m.to_header(m.Ack()))
            await self._run_steps(session, reader, writer)
        finally:
            self.sessions.pop(msg.session_id, None)
            for inputs in session.saved.values():
                self._release_graph(inputs)
            if session.relay is not None:
                session.relay.cancel()
            if session.downstream is not None:
                await _send_quietly(session.downstream, m.Close())
                session.downstream.close()

    async def _connect_onward(self, session: Session, msg: m.Open) -> None:
        if len(msg.route) == 1:
            ready = self._sink_ready.setdefault(msg.session_id, asyncio.Event())
            try:
                await asyncio.wait_for(ready.wait(), SUBSCRIBE_WAIT)
            except TimeoutError:
                raise RequestError("open: the client opened no output stream to the last hop") from None
            session.sink = self._sinks[msg.session_id]
            session.link = msg.client_link
            return
        nxt = msg.route[1]
        if session.compression == AUTO:
            session.link = await self.links.get(nxt.peer_id, nxt.data_addrs)
        try:
            reader, writer = await self.transport.open(nxt.peer_id, nxt.data_addrs, m.PROTOCOL)
            onward = m.Open(
                msg.session_id, msg.max_length, msg.route[1:], msg.compression, msg.purpose, session.link, msg.client_link
            )
            await write_frame(writer, m.to_header(onward))
            header, _ = await read_frame(reader)
        except Exception as exc:  # libp2p dials fail with assorted types; any of them means that hop is gone
            raise PeerFailed(f"next hop {nxt.peer_id} ({nxt.start}:{nxt.end}) unreachable: {exc}", nxt.peer_id) from exc
        m.raise_for_error(m.from_header(header))
        session.downstream, session.next_peer = writer, nxt.peer_id
        session.relay = asyncio.create_task(self._relay(session, reader, nxt.peer_id))

    async def _run_steps(self, session: Session, reader, writer) -> None:
        while True:
            try:
                header, tensor = await read_frame(reader)
            except EOFError:  # a hop before us sends Close; a stream that just ends lost its client
                log.info("a client went away mid-session (session %s ended without a close)", session.session_id[:8])
                return
            except BadTensor as exc:
                await _send_quietly(writer, m.Error(message=str(exc), step=_step_of(exc.header)))
                continue
            message = m.from_header(header)
            if isinstance(message, m.Close):
                return
            if isinstance(message, m.Adapter):
                await self._on_adapter(session, message, tensor)
                continue
            if not isinstance(message, m.Step):
                raise RequestError(f"unexpected {message.kind!r} message inside a session")
            try:
                inputs = session.check_step(message, tensor)
                out, seconds = await self._run(self._forward, session, inputs)
            except RequestError as exc:
                await _write(writer, m.to_header(m.Error(message=str(exc), step=message.step)))
                continue
            if session.training:
                self._keep_graph(inputs)
                session.saved[message.step] = inputs
            else:
                session.length += inputs.hidden.shape[1]
            self.tokens_done += inputs.hidden.shape[0] * inputs.hidden.shape[1]
            timings = [*message.timings, (self.peer_id, seconds)]
            if session.downstream is not None:
                onward = m.to_header(dataclasses.replace(message, timings=timings))
                await self._send_onward(session, onward, session.pack(out))
            else:
                await _write(session.sink, m.to_header(m.Result(message.step, timings)), session.pack(out))

    async def _on_adapter(self, session: Session, message: m.Adapter, flat: torch.Tensor | None) -> None:
        """Keep this stage's part of the session's parameters; pass the rest on. A bad adapter ends
        the session (its steps would run on the wrong parameters)."""
        rest = session.set_adapter(message, flat)
        if not rest:
            return
        if session.downstream is None:
            raise RequestError(f"adapter parameter {next(iter(rest))} is for a layer past the end of this route")
        entries = [(name, list(value.shape)) for name, value in rest.items()]
        onward = m.Adapter(message.digest, message.scaling, entries)
        await self._send_onward(session, m.to_header(onward), pack(flatten(list(rest.values()))))

    @staticmethod
    async def _send_onward(session: Session, header: dict, payload) -> None:
        """A write to a next hop that died names that hop, so the client routes around it rather than
        giving up on the session."""
        try:
            await write_frame(session.downstream, header, payload)
        except (ConnectionError, RuntimeError) as exc:  # RuntimeError: uvloop's write on a closed transport
            raise PeerFailed(f"the next hop {session.next_peer} closed the session: {exc}", session.next_peer) from exc

    async def _run(self, fn, session: Session, inputs: StepInputs, *rest) -> tuple[object, float]:
        t0 = time.perf_counter()
        if self._runs_inline(session, inputs):
            out = fn(session, inputs, *rest)
        else:
            self._queued += 1
            try:
                out = await asyncio.get_running_loop().run_in_executor(self._compute, fn, session, inputs, *rest)
            finally:
                self._queued -= 1
        session.compute_seconds = time.perf_counter() - t0
        return out, session.compute_seconds

    def _runs_inline(self, session: Session, inputs: StepInputs) -> bool:
        """A decoding step of a token or two runs on the event loop's own thread: handing it to the
        compute thread and back wakes two threads, which cost 0.3-0.7 ms of a 12 ms step here
        (docs/benchmarks.md). Only while the compute thread is idle, because steps must not
        interleave: an adapter hooks the shared module for the length of its step."""
        rows = inputs.hidden.shape[0] * inputs.hidden.shape[1]
        return not session.training and self._queued == 0 and rows <= SMALL_STEP_ROWS

    def _threads_for(self, hidden: torch.Tensor) -> None:
        """Runs just before each step; steps never overlap, so torch's process-wide setting is theirs."""
        rows = hidden.shape[0] * hidden.shape[1]
        threads = self._decode_threads if rows <= SMALL_STEP_ROWS else self._all_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def _keep_graph(self, inputs: StepInputs) -> None:
        if inputs.graph is not None and self.graph_bytes + inputs.graph.nbytes > self.training_memory:
            inputs.graph = None  # its memory goes now; the backward pass will recompute
        self.graph_bytes += 0 if inputs.graph is None else inputs.graph.nbytes

    def _release_graph(self, inputs: StepInputs) -> None:
        if inputs.graph is not None:
            self.graph_bytes -= inputs.graph.nbytes
            inputs.graph = None

    def _forward(self, session: Session, inputs: StepInputs) -> torch.Tensor:
        self._threads_for(inputs.hidden)
        stage = session.stage
        if not session.training:
            return stage.forward(inputs.hidden, session.length, session.cache, inputs.mask, inputs.positions, inputs.adapter)
        if self.graph_bytes >= self.training_memory:  # no room for a graph: the backward pass recomputes
            return stage.forward(inputs.hidden, 0, None, inputs.mask, inputs.positions, inputs.adapter)
        inputs.graph = stage.forward_for_backward(inputs.hidden, inputs.mask, inputs.positions, inputs.adapter)
        return inputs.graph.output.detach().cpu()

    def _backward(self, session: Session, inputs: StepInputs, grad: torch.Tensor):
        self._threads_for(inputs.hidden)
        stage = session.stage
        graph = inputs.graph or stage.forward_for_backward(inputs.hidden, inputs.mask, inputs.positions, inputs.adapter)
        return stage.backward(graph, grad)

    async def _on_backward(self, session_id: str, message: m.Backward, grad: torch.Tensor | None, reply) -> None:
        """Compute a step's input gradient and send it upstream; a bad one answers with an Error."""
        session = self.sessions.get(session_id)
        if session is None:
            await _send_quietly(reply, m.Error(message=f"backward: unknown session {session_id}", step=message.step))
            return
        try:
            inputs, grad = session.take_saved(message.step, grad)
            try:
                (grad_in, param_grads), seconds = await self._run(self._backward, session, inputs, grad)
            finally:
                self._release_graph(inputs)
        except RequestError as exc:
            await _send_quietly(session.upstream, m.Error(message=str(exc), step=message.step))
            return
        if param_grads:  # before the input's gradient, so the client has them all when that comes
            entries = [(name, list(g.shape)) for name, g in zip(inputs.adapter.names, param_grads)]
            header = m.to_header(m.ParamGrads(message.step, entries))
            await _write(session.upstream, header, pack(flatten(param_grads)))
        timings = [*message.timings, (self.peer_id, seconds)]
        await _write(session.upstream, m.to_header(m.Backward(message.step, timings)), session.pack(grad_in, upstream=True))

    async def _serve_gradients(self, session_id: str, reader, writer) -> None:
        """On the client's stream to the last hop: take gradients until the client closes it."""
        while True:
            try:
                header, tensor = await read_frame(reader)
            except BadTensor as exc:
                await _send_quietly(writer, m.Error(message=str(exc), step=_step_of(exc.header)))
                continue
            except (EOFError, ConnectionError):
                return
            message = m.from_header(header)
            if not isinstance(message, m.Backward):
                raise RequestError(f"unexpected {message.kind!r} message on a result stream")
            await self._on_backward(session_id, message, tensor, writer)

    async def _relay(self, session: Session, downstream_reader, next_peer: str) -> None:
        """From the next hop: gradients to compute on, and errors and notices to pass back to the client."""
        try:
            while True:
                try:
                    header, tensor = await read_frame(downstream_reader)
                    if header.get("kind") == m.Backward.kind:
                        await self._on_backward(session.session_id, m.from_header(header), tensor, session.upstream)
                    else:  # the hops after us report to the client through us
                        await _write(session.upstream, header, None if tensor is None else pack(tensor))
                except FrameError:
                    raise  # the stream is out of step: it ends below
                except RequestError as exc:  # one bad gradient or message costs its step only
                    step = _step_of(exc.header) if isinstance(exc, BadTensor) else -1
                    await _send_quietly(session.upstream, m.Error(message=str(exc), step=step))
        except (EOFError, FrameError, ConnectionError):
            await _send_quietly(
                session.upstream, m.Error(message=f"the next hop {next_peer} closed the session", failed_peer=next_peer)
            )


def _step_of(header: dict) -> int:
    step = header.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


async def _write(writer: asyncio.StreamWriter, header: dict, payload=None) -> None:
    """A frame towards the client (or the hop before us), which may have gone: its closed connection
    is a ConnectionError here, whatever raised it (uvloop raises RuntimeError, TLS an OSError)."""
    try:
        await write_frame(writer, header, payload)
    except ConnectionError:
        raise
    except (OSError, RuntimeError) as exc:
        raise ConnectionResetError(f"the connection is closed: {exc}") from exc


async def _send_quietly(writer: asyncio.StreamWriter, message) -> None:
    try:
        await _write(writer, m.to_header(message))
    except ConnectionError:
        pass
