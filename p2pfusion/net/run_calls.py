"""Calling a training replica (net/run_messages.py): one request on a fresh stream, and its answers.

A replica that cannot be dialled (PeerUnreachable), or goes silent, is a PeerFailed naming it; one that answers with
an Error is a PeerRefused (or what the Error's code says); an answer that is not what the
request asks for is a RequestError.
"""

from __future__ import annotations

import asyncio

import torch

from p2pfusion.errors import PeerFailed, RequestError
from p2pfusion.net import messages as m
from p2pfusion.net import run_messages as t
from p2pfusion.net.framing import FrameLimits, read_frame, write_frame
from p2pfusion.net.transport import Transport

REPLY_LIMITS = FrameLimits(header=64 << 10, tensor_kinds=frozenset())
STATE_LIMITS = FrameLimits(header=64 << 10, tensor_kinds=frozenset({t.StatePart.kind}))
DIAL_TIMEOUT = 5.0
STATE_TIMEOUT = 600.0  # a whole stage's weights and optimizer state


async def call(transport: Transport, peer_id: str, addrs: list[str], request, timeout: float = 30.0):
    """The replica's one answer to `request`: an Ack or a StateEnd, or the Error it sent raised."""
    reader, writer = await transport.open(peer_id, addrs, t.PROTOCOL, DIAL_TIMEOUT)
    try:
        await write_frame(writer, t.to_header(request))
        async with asyncio.timeout(timeout):
            header, _ = await read_frame(reader, REPLY_LIMITS)
    except (EOFError, ConnectionError, TimeoutError, OSError) as exc:
        raise PeerFailed(f"replica {peer_id} did not answer {request.kind}: {exc!r}", peer_id) from exc
    finally:
        writer.close()
    reply = t.from_header(header)
    m.raise_for_error(reply)
    return reply


async def status(transport: Transport, peer_id: str, addrs: list[str], request: t.Status) -> t.StateEnd:
    reply = await call(transport, peer_id, addrs, request, 10.0)
    if not isinstance(reply, t.StateEnd):
        raise RequestError(f"replica {peer_id} answered status with {reply.kind!r}")
    return reply


async def fetch_state(
    transport: Transport, peer_id: str, addrs: list[str], request: t.FetchState, shapes: dict[str, list[int]],
) -> tuple[dict[str, dict[str, torch.Tensor]], t.StateEnd]:
    """A replica's state (kind -> parameter name -> tensor), each part checked against `shapes`
    before it is kept: a RequestError when it holds something else, or not all it said."""
    expected = shapes
    state: dict[str, dict[str, torch.Tensor]] = {}
    reader, writer = await transport.open(peer_id, addrs, t.PROTOCOL, DIAL_TIMEOUT)
    try:
        await write_frame(writer, t.to_header(request))
        async with asyncio.timeout(STATE_TIMEOUT):
            while True:
                header, tensor = await read_frame(reader, STATE_LIMITS)
                reply = t.from_header(header)
                if isinstance(reply, t.StateEnd):
                    break
                if isinstance(reply, m.Error):
                    raise RequestError(f"replica {peer_id} refused to share its state: {reply.message}")
                if not isinstance(reply, t.StatePart) or reply.name not in expected:
                    raise RequestError(f"replica {peer_id} sent {str(header.get('name'))[:80]!r}, not a weight of these layers")
                if tensor is None or tensor.dtype != torch.float32 or list(tensor.shape) != expected[reply.name]:
                    raise RequestError(f"replica {peer_id} sent {reply.name} in another shape or dtype than these layers'")
                state.setdefault(reply.part, {})[reply.name] = tensor
    except (EOFError, ConnectionError, TimeoutError, OSError) as exc:
        raise PeerFailed(f"replica {peer_id} went away while sending its state: {exc!r}", peer_id) from exc
    finally:
        writer.close()
    kinds = ("outer",) if request.weights_only else t.STATE_KINDS
    for kind in kinds:
        if len(state.get(kind, {})) != reply.names:
            raise RequestError(f"replica {peer_id} sent an incomplete state ({kind})")
    return {kind: state[kind] for kind in kinds}, reply
