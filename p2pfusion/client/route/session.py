"""An inference session through one route of peers: hidden states in at the first hop, out at the last.

It reports a dead peer as PeerFailed (naming it when it can), and remembers peers that announced
they are leaving; `p2pfusion.client.route.failover` builds a new route and replays around both.
Inference and training sessions (those with backward passes) both run on one. What
the hops send back is weighed by `p2pfusion.client.route.claims`: results only from the last hop, on
the stream to it; a claim that some peer failed or is leaving only from that peer, or once the
client's own ping confirms it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextvars import ContextVar

import torch

from p2pfusion.client.route.pings import Answer, ping
from p2pfusion.client.route.claims import FalseClaim, Stream, admitted, blamed, claim_subject, needs_ping
from p2pfusion.dht.records import PeerRecord
from p2pfusion.errors import PeerFailed, RequestError
from p2pfusion.models.tuning import layer_of
from p2pfusion.net import messages as m
from p2pfusion.net.codecs import pack
from p2pfusion.client.route.params import SessionParams
from p2pfusion.client.route.pieces import chunk_sizes
from p2pfusion.client.route.receipts import SignedSteps
from p2pfusion.client.route.tasks import all_or_first_error
from p2pfusion.net.compression import AUTO, Compression, LinkSpeed, Purpose, choose_codec
from p2pfusion.net.framing import BadTensor, FrameError, FrameLimits, read_frame, write_frame
from p2pfusion.net.links import LinkBook
from p2pfusion.net.payloads import mask_to_wire, positions_to_wire, unflatten
from p2pfusion.net.receipts import RECEIPT_BYTES
from p2pfusion.net.transport import Transport

log = logging.getLogger(__name__)

# a dial, direct or through libp2p: a peer that takes longer costs its session, not a minute
# Whom the sessions opened in this context serve, when one client process serves several people
# (the HTTP API sets it per request): peers share this client's compute fairly among them (the
# Open's `client` claim divides only this client's own share). A context variable, so that the
# sessions a generation opens, fails over to or checks with all carry it.
serving: ContextVar[str | None] = ContextVar("serving", default=None)
OPEN_TIMEOUT = 5.0
ACK_TIMEOUT = 15.0  # the first hop acknowledges once every hop of the chain has opened the next
STEP_TIMEOUT = 60.0
# What a peer's reply may hold: a step's output or gradient (MAX_STEP_TOKENS positions of a
# hidden size up to 16,384, float32), or an adapter's gradients, of the same order at most.
MAX_REPLY_BYTES = m.MAX_STEP_TOKENS * 16384 * 4
REPLY_LIMITS = FrameLimits(header=(1 << 20) + m.MAX_ROUTE * RECEIPT_BYTES, body=MAX_REPLY_BYTES, decoded=MAX_REPLY_BYTES, tensor_kinds=m.TENSOR_KINDS)


class RouteSession:
    def __init__(
        self,
        transport: Transport,
        route: list[PeerRecord],
        length: int,
        compression: Compression = AUTO,
        links: LinkBook | None = None,
        purpose: Purpose = Purpose.INFERENCE,
        batch: int = 1,
    ):
        self.transport = transport
        self.route = route
        self.length = length  # the most positions it holds
        self.compression = compression
        self.links = links
        self.purpose = purpose
        self.batch = batch  # the most sequences a step carries: each hop reserves KV cache for as many
        self.first_link: LinkSpeed | None = None  # picks the codec of the hidden states we send
        self.last_link: LinkSpeed | None = None  # and of the gradients
        self.session_id = uuid.uuid4().hex
        self.position = 0
        self._keep: int | None = None  # positions the hops keep before the next step (`keep`)
        self.leaving: set[str] = set()  # peers of this route that asked us to move (confirmed)
        self.seconds = 0.0  # the last step's wall time, as this client saw it
        self.strays: dict[str, int] = {}  # peers that sent frames their stream may not carry: how many
        self.liars: set[str] = set()  # hops that passed on a claim the client's ping found false
        self.signed = SignedSteps(self.session_id, route)  # the hops' receipts of its steps
        self._step = 0
        self._sent_at: dict[int, float] = {}  # when each step awaiting its reply was sent
        self._head = None
        self._sink = None
        self.params_digest: str | None = None  # of the parameters the hops hold for this session
        self._param_grads: dict[int, dict[str, torch.Tensor]] = {}
        self._early: dict[tuple[str, int], torch.Tensor] = {}  # replies that came before they were awaited
        self._inbox: asyncio.Queue = asyncio.Queue()  # (message, tensor) the client accepts, in order
        self._readers: list[asyncio.Task] = []
        self._checks: set[asyncio.Task] = set()  # pings of claims, each queueing its verdict
        self._claimed: set[str] = set()  # peers some claim named

    async def _expect_ack(self, reader, stream: Stream) -> None:
        """The answer to Subscribe or Open; an error naming another peer is weighed like any claim."""
        record = self._end(stream)
        try:
            header, _ = await asyncio.wait_for(read_frame(reader, FrameLimits(tensor_kinds=frozenset())), ACK_TIMEOUT)
            reply = m.from_header(header)
        except (TimeoutError, EOFError, OSError, RequestError) as exc:
            raise PeerFailed(f"peer {record.peer_id} did not answer: {exc!r}", record.peer_id) from exc
        if isinstance(reply, m.Error):
            self._raise(await self._verdict(reply, stream))
        if not isinstance(reply, m.Ack):
            raise PeerFailed(f"peer {record.peer_id} answered {reply.kind!r} to the session's opening", record.peer_id)

    async def _dial(self, record: PeerRecord):
        return await self.transport.open(record.peer_id, record.data_addrs, m.PROTOCOL, OPEN_TIMEOUT)

    def _end(self, stream: Stream) -> PeerRecord:
        return self.route[0] if stream == Stream.HEAD else self.route[-1]

    async def _measure_links(self) -> None:
        """The links to the first hop (our inputs) and to the last (results and our gradients)."""
        if self.compression != AUTO or self.links is None:
            return
        first, last = self.route[0], self.route[-1]
        self.first_link, self.last_link = await asyncio.gather(
            self.links.get(first.peer_id, first.data_addrs), self.links.get(last.peer_id, last.data_addrs)
        )

    async def open(self) -> RouteSession:
        await self._measure_links()
        try:
            # the last hop pairs the two, whichever comes first (peer/sinks.py)
            sink_reader, head_reader = await all_or_first_error([self._subscribe(), self._open_head()])
        except BaseException:
            await self.close()
            raise
        self._readers = [
            asyncio.create_task(self._pump(sink_reader, Stream.SINK)),
            asyncio.create_task(self._pump(head_reader, Stream.HEAD)),
        ]
        return self

    async def _subscribe(self):
        """The result stream from the last hop, acknowledged; its reader."""
        reader, self._sink = await self._dial(self.route[-1])
        await self._write(self._sink, self.route[-1], m.to_header(m.Subscribe(self.session_id)))
        await self._expect_ack(reader, Stream.SINK)
        return reader

    async def _open_head(self):
        """The session, opened at the first hop and relayed by each hop to the next, acknowledged; its reader."""
        reader, self._head = await self._dial(self.route[0])
        hops = [m.Hop(r.peer_id, r.data_addrs, r.start, r.end) for r in self.route]
        opening = m.Open(
            self.session_id, self.length, hops, self.compression, self.purpose, self.first_link, self.last_link,
            self.batch, client=serving.get(),
        )
        await self._write(self._head, self.route[0], m.to_header(opening))
        await self._expect_ack(reader, Stream.HEAD)
        return reader

    async def _pump(self, reader, stream: Stream) -> None:
        """Take in what the stream's peer sends: frames this stream may carry, for steps sent;
        claims about other peers once judged (`_judge`). Anything else is dropped."""
        peer_id = self._end(stream).peer_id
        # any kind that carries a tensor may, so that one on the wrong stream is read whole and
        # dropped, with the stream still in step
        limits = REPLY_LIMITS
        try:
            while True:
                try:
                    header, tensor = await read_frame(reader, limits)
                except BadTensor as exc:
                    self._lost(peer_id, f"peer {peer_id} sent a tensor that does not decode: {exc}")
                    return
                try:
                    message = m.from_header(header)
                except RequestError as exc:
                    self._stray(peer_id, stream, header.get("kind"), f" ({exc})")
                    continue
                if not admitted(stream, message.kind) or not self._awaited(message, tensor):
                    self._stray(peer_id, stream, message.kind)
                elif claim_subject(message) not in (None, peer_id):
                    self._judge_once(message, stream)
                else:
                    self._inbox.put_nowait((message, tensor))
        except (EOFError, FrameError, OSError, RuntimeError) as exc:  # RuntimeError: uvloop on a closed transport
            self._lost(peer_id, f"connection to peer {peer_id} lost: {exc!r}")

    def _awaited(self, message, tensor: torch.Tensor | None) -> bool:
        """Replies only to steps this session sent, each with its tensor."""
        if not isinstance(message, (m.Result, m.Backward, m.ParamGrads)):
            return tensor is None
        return tensor is not None and 0 < message.step <= self._step

    def _lost(self, peer_id: str, why: str) -> None:
        self._inbox.put_nowait((m.Error(message=why, failed_peer=peer_id), None))

    def _stray(self, peer_id: str, stream: Stream, kind: object, why: str = "") -> None:
        """Drop a frame its stream may not carry; the peer at the stream's end answers for it."""
        if peer_id not in self.strays:
            log.warning("dropped a %r frame from peer %s on the %s stream, which may not carry it%s",
                        kind, peer_id, stream.value, why)
        self.strays[peer_id] = self.strays.get(peer_id, 0) + 1

    def _judge_once(self, message, stream: Stream) -> None:
        """Judge a claim about another peer in the background: one ping per peer named, however
        many claims name it (the first verdict stands for the session)."""
        subject = claim_subject(message)
        if subject in self._claimed:
            return
        self._claimed.add(subject)
        task = asyncio.create_task(self._judge(message, stream))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _judge(self, message, stream: Stream) -> None:
        self._inbox.put_nowait((await self._verdict(message, stream), None))

    async def _verdict(self, message, stream: Stream):
        """The message itself when its claim counts (it is about the stream's own peer, or our ping
        of the peer it names finds it gone or leaving); otherwise an Error naming the hop blamed."""
        route = [r.peer_id for r in self.route]
        via = 0 if stream == Stream.HEAD else len(route) - 1
        subject = claim_subject(message)
        if subject is None or subject == route[via]:
            return message
        if needs_ping(route, via, subject):
            answer, _ = await ping(self.transport, subject, self.route[route.index(subject)].data_addrs)
            if answer != Answer.SERVING:
                return message
            why = "which answers this client's ping"
        else:
            why = "which is not on this session's route"
        liar = blamed(route, via, subject)
        self.liars.add(liar)
        claim = "is leaving" if isinstance(message, m.Leaving) else "failed"
        return m.Error(message=f"peer {liar} passed on a false claim that peer {subject} {claim}, {why}", failed_peer=liar)

    def _raise(self, reply) -> None:
        if isinstance(reply, m.Error) and reply.failed_peer in self.liars:
            raise FalseClaim(reply.message, reply.failed_peer)
        m.raise_for_error(reply)

    def poll_notices(self) -> set[str]:
        """Take in `Leaving` notices that came between steps; other messages stay queued for step()."""
        kept = []
        while not self._inbox.empty():
            message, tensor = self._inbox.get_nowait()
            if isinstance(message, m.Leaving):
                self.leaving.add(message.peer_id)
            else:
                kept.append((message, tensor))
        for item in kept:
            self._inbox.put_nowait(item)
        return self.leaving

    async def set_params(self, params: SessionParams) -> None:
        """Give the hops this session's parameters; the steps after it use them."""
        await self._write(self._head, self.route[0], m.to_header(params.message), pack(params.flat))
        self.params_digest = params.digest

    async def step(
        self,
        hidden: torch.Tensor,
        timeout: float = STEP_TIMEOUT,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        together: m.Cohort | None = None,
    ) -> torch.Tensor:
        """Send hidden states for the next positions; get the last stage's output for them.
        `mask` covers the whole sequence so far [batch, length]; `positions` the new tokens;
        `together` the steps of other sessions sent with this one, which the hops batch it with."""
        training = self.purpose == Purpose.TRAINING
        offset = 0 if training else self.position
        if offset + hidden.shape[1] > self.length:
            raise RequestError(f"session would reach {offset + hidden.shape[1]} tokens, past its length {self.length}")
        t0 = time.perf_counter()
        # a training step is one whole sequence: its backward pass takes it in one piece
        sizes = [hidden.shape[1]] if training else chunk_sizes(hidden.shape[1], len(self.route))
        steps, end = [], offset
        keep, self._keep = self._keep, None
        for piece in hidden.split(sizes, dim=1):  # all sent at once: the hops overlap on them
            begin, end = end, end + piece.shape[1]
            piece_positions = None if positions is None else positions[:, begin - offset:end - offset]
            steps.append(await self.submit(piece, None if mask is None else mask[:, :end], piece_positions, keep, together))
            keep = None
        outputs = [await self._reply(m.Result, timeout, step) for step in steps]
        if not training:
            self.position += hidden.shape[1]
        self.seconds = time.perf_counter() - t0
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def keep(self, length: int) -> None:
        """Drop the positions past `length` from the hops' caches (rejected drafts): the next step
        tells them, and starts there."""
        if length < self.position:
            self.position = length
            self._keep = length if self._keep is None else min(self._keep, length)
            self.signed.keep(length)

    async def submit(
        self, hidden: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
        keep: int | None = None, together: m.Cohort | None = None,
    ) -> int:
        """Send one step without waiting for it; `result` waits. Returns the step's number."""
        self._step += 1
        message = m.Step(
            step=self._step,
            mask=None if mask is None else mask_to_wire(mask),
            positions=None if positions is None else positions_to_wire(positions),
            params=self.params_digest,
            keep=keep,
            cohort=together,
        )
        self._sent_at[self._step] = time.perf_counter()
        await self._send(self._head, self.route[0], message, hidden, self.first_link)
        return self._step

    async def result(self, step: int, timeout: float = STEP_TIMEOUT) -> torch.Tensor:
        output = await self._reply(m.Result, timeout, step)
        self._timed(step)
        return output

    def _timed(self, step: int) -> None:
        sent = self._sent_at.pop(step, None)
        if sent is not None:
            self.seconds = time.perf_counter() - sent

    async def submit_backward(self, step: int, grad: torch.Tensor) -> None:
        """Send the gradient of a training step's output; `backward_result` waits for the rest."""
        if self.purpose != Purpose.TRAINING:
            raise RequestError("backward needs a session opened for training")
        self._param_grads.pop(step, None)
        self._sent_at[step] = time.perf_counter()
        await self._send(self._sink, self.route[-1], m.Backward(step=step), grad, self.last_link)

    async def backward_result(
        self, step: int, timeout: float = STEP_TIMEOUT
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The gradients of the step's input and of the session's parameters."""
        grad_input = await self._reply(m.Backward, timeout, step)
        if not bool(torch.isfinite(grad_input).all()):  # the first hop computed it from a gradient it checked
            first = self.route[0].peer_id
            raise PeerFailed(f"peer {first} sent an input gradient with NaN or infinity for step {step}", first)
        self._timed(step)
        return grad_input, self._param_grads.pop(step, {})

    async def backward(
        self, grad: torch.Tensor, step: int | None = None, timeout: float = STEP_TIMEOUT
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        step = self._step if step is None else step
        await self.submit_backward(step, grad)
        return await self.backward_result(step, timeout)

    async def _send(self, writer, record: PeerRecord, message, tensor: torch.Tensor, link: LinkSpeed | None) -> None:
        # in training, a transfer's budget is a hop's share of the last step's time, as this client timed it
        training = self.purpose == Purpose.TRAINING and self.seconds > 0
        budget = self.seconds / len(self.route) if training else None
        choice = choose_codec(link, tensor.numel() * 4, self.purpose, self.compression, budget)
        if isinstance(message, m.Step):
            self.signed.sent(message.step, choice.codec)
        await self._write(writer, record, m.to_header(message), pack(tensor, choice.codec, choice.k))

    @staticmethod
    async def _write(writer, record: PeerRecord, header: dict, payload=None) -> None:
        try:
            await write_frame(writer, header, payload)
        except (OSError, RuntimeError) as exc:  # RuntimeError: uvloop's write on a closed transport
            raise PeerFailed(f"peer {record.peer_id} closed the session: {exc!r}", record.peer_id) from exc

    async def _reply(self, kind: type, timeout: float, step: int) -> torch.Tensor:
        """Wait for the `kind` reply to `step`, taking in notices and parameter gradients, keeping
        replies to other steps, and raising errors on the way."""
        early = self._early.pop((kind.kind, step), None)
        if early is not None:
            return early
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply, tensor = await asyncio.wait_for(self._inbox.get(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                raise PeerFailed(f"the swarm did not answer within {timeout:.0f} s", None) from None
            RouteSession._TAKE[type(reply)](self, reply, tensor)
            early = self._early.pop((kind.kind, step), None)
            if early is not None:
                return early

    def _take_leaving(self, reply: m.Leaving, _tensor) -> None:
        self.leaving.add(reply.peer_id)

    def _take_error(self, reply: m.Error, _tensor) -> None:
        self._raise(reply)

    def _take_param_grads(self, reply: m.ParamGrads, tensor: torch.Tensor) -> None:
        try:
            values = unflatten(tensor, [shape for _, shape in reply.entries])
        except RequestError as exc:  # hops relay them unchecked: the one with those layers is to blame
            sender = self._hop_with(reply.entries[0][0] if reply.entries else "")
            raise PeerFailed(f"peer {sender} sent bad adapter gradients for step {reply.step}: {exc}", sender) from None
        self._param_grads.setdefault(reply.step, {}).update(zip([name for name, _ in reply.entries], values))

    def _hop_with(self, name: str) -> str:
        """The peer on this route that computes parameter `name`'s layer (the first hop if none)."""
        try:
            layer = layer_of(name)
        except RequestError:
            return self.route[0].peer_id
        return next((r for r in self.route if r.start <= layer < r.end), self.route[0]).peer_id

    def _take_output(self, reply: m.Result | m.Backward, tensor: torch.Tensor) -> None:
        self._early[(reply.kind, reply.step)] = tensor
        if isinstance(reply, m.Result):
            self.signed.take(reply.receipts, reply.certs)

    # what each kind the streams admit (client/route/claims.py) does on its way to a step's reply
    _TAKE = {m.Leaving: _take_leaving, m.Error: _take_error, m.ParamGrads: _take_param_grads,
             m.Result: _take_output, m.Backward: _take_output}

    async def close(self) -> None:
        for task in [*self._readers, *self._checks]:
            task.cancel()
        for writer in (self._head, self._sink):
            if writer is not None:
                try:
                    if writer is self._head:
                        await write_frame(writer, m.to_header(m.Close()))
                    writer.close()
                except (OSError, RuntimeError):
                    pass
