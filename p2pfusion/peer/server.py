"""Serve one pipeline stage: inference sessions with a KV cache each, pushed on to the next hop.

A bad request fails only its own session (or only its own step, when the stream is still
readable); every other session on this peer goes on. See p2pfusion.net.messages for the protocol.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from p2pfusion.errors import PeerFailed, RequestError
from p2pfusion.models.stage import Stage
from p2pfusion.net import messages as m
from p2pfusion.net.codecs import Packed, pack
from p2pfusion.net.compression import AUTO, LinkSpeed, choose_codec
from p2pfusion.net.framing import BadTensor, FrameError, read_frame, write_frame
from p2pfusion.net.links import LinkBook
from p2pfusion.net.transport import Transport

log = logging.getLogger(__name__)

SUBSCRIBE_WAIT = 10.0
SMALL_STEP_ROWS = 8  # steps of at most this many positions (batch x tokens) run on `decode_threads`


@dataclass
class Session:
    session_id: str
    max_length: int
    stage: Stage  # kept per session: sessions opened before a move finish on the old layers
    cache: object
    upstream: asyncio.StreamWriter
    compression: str = AUTO
    link: LinkSpeed | None = None  # to the next hop, or to the client from the last hop
    length: int = 0
    downstream: asyncio.StreamWriter | None = None
    sink: asyncio.StreamWriter | None = None
    relay: asyncio.Task | None = field(default=None, repr=False)


class StageServer:
    def __init__(
        self,
        stage: Stage,
        transport: Transport,
        links: LinkBook,
        max_length: int = 2048,
        compression: str = AUTO,
        decode_threads: int | None = None,
    ):
        self.stage = stage
        self.transport = transport
        self.links = links
        self.compression = compression  # what this peer's operator forces, unless the client does
        self.peer_id = transport.peer_id
        self.max_length = max_length
        self.tokens_done = 0  # tokens computed since start, for the load this peer announces
        self.sessions: dict[str, Session] = {}
        self._sinks: dict[str, asyncio.StreamWriter] = {}
        self._sink_ready: dict[str, asyncio.Event] = {}
        # One compute thread: torch already uses every core per op, and steps must not interleave.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")
        self._all_threads = torch.get_num_threads()
        self._decode_threads = decode_threads or self._all_threads
        self.draining = False

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
        except Exception as exc:  # a bug or a broken connection must cost one request, not the peer
            log.exception("request failed")
            await _send_quietly(writer, m.Error(message=f"internal error on peer: {exc}"))
        finally:
            writer.close()

    async def _serve_subscriber(self, msg: m.Subscribe, reader, writer) -> None:
        self._sinks[msg.session_id] = writer
        self._sink_ready.setdefault(msg.session_id, asyncio.Event()).set()
        try:
            await write_frame(writer, m.to_header(m.Ack()))
            await reader.read()  # the client closes this stream when its session ends
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
        compression = msg.compression if msg.compression != AUTO else self.compression
        session = Session(msg.session_id, msg.max_length, self.stage, self.stage.new_cache(), writer, compression)
        self.sessions[msg.session_id] = session
        try:
            await self._connect_onward(session, msg, writer)
            await write_frame(writer, m.to_header(m.Ack()))
            await self._run_steps(session, reader, writer)
        finally:
            self.sessions.pop(msg.session_id, None)
            if session.relay is not None:
                session.relay.cancel()
            if session.downstream is not None:
                await _send_quietly(session.downstream, m.Close())
                session.downstream.close()

    async def _connect_onward(self, session: Session, msg: m.Open, upstream) -> None:
        if len(msg.route) == 1:
            ready = self._sink_ready.setdefault(msg.session_id, asyncio.Event())
            try:
                await asyncio.wait_for(ready.wait(), SUBSCRIBE_WAIT)
            except TimeoutError:
                raise RequestError("open: the client opened no output stream to the last hop") from None
            session.sink = self._sinks[msg.session_id]
            session.link = m.client_link(msg)
            return
        nxt = msg.route[1]
        if session.compression == AUTO:
            session.link = await self.links.get(nxt.peer_id, nxt.data_addrs)
        try:
            reader, writer = await self.transport.open(nxt.peer_id, nxt.data_addrs, m.PROTOCOL)
            onward = m.Open(
                msg.session_id, msg.max_length, msg.route[1:], msg.compression, msg.client_rtt, msg.client_bandwidth
            )
            await write_frame(writer, m.to_header(onward))
            header, _ = await read_frame(reader)
        except Exception as exc:
            raise PeerFailed(f"next hop {nxt.peer_id} ({nxt.start}:{nxt.end}) unreachable: {exc}", nxt.peer_id) from exc
        m.raise_for_error(m.from_header(header))
        session.downstream = writer
        session.relay = asyncio.create_task(_relay_errors(reader, upstream, nxt.peer_id))

    async def _run_steps(self, session: Session, reader, writer) -> None:
        while True:
            try:
                header, tensor = await read_frame(reader)
            except EOFError:
                return
            except BadTensor as exc:
                step = exc.header.get("step")
                await write_frame(writer, m.to_header(m.Error(message=str(exc), step=step if isinstance(step, int) else -1)))
                continue
            message = m.from_header(header)
            if isinstance(message, m.Close):
                return
            if not isinstance(message, m.Step):
                raise RequestError(f"unexpected {message.kind!r} message inside a session")
            try:
                hidden = self._check_hidden(session, tensor)
                t0 = time.perf_counter()
                out = await asyncio.get_running_loop().run_in_executor(self._compute, self._forward, session, hidden)
                seconds = time.perf_counter() - t0
            except RequestError as exc:
                await write_frame(writer, m.to_header(m.Error(message=str(exc), step=message.step)))
                continue
            session.length += hidden.shape[1]
            self.tokens_done += hidden.shape[0] * hidden.shape[1]
            timings = [*message.timings, (self.peer_id, seconds)]
            payload = self._pack(session, out)
            if session.downstream is not None:
                await write_frame(session.downstream, m.to_header(m.Step(step=message.step, timings=timings)), payload)
            else:
                await write_frame(session.sink, m.to_header(m.Result(step=message.step, timings=timings)), payload)

    def _forward(self, session: Session, hidden: torch.Tensor) -> torch.Tensor:
        """Runs on the compute thread, whose torch thread count is its own to set."""
        rows = hidden.shape[0] * hidden.shape[1]
        threads = self._decode_threads if rows <= SMALL_STEP_ROWS else self._all_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return session.stage.forward(hidden, session.length, session.cache)

    @staticmethod
    def _pack(session: Session, out: torch.Tensor) -> Packed:
        choice = choose_codec(session.link, out.numel() * 4, forced=session.compression)
        return pack(out, choice.codec, choice.k)

    def _check_hidden(self, session: Session, tensor: torch.Tensor | None) -> torch.Tensor:
        stage = session.stage
        if tensor is None:
            raise RequestError("step carries no hidden states")
        if tensor.dtype != stage.dtype:
            raise RequestError(f"hidden states must be {stage.dtype}, got {tensor.dtype}")
        if tensor.dim() != 3 or tensor.shape[0] < 1 or tensor.shape[1] < 1 or tensor.shape[2] != stage.hidden_size:
            raise RequestError(
                f"hidden states must have shape [batch, tokens, {stage.hidden_size}], got {list(tensor.shape)}"
            )
        if session.length + tensor.shape[1] > session.max_length:
            raise RequestError(
                f"session length {session.length + tensor.shape[1]} exceeds its max_length {session.max_length}"
            )
        if not torch.isfinite(tensor).all():
            raise RequestError("hidden states contain NaN or infinity")
        return tensor


async def _relay_errors(downstream_reader, upstream_writer, next_peer: str) -> None:
    """Pass errors and notices from later hops back toward the client; results go straight to it."""
    try:
        while True:
            header, _ = await read_frame(downstream_reader)
            await write_frame(upstream_writer, header)
    except (EOFError, FrameError, ConnectionError):
        await _send_quietly(
            upstream_writer, m.Error(message=f"the next hop {next_peer} closed the session", failed_peer=next_peer)
        )


async def _send_quietly(writer: asyncio.StreamWriter, message) -> None:
    try:
        await write_frame(writer, m.to_header(message))
    except (ConnectionError, RuntimeError):
        pass
