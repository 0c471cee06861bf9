"""Averaging a training run's pseudo-gradients with a named group of replicas, so that a minority of
bad members cannot steer the result: every member sends its tensors to every other, and each
combines all of them itself by a robust mean (net/robust.py).

A butterfly all-reduce (hivemind's) costs each member about twice its tensors' bytes whatever the
group's size, but hands each slice of the average to one member to compute: a bad member would
write its slice for everyone. Here each member sends and receives (n - 1) times its tensors'
bytes (n: the group's size; a stage has few replicas), and no member computes anything for another.

Who is in a group is the caller's to agree on (the run's driver names it, from the replicas its
charter lists: peer/run_owner.py); a stream counts as a member's only when it proved that
member's peer id. A round in which some member's tensors did not come, or came in the wrong
is an `AveragingFailed` on the members that missed them: their tensors are left as they were, and
the driver runs the round again with the members that answer. A member whose tensors came in the
wrong shapes, not finite, far larger than the others' or pointing away from them (net/robust.py),
is left out of the mean by every member alike.

A member that sent different tensors to different members would make them disagree. So each
member seals what it sends, with a signature over the tensors' digest, and once a member holds
every other's tensors it echoes the seals it received to all of them. A member that sealed two
digests in one round is left out by every member that sees both, which is every member whose
echoes came: two who got different tensors from it each show the other the proof. An echo cannot
frame an honest member (it would need that member's signature), and a seal that does not hold, or
does not match the tensors beside it, makes those tensors unusable, as malformed ones are
(net/seals.py). Echoes are waited for ECHO_WAIT at most: a member that sends one member its
other version only after the others stopped waiting parts them, and the one that sees both
seals returns the proof (`Averaged.two_faced`) for the run's driver, which convicts it and has
the parted replica copy the weights the others hold (client/run/driver.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

import torch

from p2pfusion.errors import PeerFailed, RequestError
from p2pfusion.net import messages as m
from p2pfusion.net import wire
from p2pfusion.net.clients import Source
from p2pfusion.net.codecs import pack, unpack
from p2pfusion.net.compression import Codec
from p2pfusion.net.framing import FrameError, FrameLimits, read_frame, write_frame
from p2pfusion.net.identity import PeerProof, ProofError, signed
from p2pfusion.net.robust import robust_mean
from p2pfusion.net.run_messages import MAX_PROOFS, TwoSeals
from p2pfusion.net.seals import Echoed, digest, equivocators, seal_message, sealer
from p2pfusion.net.transport import Transport

log = logging.getLogger(__name__)

Offload = Callable[..., Awaitable]  # runs fn(*args) off the event loop: asyncio.to_thread, or a thread per job

PROTOCOL = "p2pfusion.average.v3"
CODECS = {"none": Codec.NONE, "float16": Codec.FLOAT16}
START_WAIT = 30.0  # a member's tensors may come before this peer starts the round: they wait this long
# once a member holds every other's tensors, it waits this long for the others' echoes (each
# member sends its echo as soon as it holds them all, so only a member that never echoes costs it)
ECHO_WAIT = 5.0
MAX_TENSORS = 4096  # parameters of one stage
MAX_MEMBERS = 64
ENDED_KEPT = 256  # rounds this peer remembers having ended, to refuse their late frames at once
LIMITS = FrameLimits(header=65536, tensor_kinds=frozenset({"average_part"}))


class AveragingFailed(RequestError):
    """A round ended without every member's tensors here: the tensors are unchanged."""


class RoundEnded(RequestError):
    """A frame for a round this peer has ended: a member that stopped waiting for its sender."""


@dataclass(frozen=True)
class AveragePart:
    """One of a member's tensors for a round (the tensor travels beside the header)."""

    kind: ClassVar[str] = "average_part"
    namespace: Annotated[str, wire.Length(256)]
    group: Annotated[bytes, wire.Length(32, 1)]
    index: Annotated[int, wire.Bound(0, MAX_TENSORS - 1)]
    count: Annotated[int, wire.Bound(1, MAX_TENSORS)]


@dataclass(frozen=True)
class AverageSeal:
    """After a member's last part: the digest of the tensors it sent, signed (`seal_message`)."""

    kind: ClassVar[str] = "average_seal"
    digest: Annotated[bytes, wire.Length(32, 32)]
    proof: PeerProof


