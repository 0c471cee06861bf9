"""An inference session through a route of peers: hidden states in at the first hop, out at the last."""

from __future__ import annotations

import asyncio
import uuid

import torch
from hivemind.p2p import P2P, PeerID

from p2pfusion.dht.records import PeerRecord
from p2pfusion.errors import RequestError, RouteError
from p2pfusion.net import messages as m
from p2pfusion.net.framing import FrameError, read_frame, write_frame

STEP_TIMEOUT = 60.0


class InferenceSession:
    def __init__(self, p2p: P2P, route: list[PeerRecord], max_length: int):
        self.p2p = p2p
        self.route = route
        self.max_length = max_length
        self.session_id = uuid.uuid4().hex
        self.position = 0
        self._step = 0
        self._head = None
        self._sink = None
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._readers: list[asyncio.Task] = []

    async def _connect(self, record: PeerRecord):
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(
                PeerID.from_base58(record.peer_id), m.PROTOCOL
            )
        except Exception as exc:
            raise RouteError(f"peer {record.peer_id} ({record.start}:{record.end}) unreachable: {exc}") from exc
        return reader, writer

    async def _expect_ack(self, reader) -> None:
        header, _ = await asyncio.wait_for(read_frame(reader), STEP_TIMEOUT)
        reply = m.from_header(header)
        if isinstance(reply, m.Error):
            raise RouteError(reply.message)

    async def open(self) -> "InferenceSession":
        sink_reader, self._sink = await self._connect(self.route[-1])
        await write_frame(self._sink, m.to_header(m.Subscribe(self.session_id)))
        await self._expect_ack(sink_reader)
        head_reader, self._head = await self._connect(self.route[0])
        hops = [m.Hop(r.peer_id, r.maddrs, r.start, r.end) for r in self.route]
        await write_frame(self._head, m.to_header(m.Open(self.session_id, self.max_length, hops)))
        await self._expect_ack(head_reader)
        self._readers = [asyncio.create_task(self._pump(r)) for r in (sink_reader, head_reader)]
        return self

    async def _pump(self, reader) -> None:
        try:
            while True:
                self._inbox.put_nowait(await read_frame(reader))
        except (EOFError, FrameError, ConnectionError) as exc:
            self._inbox.put_nowait(({"kind": "error", "message": f"connection to the swarm lost: {exc!r}"}, None))

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Send hidden states for the next positions; get the last stage's output for them."""
        if self.position + hidden.shape[1] > self.max_length:
            raise RequestError(f"session would reach {self.position + hidden.shape[1]} tokens, past its max length {self.max_length}")
        self._step += 1
        await write_frame(self._head, m.to_header(m.Step(step=self._step)), hidden)
        while True:
            header, tensor = await asyncio.wait_for(self._inbox.get(), STEP_TIMEOUT)
            reply = m.from_header(header)
            if isinstance(reply, m.Error):
                raise RouteError(f"swarm error: {reply.message}")
            if isinstance(reply, m.Result) and reply.step == self._step:
                self.position += hidden.shape[1]
                return tensor

    async def close(self) -> None:
        for task in self._readers:
            task.cancel()
        for writer in (self._head, self._sink):
            if writer is not None:
                try:
                    if writer is self._head:
                        await write_frame(writer, m.to_header(m.Close()))
                    writer.close()
                except (ConnectionError, RuntimeError):
                    pass
