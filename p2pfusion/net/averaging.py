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
is left out of the mean by every member alike. (A member that sends different tensors to
different members would make them disagree: the next joiner copies the state most replicas hold,
peer/run_owner.py `agreed`.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar

import torch

from p2pfusion.errors import PeerFailed, RequestError
from p2pfusion.net import messages as m
from p2pfusion.net import wire
from p2pfusion.net.clients import Source
from p2pfusion.net.codecs import pack, unpack
from p2pfusion.net.compression import Codec
from p2pfusion.net.framing import FrameError, FrameLimits, read_frame, write_frame
from p2pfusion.net.robust import robust_mean
from p2pfusion.net.transport import Transport

log = logging.getLogger(__name__)

PROTOCOL = "p2pfusion.average.v2"
CODECS = {"none": Codec.NONE, "float16": Codec.FLOAT16}
START_WAIT = 30.0  # a member's tensors may come before this peer starts the round: they wait this long
MAX_TENSORS = 4096  # parameters of one stage
LIMITS = FrameLimits(header=4096, tensor_kinds=frozenset({"average_part"}))


class AveragingFailed(RequestError):
    """A round ended without every member's tensors here: the tensors are unchanged."""


@dataclass(frozen=True)
class AveragePart:
    """One of a member's tensors for a round (the tensor travels beside the header)."""

    kind: ClassVar[str] = "average_part"
    namespace: Annotated[str, wire.Length(256)]
    group: Annotated[bytes, wire.Length(32, 1)]
    index: Annotated[int, wire.Bound(0, MAX_TENSORS - 1)]
    count: Annotated[int, wire.Bound(1, MAX_TENSORS)]


PARTS = {AveragePart.kind: AveragePart}


@dataclass(frozen=True)
class Averaged:
    tensors: list[torch.Tensor]
    left_out: list[str]  # members whose tensors the mean did not use


class _Round:
    def __init__(self, members: list[str] | None = None, shapes: list[torch.Size] | None = None):
        self.members, self.shapes = members, shapes
        self.started = asyncio.Event()  # the members and shapes are known
        self.received: dict[str, list[torch.Tensor] | None] = {}
        self.complete = asyncio.Event()

    def start(self, members: list[str], shapes: list[torch.Size], me: str) -> None:
        self.members, self.shapes = members, shapes
        self.others = [p for p in members if p != me]
        self.started.set()
        self._check()

    def deliver(self, sender: str, tensors: list[torch.Tensor] | None) -> None:
        """A member's tensors, or None for a member whose tensors are unusable (left out of the mean)."""
        self.received[sender] = tensors
        self._check()

    def _check(self) -> None:
        if self.started.is_set() and all(p in self.received for p in self.others):
            self.complete.set()


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
    def __init__(self, transport: Transport, namespace: str):
        self.transport = transport
        self.namespace = namespace  # the run's: two runs on one host never mix their rounds
        self._rounds: dict[bytes, _Round] = {}
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
        round_ = self._rounds.setdefault(group_id, _Round())
        round_.start(members, [t.shape for t in local], me)
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(self._send(p, group_id, local, compression) for p in round_.others))
                await round_.complete.wait()
        except TimeoutError as exc:
            missing = [p for p in round_.others if p not in round_.received]
            raise AveragingFailed(f"averaging round failed: no tensors from {', '.join(missing) or '?'} ({exc!r})") from exc
        finally:
            self._rounds.pop(group_id, None)
        usable = [p for p in members if p == me or round_.received[p] is not None]
        flat = [torch.cat([t.reshape(-1) for t in (local if p == me else round_.received[p])]) for p in usable]
        aggregate = await asyncio.to_thread(robust_mean, flat)
        left_out = sorted(set(members) - set(usable)) + [usable[i] for i in aggregate.left_out]
        if left_out:
            log.warning("averaging: left out %s (tensors malformed, not finite, far larger than the others' or "
                        "pointing away from them)",
                        ", ".join(left_out))
        parts = aggregate.value.split([t.numel() for t in local])
        return Averaged([part.view_as(t).clone() for part, t in zip(parts, local)], left_out)

    async def _send(self, peer: str, group_id: bytes, tensors: list[torch.Tensor], compression: str) -> None:
        """This peer's tensors to `peer`. A failure here is not this round's: what this peer
        averages depends only on what it receives (a member may refuse, and close, to break it)."""
        try:
            await self._send_all(peer, group_id, tensors, compression)
        except (OSError, EOFError, FrameError, PeerFailed) as exc:
            log.info("averaging: could not send this peer's tensors to %s: %r", peer, exc)

    async def _send_all(self, peer: str, group_id: bytes, tensors: list[torch.Tensor], compression: str) -> None:
        reader, writer = await self.transport.open(peer, [], PROTOCOL)  # libp2p, by peer id
        try:
            for index, tensor in enumerate(tensors):
                packed = pack(tensor, CODECS[compression])
                self.wire_bytes += packed.nbytes
                header = m.to_header(AveragePart(self.namespace, group_id, index, len(tensors)))
                await write_frame(writer, header, packed)
            reply, _ = await read_frame(reader, LIMITS)
            if reply.get("kind") != m.Ack.kind:  # it leaves this peer out: the round goes on without its tensors
                log.warning("averaging: %s refused this peer's tensors: %s", peer, str(reply.get("message"))[:200])
        finally:
            writer.close()

    async def _receive(self, reader, writer, source: Source) -> None:
        """A member's tensors for a round this peer runs (or is about to)."""
        joined: list[_Round] = []  # the round, once the sender proved a member of it
        try:
            await self._read_member(reader, source.peer, joined)
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
                if part.namespace != self.namespace:
                    raise RequestError(f"this peer averages for {self.namespace}, not {part.namespace[:100]}")
                round_ = self._rounds.setdefault(part.group, _Round())
                try:
                    await asyncio.wait_for(round_.started.wait(), START_WAIT)
                except TimeoutError:
                    if not round_.started.is_set():
                        self._rounds.pop(part.group, None)
                    raise RequestError("no round of that group runs here") from None
                if sender is None or sender == self.transport.peer_id or sender not in round_.members:
                    raise RequestError("the sender is not a member of this round")
                joined.append(round_)
            if part.index != len(tensors) or part.count != len(round_.shapes) or tensor is None:
                raise RequestError("tensors out of order, or not as many as this round averages")
            if tensor.shape != round_.shapes[part.index]:
                raise RequestError(f"tensor {part.index} has shape {list(tensor.shape)}, not {list(round_.shapes[part.index])}")
            tensors.append(tensor.float())
            if len(tensors) == part.count:
                round_.deliver(sender, tensors)
                return