@dataclass(frozen=True)
class AverageEcho:
    """The seals a member received in a round, for every other member to compare with its own."""

    kind: ClassVar[str] = "average_echo"
    namespace: Annotated[str, wire.Length(256)]
    group: Annotated[bytes, wire.Length(32, 1)]
    seals: Annotated[list[Echoed], wire.Length(MAX_MEMBERS)]


PARTS = {kind.kind: kind for kind in (AveragePart, AverageSeal, AverageEcho)}


@dataclass(frozen=True)
class Averaged:
    tensors: list[torch.Tensor]
    left_out: list[str]  # members whose tensors the mean did not use
    two_faced: list[TwoSeals] = field(default_factory=list)  # proof against those who sealed two digests


class _Round:
    def __init__(self, group: bytes):
        self.group = group
        self.members: list[str] | None = None
        self.shapes: list[torch.Size] | None = None
        self.started = asyncio.Event()  # the members and shapes are known
        self.received: dict[str, list[torch.Tensor] | None] = {}
        self.seals: dict[str, tuple[bytes, PeerProof]] = {}  # member -> the digest it sealed here, and its seal
        self.complete = asyncio.Event()
        self.echoes: dict[str, list[Echoed]] = {}
        self.echoed = asyncio.Event()  # every other member's echo came

    def start(self, members: list[str], shapes: list[torch.Size], me: str) -> None:
        self.members, self.shapes = members, shapes
        self.others = [p for p in members if p != me]
        self.started.set()
        self._check()

    def deliver(self, sender: str, tensors: list[torch.Tensor] | None, seal: tuple[bytes, PeerProof] | None = None) -> None:
        """A member's tensors and seal, or None for a member whose tensors are unusable (left out of the mean)."""
        self.received[sender] = tensors
        if seal is not None:
            self.seals[sender] = seal
        self._check()

    def echo(self, sender: str, seals: list[Echoed]) -> None:
        self.echoes[sender] = seals
        self._check()

    def _check(self) -> None:
        if self.started.is_set() and all(p in self.received for p in self.others):
            self.complete.set()
        if self.started.is_set() and all(p in self.echoes for p in self.others):
            self.echoed.set()


async def _answer(writer, message) -> None:
    try:
        await write_frame(writer, m.to_header(message))
    except ConnectionError:  # the sender left: nothing to tell it
        pass


def _as_sent(tensor: torch.Tensor, codec: Codec) -> torch.Tensor:
    if codec == Codec.NONE:
        return tensor
    packed = pack(tensor, codec)
    return unpack(packed.spec, packed.body())


