"""Errors that reach users as one clear line (the CLI prints them without a traceback).

Each says whose move it is: `RouteError`, the swarm's (it cannot serve this now: a gap, peers
unreachable or busy; try again later); `RequestError`, the caller's (the request is malformed);
`ConfigError`, this process's owner's (a file, port or option of its own is unusable);
`ModelError`, the model's (it cannot be found, read or run); `ProofError`, a remote party's (it
failed to prove who it is or that it belongs to the swarm). The HTTP API answers each with its own
status (api/errors.py). Anything else that escapes is a bug of ours, never blamed on a peer.
"""


class P2PFusionError(Exception):
    """Base class for every error a user is meant to read."""


class ModelError(P2PFusionError):
    """The model cannot be found, read, or is of an unsupported architecture."""


class ConfigError(P2PFusionError):
    """This process's own setup is unusable: a secret or identity file, a port, options that conflict."""


class BehindNat(ConfigError):
    """Other peers reach this peer at none of its addresses: it can serve only through relays;
    `relays`, full addresses of peers that can be one."""

    def __init__(self, message: str, relays: list[str]):
        super().__init__(message)
        self.relays = relays


class ProofError(P2PFusionError):
    """A peer or client failed to prove itself: a bad signature or certificate, no proof of the swarm secret."""


class RouteError(P2PFusionError):
    """The swarm cannot serve a request now (layers missing, peers unreachable or busy)."""


class RequestError(P2PFusionError):
    """A request is malformed: bad shapes, dtypes, lengths, unknown sessions."""


class PromptTooLong(RequestError):
    """A prompt fills the model's positions, or the longest session the swarm's peers accept."""


class PeerFailed(RouteError):
    """A peer of the route stopped answering; the client can route around it (peer_id None: unknown which)."""

    def __init__(self, message: str, peer_id: str | None):
        super().__init__(message)
        self.peer_id = peer_id


class PeerUnreachable(PeerFailed):
    """No stream to a peer could be opened: its direct address and libp2p both failed, or timed out."""


class PeerBusy(PeerFailed):
    """A peer has no room now (its memory, its session cap, or this client's share of them): try
    another peer, or this one again after `retry_after` seconds (None: the peer gave no hint).
    Not a fault: the client does not ban it."""

    def __init__(self, message: str, peer_id: str | None, retry_after: float | None = None):
        super().__init__(message, peer_id)
        self.retry_after = retry_after


class SessionExpired(PeerFailed):
    """A peer closed a session that sat idle: the client opens it again and replays. Not a fault."""


class PeerRefused(RequestError):
    """A peer answered a request with an error (not naming a failed peer). It may be ours to fix,
    or made up by a hostile hop on the route: a session asks a route of other peers before
    believing it."""
