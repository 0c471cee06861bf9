"""An inference session through one route of peers: hidden states in at the first hop, out at the last.

It reports a dead peer as PeerFailed (naming it when it can), and remembers peers that announced
they are leaving; `p2pfusion.client.failover` builds a new route and replays around both.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import torch

from p2pfusion.dht.records import PeerRecord
from p2pfusion.errors import PeerFailed, RequestError
from p2pfusion.net import messages as m
from p2pfusion.net.codecs import pack
from p2pfusion.net.compression import AUTO, LinkSpeed, Purpose, choose_codec
from p2pfusion.net.framing import FrameError, read_frame, write_frame
from p2pfusion.net.links import LinkBook
from p2pfusion.net.payloads import mask_to_wire, positions_to_wire, unflatten
from p2pfusion.net.transport import Transport

OPEN_TIMEOUT = 15.0
STEP_TIMEOUT = 60.0
MIN_CHUNK_TOKENS = 64  # smaller pieces make matrix products less efficient than the overlap gains


def chunk_sizes(tokens: int, hops: int) -> list[int]:
    """How to split an inference step's tokens so the hops work on pieces at once, as a pipeline:
    hop 2 computes the first piece while hop 1 computes the second. Pieces of at least
    MIN_CHUNK_TOKENS, no more pieces than hops (beyond that they only add per-step costs)."""
    pieces = max(1, min(hops, tokens // MIN_CHUNK_TOKENS))
    return [tokens // pieces + (i < tokens % pieces) for i in range(pieces)]


class InferenceSession:
    def __init__(
        self,
        transport: Transport,
        route: list[PeerRecord],
        max_length: int,
        compression: str = AUTO,
        links: LinkBook | None = None,
        purpose: Purpose = Purpose.INFERENCE,
    ):
        self.transport = transport
        self.route = route
        self.max_length = max_length
        self.compression = compression
        self.links = links
        self.purpose = purpose
        self.first_link: LinkSpeed | None = None  # picks the codec of the hidden states we send
        self.last_link: LinkSpeed | None = None  # and of the gradients
        self.session_id = uuid.uuid4().hex
        self.position = 0
        self.leaving: set[str] = set()  # peers of this route that asked us to move
        self.timings: list[tuple[str, float]] = []  # the last step's compute seconds per hop
        self.seconds = 0.0  # the last step's wall time, as this client saw it
        self._step = 0
        self._head = None
        self._sink = None
        self.adapter: str | None = None  # digest of the parameters the hops hold for this session
        self._param_grads: dict[int, dict[str, torch.Tensor]] = {}
        self._early: dict[tuple[str, int], tuple] = {}  # replies that came before they were awaited
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._readers: list[asyncio.Task] = []

    async def _connect(self, record: PeerRecord):
        try:
            reader, writer = await self.transport.open(record.peer_id, record.data_addrs, m.PROTOCOL, OPEN_TIMEOUT)
        except Exception as exc:  # libp2p dials fail with assorted types; any of them means that peer is gone
            raise PeerFailed(f"peer {record.peer_id} ({record.start}:{record.end}) unreachable: {exc!r}", record.peer_id) from exc
        return reader, writer

    async def _expect_ack(self, reader, record: PeerRecord) -> None:
        try:
            header, _ = await asyncio.wait_for(read_frame(reader), OPEN_TIMEOUT)
        except (TimeoutError, EOFError, FrameError, ConnectionError) as exc:
            raise PeerFailed(f"peer {record.peer_id} did not answer: {exc!r}", record.peer_id) from exc
        m.raise_for_error(m.from_header(header))

    async def _measure_links(self) -> None:
        """The links to the first hop (our inputs) and to the last (results and our gradients)."""
        if self.compression != AUTO or self.links is None:
            return
        first, last = self.route[0], self.route[-1]
        self.first_link, self.last_link = await asyncio.gather(
            self.links.get(first.peer_id, first.data_addrs), self.links.get(last.peer_id, last.data_addrs)
        )

    async def open(self) -> InferenceSession:
        await self._measure_links()
        try:
            sink_reader, self._sink = await self._connect(self.route[-1])
            await write_frame(self._sink, m.to_header(m.Subscribe(self.session_id)))
            await self._expect_ack(sink_reader, self.route[-1])
            head_reader, self._head = await self._connect(self.route[0])
            hops = [m.Hop(r.peer_id, r.data_addrs, r.start, r.end) for r in self.route]
            opening = m.Open(
                self.session_id, self.max_length, hops, self.compression, self.purpose, self.first_link, self.last_link
            )
            await write_frame(self._head, m.to_header(opening))
            await self._expect_ack(head_reader, self.route[0])
        except BaseException:
            await self.close()
            raise
        self._readers = [
            asyncio.create_task(self._pump(sink_reader, self.route[-1].peer_id)),
            asyncio.create_task(self._pump(head_reader, self.route[0].peer_id)),
        ]
        return self

    async def _pump(self, reader, peer_id: str) -> None:
        try:
            while True:
                self._inbox.put_nowait(await read_frame(reader))
        except (EOFError, FrameError, ConnectionError) as exc:
            message = f"connection to peer {peer_id} lost: {exc!r}"
            self._inbox.put_nowait((m.to_header(m.Error(message=message, failed_peer=peer_id)), None))

    def poll_notices(self) -> set[str]:
        """Take in `Leaving` notices that came between steps; other messages stay queued for step()."""
        kept = []
        while not self._inbox.empty():
            header, tensor = self._inbox.get_nowait()
            if header.get("kind") == m.Leaving.kind:
                self.leaving.add(m.from_header(header).peer_id)
            else:
                kept.append((header, tensor))
        for item in kept:
            self._inbox.put_nowait(item)
        return self.leaving

    async def set_adapter(self, message: m.Adapter, flat: torch.Tensor) -> None:
        """Give the hops this session's parameters; the steps after it use them."""
        try:
            await write_frame(self._head, m.to_header(message), pack(flat))
        except (ConnectionError, RuntimeError) as exc:
            raise PeerFailed(f"peer {self.route[0].peer_id} closed the session: {exc!r}", self.route[0].peer_id) from exc
        self.adapter = message.digest

    async def step(
        self,
        hidden: torch.Tensor,
        timeout: float = STEP_TIMEOUT,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Send hidden states for the next positions; get the last stage's output for them.
        `mask` covers the whole sequence so far [batch, length]; `positions` the new tokens."""
        training = self.purpose == Purpose.TRAINING
        offset = 0 if training else self.position
        if offset + hidden.shape[1] > self.max_length:
            raise RequestError(
                f"session would reach {offset + hidden.shape[1]} tokens, past its max length {self.max_length}"
            )
        t0 = time.perf_counter()
        # a training step is one whole sequence: its backward pass takes it in one piece
        sizes = [hidden.shape[1]] if training else chunk_sizes(hidden.shape[1], len(self.route))
        steps, end = [], offset
        for piece in hidden.split(sizes, dim=1):  # all sent at once: the hops overlap on them
            begin, end = end, end + piece.shape[1]
            piece_positions = None if positions is None else positions[:, begin - offset:end - offset]
            steps.append(await self.submit(piece, None if mask is None else mask[:, :end], piece_positions))
        outputs, timings = [], {}
        for step in steps:
            output, step_timings = await self._reply(m.Result, timeout, step)
            outputs.append(output)
            for peer_id, seconds in step_timings:  # per peer, summed over the pieces
                timings[peer_id] = timings.get(peer_id, 0.0) + seconds
        self.timings = list(timings.items())
        if not training:
            self.position += hidden.shape[1]
        self.seconds = time.perf_counter() - t0
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    async def submit(
        self, hidden: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> int:
        """Send one step without waiting for it; `result` waits. Returns the step's number."""
        self._step += 1
        message = m.Step(
            step=self._step,
            mask=None if mask is None else mask_to_wire(mask),
            positions=None if positions is None else positions_to_wire(positions),
            adapter=self.adapter,
        )
        await self._send(self._head, self.route[0], message, hidden, self.first_link)
        return self._step

    async def result(self, step: int, timeout: float = STEP_TIMEOUT) -> torch.Tensor:
        output, self.timings = await self._reply(m.Result, timeout, step)
        return output

    async def submit_backward(self, step: int, grad: torch.Tensor) -> None:
        """Send the gradient of a training step's output; `backward_result` waits for the rest."""
        if self.purpose != Purpose.TRAINING:
            raise RequestError("backward needs a session opened for training")
        self._param_grads.pop(step, None)
        await self._send(self._sink, self.route[-1], m.Backward(step=step), grad, self.last_link)

    async def backward_result(
        self, step: int, timeout: float = STEP_TIMEOUT
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The gradients of the step's input and of the session's adapter parameters."""
        grad_input, self.timings = await self._reply(m.Backward, timeout, step)
        return grad_input, self._param_grads.pop(step, {})

    async def backward(
        self, grad: torch.Tensor, step: int | None = None, timeout: float = STEP_TIMEOUT
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        step = self._step if step is None else step
        await self.submit_backward(step, grad)
        return await self.backward_result(step, timeout)

    async def _send(self, writer, record: PeerRecord, message, tensor: torch.Tensor, link: LinkSpeed | None) -> None:
        # in training, a transfer's budget is the slowest hop's compute time on the last step
        budget = max((s for _, s in self.timings), default=None) if self.purpose == Purpose.TRAINING else None
        choice = choose_codec(link, tensor.numel() * 4, self.purpose, self.compression, budget)
        try:
            await write_frame(writer, m.to_header(message), pack(tensor, choice.codec, choice.k))
        except (ConnectionError, RuntimeError) as exc:
            raise PeerFailed(f"peer {record.peer_id} closed the session: {exc!r}", record.peer_id) from exc

    async def _reply(self, kind: type, timeout: float, step: int) -> tuple[torch.Tensor, list[tuple[str, float]]]:
        """Wait for the `kind` reply to `step` (its tensor and its hops' timings), taking in notices
        and parameter gradients, keeping replies to other steps, and raising errors on the way."""
        early = self._early.pop((kind.kind, step), None)
        if early is not None:
            return early
        deadline = time.monotonic() + timeout
        while True:
            try:
                header, tensor = await asyncio.wait_for(self._inbox.get(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                raise PeerFailed(f"the swarm did not answer within {timeout:.0f} s", None) from None
            reply = m.from_header(header)
            if isinstance(reply, m.Leaving):
                self.leaving.add(reply.peer_id)
            elif isinstance(reply, m.Error):
                m.raise_for_error(reply)
            elif isinstance(reply, m.ParamGrads):
                values = unflatten(tensor, [shape for _, shape in reply.entries])
                self._param_grads.setdefault(reply.step, {}).update(zip([name for name, _ in reply.entries], values))
            elif isinstance(reply, (m.Result, m.Backward)):
                if isinstance(reply, kind) and reply.step == step:
                    return tensor, reply.timings
                self._early[(reply.kind, reply.step)] = (tensor, reply.timings)

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