class GroupAverager:
    def __init__(self, transport: Transport, namespace: str, offload: Offload = asyncio.to_thread):
        self.transport = transport
        self.namespace = namespace  # the run's: two runs on one host never mix their rounds
        # runs the round's torch work off the event loop; a serving peer passes a thread that ends
        # with each job, so that its OpenMP pool does too (models/threads.py)
        self._offload = offload
        self._rounds: dict[bytes, _Round] = {}
        self._ended: OrderedDict[bytes, None] = OrderedDict()
        self.wire_bytes = 0  # tensor bytes this peer sent in its rounds, as encoded: summed over members, each byte once

    async def start(self) -> None:
        await self.transport.add_handler(PROTOCOL, self._receive)

    async def stop(self) -> None:
        await self.transport.remove_handler(PROTOCOL)

    async def average(
        self, group_id: bytes, tensors: Sequence[torch.Tensor], peers: Sequence[str], timeout: float,
        compression: str = "none",
    ) -> Averaged:
        """The group's robust mean of `tensors` (every member passes the same shapes), from the
        members named, this one included, and the members left out of it; AveragingFailed when
        some member's tensors did not come."""
        me = self.transport.peer_id
        if me not in peers:
            raise RequestError("averaging: this peer is not in the group it was asked to join")
        members = sorted(set(peers))
        # each member combines the others' tensors as they arrive, so its own as it sent them:
        # every member then combines the very same values
        local = [_as_sent(t.detach().float().cpu(), CODECS[compression]) for t in tensors]
        if len(members) == 1:
            return Averaged([t.clone() for t in local], [])
        if self.transport.identity is None:
            raise RequestError("averaging: this node has no identity to seal its tensors with")
        round_ = self._rounds.setdefault(group_id, _Round(group_id))
        round_.start(members, [t.shape for t in local], me)
        seal = await self._offload(self.seal, group_id, local)
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(self._send(p, group_id, local, compression, seal) for p in round_.others))
                await round_.complete.wait()
            await self._echo(round_)
        except TimeoutError as exc:
            missing = [p for p in round_.others if p not in round_.received]
            raise AveragingFailed(f"averaging round failed: no tensors from {', '.join(missing) or '?'} ({exc!r})") from exc
        finally:
            self._end(group_id)
        two_faced = equivocators(round_.seals, round_.echoes, self.namespace, group_id)
        usable = [p for p in members if p == me or (round_.received[p] is not None and p not in two_faced)]
        flat = [torch.cat([t.reshape(-1) for t in (local if p == me else round_.received[p])]) for p in usable]
        aggregate = await self._offload(robust_mean, flat)
        left_out = sorted(set(members) - set(usable)) + [usable[i] for i in aggregate.left_out]
        if two_faced:
            log.warning("averaging: left out %s, who sent different tensors to different members", ", ".join(sorted(two_faced)))
        if set(left_out) - set(two_faced):
            log.warning("averaging: left out %s (tensors malformed, not finite, far larger than the others' or "
                        "pointing away from them)",
                        ", ".join(p for p in left_out if p not in two_faced))
        parts = aggregate.value.split([t.numel() for t in local])
        proofs = [two_faced[p] for p in sorted(two_faced)][:MAX_PROOFS]
        return Averaged([part.view_as(t).clone() for part, t in zip(parts, local)], left_out, proofs)

    def seal(self, group_id: bytes, tensors: Sequence[torch.Tensor]) -> tuple[bytes, PeerProof]:
        """This peer's seal over `tensors` for a round: their digest, and its signature."""
        values = digest(tensors)
        return values, signed(self.transport.identity, seal_message(self.namespace, group_id, values))

    async def _echo(self, round_: _Round) -> None:
        """Show every other member the seals received here, and wait (ECHO_WAIT at most) for theirs."""
        echo = AverageEcho(self.namespace, round_.group, [Echoed(p, d, proof.sig) for p, (d, proof) in round_.seals.items()])
        await asyncio.gather(*(self._send_echo(p, echo) for p in round_.others))
        try:
            await asyncio.wait_for(round_.echoed.wait(), ECHO_WAIT)
        except TimeoutError:
            silent = [p for p in round_.others if p not in round_.echoes]
            log.info("averaging: no echo from %s within %.0f s; going on with the others'", ", ".join(silent), ECHO_WAIT)

    def _end(self, group_id: bytes) -> None:
        self._rounds.pop(group_id, None)
        self._ended[group_id] = None
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)

    async def _send(
        self, peer: str, group_id: bytes, tensors: list[torch.Tensor], compression: str, seal: tuple[bytes, PeerProof]
    ) -> None:
        """This peer's tensors and their seal to `peer`. A failure here is not this round's: what this
        peer averages depends only on what it receives (a member may refuse, and close, to break it)."""
        try:
            await self._send_all(peer, group_id, tensors, compression, seal)
        except (OSError, EOFError, FrameError, PeerFailed) as exc:
            log.info("averaging: could not send this peer's tensors to %s: %r", peer, exc)

    async def _send_all(
        self, peer: str, group_id: bytes, tensors: list[torch.Tensor], compression: str, seal: tuple[bytes, PeerProof]
    ) -> None:
        reader, writer = await self.transport.open(peer, [], PROTOCOL)  # libp2p, by peer id
        try:
            for index, tensor in enumerate(tensors):
                packed = pack(tensor, CODECS[compression])
                self.wire_bytes += packed.nbytes
                header = m.to_header(AveragePart(self.namespace, group_id, index, len(tensors)))
                await write_frame(writer, header, packed)
            await write_frame(writer, m.to_header(AverageSeal(*seal)))
            await self._acked(reader, peer, "tensors")
        finally:
            writer.close()

    async def _send_echo(self, peer: str, echo: AverageEcho) -> None:
        try:
            reader, writer = await self.transport.open(peer, [], PROTOCOL)
            try:
                await write_frame(writer, m.to_header(echo))
                await self._acked(reader, peer, "echo")
            finally:
                writer.close()
        except (OSError, EOFError, FrameError, PeerFailed) as exc:
            log.info("averaging: could not send this peer's echo to %s: %r", peer, exc)

    @staticmethod
    async def _acked(reader, peer: str, what: str) -> None:
        reply, _ = await read_frame(reader, LIMITS)
        if reply.get("kind") != m.Ack.kind:  # it leaves this peer out: the round goes on without its tensors
            # an echo only helps its receiver: one that came after the receiver ended is nothing wrong
            level = logging.INFO if what == "echo" else logging.WARNING
            log.log(level, "averaging: %s refused this peer's %s: %s", peer, what, str(reply.get("message"))[:200])

    async def _receive(self, reader, writer, source: Source) -> None:
        """A member's tensors for a round this peer runs (or is about to)."""
        joined: list[_Round] = []  # the round, once the sender proved a member of it
        try:
            await self._read_member(reader, source.peer, joined)
        except RoundEnded as exc:  # expected of a member slower than this one's waits
            log.info("averaging: refused a frame from %s: %s", source, exc)
            await _answer(writer, m.Error(message=str(exc)))
        except (RequestError, FrameError, TimeoutError) as exc:
            log.warning("averaging: refused tensors from %s: %s", source, exc)
            if joined:  # a member that sent what no member could use: every member leaves it out
                joined[0].deliver(source.peer, None)
            await _answer(writer, m.Error(message=str(exc)))
        except (EOFError, ConnectionError):
            pass
        else:
            await _answer(writer, m.Ack())
        writer.close()

    async def _read_member(self, reader, sender: str | None, joined: list[_Round]) -> None:
        tensors: list[torch.Tensor] = []
        round_: _Round | None = None
        while True:
            header, tensor = await asyncio.wait_for(read_frame(reader, LIMITS), START_WAIT)
            part = m.from_header(header, PARTS)
            if round_ is None:
                round_ = await self._member_of(part, sender)
                if isinstance(part, AverageEcho):
                    round_.echo(sender, part.seals)
                    return
                joined.append(round_)
            if isinstance(part, AverageSeal):
                if len(tensors) != len(round_.shapes):
                    raise RequestError("a seal before the last of the tensors")
                try:
                    sealed_by = sealer(part.proof, self.namespace, round_.group, part.digest)
                except ProofError as exc:
                    raise RequestError(str(exc)) from None
                if sealed_by != sender or part.digest != await self._offload(digest, tensors):
                    raise RequestError("the tensors' seal is not the sender's, or not of these tensors")
                round_.deliver(sender, tensors, (part.digest, part.proof))
                return
            if not isinstance(part, AveragePart) or part.index != len(tensors) or part.count != len(round_.shapes) or tensor is None:
                raise RequestError("tensors out of order, or not as many as this round averages")
            if tensor.shape != round_.shapes[part.index]:
                raise RequestError(f"tensor {part.index} has shape {list(tensor.shape)}, not {list(round_.shapes[part.index])}")
            tensors.append(tensor.float())

    async def _member_of(self, part, sender: str | None) -> _Round:
        """The round a stream's first frame is for, once it runs here and the sender is its member."""
        if not isinstance(part, (AveragePart, AverageEcho)):
            raise RequestError("a round's stream starts with a tensor or an echo")
        if part.namespace != self.namespace:
            raise RequestError(f"this peer averages for {self.namespace}, not {part.namespace[:100]}")
        if part.group in self._ended:
            raise RoundEnded("that round has ended here")
        round_ = self._rounds.setdefault(part.group, _Round(part.group))
        try:
            await asyncio.wait_for(round_.started.wait(), START_WAIT)
        except TimeoutError:
            if not round_.started.is_set():
                self._rounds.pop(part.group, None)
            raise RequestError("no round of that group runs here") from None
        if sender is None or sender == self.transport.peer_id or sender not in round_.members:
            raise RequestError("the sender is not a member of this round")
        return round_
