"""What a hop passes back upstream from its next hop.

Only what may travel that way: errors, `Leaving` notices and adapter gradients (`ParamGrads`);
a `Backward` is computed on here, never passed on; a `Result` goes only from the last hop to the
client's own result stream, so one coming upstream is a forgery. And only claims about peers after
this hop on the session's route: a hop that blames a peer elsewhere, or that breaks the protocol,
is itself named to the client as failed, and nothing more from it is passed on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any

from p2pfusion.errors import RequestError
from p2pfusion.net import messages as m
from p2pfusion.net.codecs import pack
from p2pfusion.net.framing import BadTensor, FrameError, FrameLimits, read_frame
from p2pfusion.peer.session import Session
from p2pfusion.peer.streams import send_quietly, step_of, write


# the kinds that may travel upstream, and the peer each names as failed or leaving (None: none)
UPSTREAM: dict[type, Callable[[Any], str | None]] = {
    m.ParamGrads: lambda message: None,
    m.Error: lambda message: message.failed_peer,
    m.Leaving: lambda message: message.peer_id,
}


def screen(message: Any, downstream: Collection[str], next_peer: str) -> Any:
    """`message` itself when it may go upstream; otherwise an Error naming `next_peer`, which sent it
    (or relayed it: either way that hop broke the protocol). `downstream`: the peers after this hop."""
    named = UPSTREAM.get(type(message))
    if named is None:
        return m.Error(
            message=f"the next hop {next_peer} sent a {message.kind!r} message upstream, which never travels that way",
            failed_peer=next_peer,
        )
    blamed = named(message)
    if blamed is None or blamed in downstream:
        return message
    return m.Error(
        message=f"the next hop {next_peer} named peer {blamed}, which is not after it on this route", failed_peer=next_peer
    )


Backward = Callable[[str, m.Backward, Any, Any], Awaitable[None]]


async def relay(session: Session, reader, limits: FrameLimits, on_backward: Backward) -> None:
    """From the next hop until it closes: gradients to compute on, and what the hops after us tell
    the client, screened."""
    try:
        while await _relay_one(session, reader, limits, on_backward):
            pass
    except FrameError as exc:  # over this stream's limits, e.g. a tensor on a kind that carries none
        message = f"the next hop {session.next_peer} sent a frame no hop relays: {exc}"
        await send_quietly(session.upstream, m.Error(message=message, failed_peer=session.next_peer))
    except (EOFError, ConnectionError):
        if not session.expired:  # a hop that expired the session closes it next: no fault of its own
            message = f"the next hop {session.next_peer} closed the session"
            await send_quietly(session.upstream, m.Error(message=message, failed_peer=session.next_peer))


async def _relay_one(session: Session, reader, limits: FrameLimits, on_backward: Backward) -> bool:
    """One frame (its tensor is dropped on return, before the next read); False once the next hop
    broke the protocol."""
    try:
        header, tensor = await read_frame(reader, limits)
        message = m.from_header(header)
    except FrameError:
        raise  # the stream is out of step: it ends
    except RequestError as exc:  # one bad gradient or message costs its step only
        step = step_of(exc.header) if isinstance(exc, BadTensor) else -1
        await send_quietly(session.upstream, m.Error(message=str(exc), step=step))
        return True
    if isinstance(message, m.Backward):
        await on_backward(session.session_id, message, tensor, session.upstream)
        return True
    passed = screen(message, session.downstream_peers, session.next_peer)
    if isinstance(passed, m.Error) and passed.code == m.ErrorCode.EXPIRED:
        session.mark_expired()
    payload = pack(tensor) if tensor is not None and passed is message else None
    await write(session.upstream, m.to_header(passed), payload)
    return passed is message
