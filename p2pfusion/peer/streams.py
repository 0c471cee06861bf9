"""Writing to the streams a peer serves, whose other end may have gone at any moment."""

from __future__ import annotations

import asyncio

from p2pfusion.errors import PeerBusy, PeerFailed, SessionExpired
from p2pfusion.net import messages as m
from p2pfusion.net.framing import write_frame


def step_of(header: dict) -> int:
    step = header.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


def error_for(exc: PeerFailed) -> m.Error:
    """The Error that tells a client about `exc`, keeping its code: busy and expired are no faults."""
    if isinstance(exc, PeerBusy):
        return m.Error(message=str(exc), failed_peer=exc.peer_id, code=m.ErrorCode.BUSY, retry_after=exc.retry_after)
    code = m.ErrorCode.EXPIRED if isinstance(exc, SessionExpired) else None
    return m.Error(message=str(exc), failed_peer=exc.peer_id, code=code)


async def write(writer: asyncio.StreamWriter, header: dict, payload=None) -> None:
    """A frame towards the client (or the hop before us), which may have gone: its closed connection
    is a ConnectionError here, whatever raised it (uvloop raises RuntimeError, TLS an OSError)."""
    try:
        await write_frame(writer, header, payload)
    except ConnectionError:
        raise
    except (OSError, RuntimeError) as exc:
        raise ConnectionResetError(f"the connection is closed: {exc}") from exc


async def send_quietly(writer: asyncio.StreamWriter, message) -> None:
    try:
        await write(writer, m.to_header(message))
    except ConnectionError:
        pass
