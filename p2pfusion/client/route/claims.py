"""What a client believes of what its route's peers send it: pure rules, tested without a network.

A client holds two streams: the head stream to the first hop (its inputs go down it; errors,
notices and training gradients come back up it, relayed hop by hop) and the sink stream to the
last hop (results come on it, and the client's own training gradients go down it). Any hop can
write anything to the hop before it, so a frame says only what the stream's own peer passed on:
- a kind of frame may come only on the stream that carries it (`admitted`): a `Result` only
  from the last hop on the sink, never relayed up the head stream;
- a claim that a peer failed or is leaving counts at once only from that peer itself, on the
  stream to it; any other claim needs the client's own ping of the peer it names. When the
  ping finds that peer serving, the claim was false, and `blamed` names the hop to hold to
  account for it.
"""

from __future__ import annotations

from enum import Enum

from p2pfusion.errors import PeerFailed
from p2pfusion.net import messages as m


class Stream(str, Enum):
    HEAD = "head"  # to the first hop
    SINK = "sink"  # to the last hop


ADMITTED = {
    Stream.HEAD: frozenset({m.Error.kind, m.Leaving.kind, m.Backward.kind, m.ParamGrads.kind}),
    Stream.SINK: frozenset({m.Error.kind, m.Leaving.kind, m.Result.kind}),
}


class FalseClaim(PeerFailed):
    """A hop passed on a claim about another peer that the client's own ping found false: the
    client bans that hop (it made the claim, or relayed one it may not relay), and reports no one."""


def admitted(stream: Stream, kind: object) -> bool:
    return kind in ADMITTED[stream]


def claim_subject(message: object) -> str | None:
    """The peer a message says is gone or going, if any. Busy and expired errors are not claims of
    failure: they cost a moment, never a ban, so they need no proof."""
    if isinstance(message, m.Leaving):
        return message.peer_id
    if isinstance(message, m.Error) and message.code is None:
        return message.failed_peer
    return None


def needs_ping(route: list[str], via: int, subject: str) -> bool:
    """A claim about the peer at the other end of the stream is its own; a claim about a peer of
    the route is checked with a ping of that peer; a claim about a peer off the route is false
    without one (no hop of the route has any business reporting on it)."""
    return subject != route[via] and subject in route


def blamed(route: list[str], via: int, subject: str) -> str:
    """Who answers for a false claim about `subject` that came on the stream to `route[via]`.

    A hop relays only what its next hop sends it, and only claims about peers after itself, so a
    false claim about the hop at index j came from one of the hops before it: the one just
    before j is the only one that hears from j directly, and the one the client bans. A claim
    about a peer off the route, or before the stream's own peer, was made by that peer."""
    if subject in route:
        index = route.index(subject)
        if index > via:
            return route[index - 1]
    return route[via]
