"""Averaging tensors with a named group of peers, over this host's libp2p, by hivemind's butterfly
all-reduce (`AllReduceRunner`): each of n peers reduces 1/n of the elements, so each sends and
receives about 2 (n - 1) / n of its tensors' bytes.

Who is in a group, and when, is the caller's to agree on (the training driver names the group);
this module only runs a round. A peer answers only the groups it runs now and only their members:
libp2p authenticates peer ids, and `AllReduceRunner` refuses a sender outside the group. A round
in which a member failed to reduce its part is an `AveragingFailed`: the caller's tensors are left
as they were, so every member can retry with the survivors and all end with the same values.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import AsyncIterator  # hivemind's servicer reads typing's iterator hints only

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import Float16Compression, NoCompression
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, aiter_with_timeout, as_aiter

from p2pfusion.errors import RequestError

log = logging.getLogger(__name__)

COMPRESSIONS = {"none": NoCompression(), "float16": Float16Compression()}


class AveragingFailed(RequestError):
    """A round ended without every part averaged: the tensors are unchanged."""


class GroupAverager(ServicerBase):
    def __init__(self, p2p: P2P, namespace: str):
        self._p2p = p2p
        self._namespace = namespace
        self._rounds: dict[bytes, asyncio.Future] = {}  # group id -> its runner, once this peer starts it
        self.wire_bytes = 0  # tensor parts this peer received and answered, both directions

    async def start(self) -> None:
        await self.add_p2p_handlers(self._p2p, namespace=self._namespace)

    async def stop(self) -> None:
        await self.remove_p2p_handlers(self._p2p, namespace=self._namespace)

    async def average(
        self, group_id: bytes, tensors: Sequence[torch.Tensor], peers: Sequence[str], timeout: float,
        compression: str = "none",
    ) -> list[torch.Tensor]:
        """The group's average of `tensors` (every member passes the same shapes), computed with the
        peers named, this one included; AveragingFailed when some member did not take part."""
        me = self._p2p.peer_id.to_base58()
        if me not in peers:
            raise RequestError("averaging: this peer is not in the group it was asked to join")
        if len(set(peers)) == 1:
            return [t.clone() for t in tensors]
        ordered = [PeerID.from_base58(p) for p in sorted(set(peers))]
        local = [t.detach().clone() for t in tensors]
        runner = AllReduceRunner(
            p2p=self._p2p, servicer_type=type(self), prefix=self._namespace, group_id=group_id, tensors=local,
            ordered_peer_ids=ordered, peer_fractions=tuple(1.0 / len(ordered) for _ in ordered),
            sender_timeout=timeout, reducer_timeout=2 * timeout, compression=COMPRESSIONS[compression],
        )
        self._rounds.setdefault(group_id, asyncio.get_running_loop().create_future()).set_result(runner)
        try:
            async with asyncio.timeout(4 * timeout):
                index = 0
                async for delta in runner:
                    local[index].add_(delta)
                    index += 1
        except (AllreduceException, TimeoutError, OSError) as exc:
            raise AveragingFailed(f"averaging round failed: {exc!r}") from exc
        finally:
            self._rounds.pop(group_id, None)
        failed = runner.tensor_part_container.failed_size
        if failed:
            raise AveragingFailed(f"averaging round failed: {failed} values were not averaged (a member left)")
        return local

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A member's part for us to reduce. It may come before this peer starts the round: it
        waits for it (up to the sender's own timeout)."""
        request = await anext(stream)
        waiting = self._rounds.setdefault(request.group_id, asyncio.get_running_loop().create_future())
        try:
            runner = await asyncio.wait_for(asyncio.shield(waiting), 30.0)
        except TimeoutError:
            self._rounds.pop(request.group_id, None)
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        self.wire_bytes += request.ByteSize()

        async def counted(parts):
            async for part in parts:
                self.wire_bytes += part.ByteSize()
                yield part

        parts = achain(as_aiter(request), counted(aiter_with_timeout(stream, runner.sender_timeout)))
        async for reply in runner.rpc_aggregate_part(parts, context):
            self.wire_bytes += reply.ByteSize()
            yield reply
