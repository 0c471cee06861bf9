"""Typed messages of the inference protocol, and their conversion to and from frame headers.

A session's hidden states flow client -> stage 1 -> stage 2 -> ... -> client:
1. The client opens an output stream to the last hop (`Subscribe`), which delivers results there.
2. The client opens the input stream to the first hop with `Open`, naming the remaining route;
   each hop opens the next hop the same way, so the route is set up peer to peer.
3. Each `Step` carries hidden states to a hop, which computes and pushes a `Step` to the next hop,
   or a `Result` to the client's output stream if it is the last.
4. In a training session, `Backward` carries the gradient of a step's output from the client to
   the last hop, and each hop sends the gradient of its input upstream, down to the client.
5. `Params` travels down before the steps that use it: the session's own trainable parameters
   (LoRA, deep prompts: the client's adapter), sent once per version and named by a digest that
   each `Step` repeats. Each hop keeps the part for its layers and passes the rest on. In
   training, each hop sends the gradients of its part upstream as `ParamGrads`, before its
   input's `Backward`.
6. `Error` travels back upstream to the client; `Close` travels down and frees every KV cache.
   An error that names `failed_peer` means that peer is gone: the client routes around it.
7. A peer that is leaving sends `Leaving` upstream once its steps in flight are done, so the
   client moves its session before its next step, with no error.
8. `Ping` on a fresh stream asks a peer whether it serves: `Ack`, or an `Error` naming itself
   when it is leaving. A client confirms with it what one peer says about another.
Each hop adds its own compute time to a step's `timings`, for logs; routing never trusts them.
Each hop of an inference session also adds its signed `Receipt` of the step (net/receipts.py),
and on the session's first step its receipt key's certificate: both reach the client in `Result`.
An `Error` may carry a `code`: busy (no room now: try another peer, or this one after its
`retry_after` seconds) or expired (the session sat idle and was closed: open it again). Neither
is a fault of the peer.

Every message is a wire type (net/wire.py): its annotations are what a header must hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any, ClassVar

from p2pfusion.errors import PeerBusy, PeerFailed, PeerRefused, RequestError, SessionExpired
from p2pfusion.net.compression import AUTO, Compression, LinkSpeed, Purpose
from p2pfusion.net.receipts import Receipt, ReceiptCert
from p2pfusion.net.wire import Bound, Length, decode_as, encode

PROTOCOL = "p2pfusion.inference.v5"
MAX_STEP_TOKENS = 8192  # batch x tokens of one step: bounds a peer's memory per step
MAX_COHORT = 64  # steps of one cohort: a peer's batch holds at most 64 positions (peer/batching.py)
MAX_SAVED = 8  # training steps a peer keeps awaiting their backward pass, per session
MAX_ROUTE = 256  # hops in one route
MAX_HOP_ADDRS = 8  # a peer dials at most MAX_DIALED of them, and only those its next hop announced
MAX_ID = 128  # characters of a peer or session id, an address, a digest
MAX_ENTRY_DIMS = 4
MAX_ENTRIES = 1 << 14  # parameters of one adapter: LoRA on every projection of a 2,000-layer model
MAX_ERROR_TEXT = 500  # error texts reach users' terminals and logs
MAX_RETRY_AFTER = 600.0  # seconds; a longer wait is no hint a client can act on

Id = Annotated[str, Length(MAX_ID, 1)]
Count = Annotated[int, Bound(0)]
Seconds = Annotated[float, Bound(0)]
Timings = Annotated[list[tuple[Id, Seconds]], Length(MAX_ROUTE)]  # (peer id, compute seconds) per hop
Shape = Annotated[list[Annotated[int, Bound(1)]], Length(MAX_ENTRY_DIMS, 1)]
Entries = Annotated[list[tuple[Annotated[str, Length(MAX_ID, 1)], Shape]], Length(MAX_ENTRIES)]  # (name, shape)
Receipts = Annotated[list[Receipt], Length(MAX_ROUTE)]  # one per hop so far
Certs = Annotated[list[ReceiptCert], Length(MAX_ROUTE)]  # on a session's first step: of each hop so far


class ErrorCode(str, Enum):
    BUSY = "busy"
    EXPIRED = "expired"


@dataclass(frozen=True)
class Hop:
    """The layers [start, end) a route runs on a peer: from its first layer to its last, or to an
    earlier one where the next hop starts (it then runs and caches only those)."""

    peer_id: Id
    data_addrs: Annotated[list[Id], Length(MAX_HOP_ADDRS)]  # its direct TLS listener; empty: through libp2p
    start: Count
    end: Count


@dataclass(frozen=True)
class Subscribe:
    kind: ClassVar[str] = "subscribe"
    session_id: Id


@dataclass(frozen=True)
class Open:
    kind: ClassVar[str] = "open"
    session_id: Id
    length: Annotated[int, Bound(1)]  # the most positions the session holds
    route: Annotated[list[Hop], Length(MAX_ROUTE)] = field(default_factory=list)
    compression: Compression = AUTO  # or a codec every hop must use
    purpose: Purpose = Purpose.INFERENCE
    link: LinkSpeed | None = None  # between the sender of this Open and its receiver (for gradients)
    client_link: LinkSpeed | None = None  # between the client and the last hop (for results)
    batch: Annotated[int, Bound(1, MAX_STEP_TOKENS)] = 1  # sequences a step may carry: the peer reserves batch x length of KV
    # set by a hop relaying the session: the client it came from, so the next hops share compute
    # fairly among the clients within that hop's own share (a claim, which divides only its share)
    client: Id | None = None
    # set by a hop relaying the session: the address the first hop saw the client at, which the
    # next hops count the session's caps against where the swarm lists the relaying peer
    origin: Id | None = None


@dataclass(frozen=True)
class Ack:
    kind: ClassVar[str] = "ack"


@dataclass(frozen=True)
class Cohort:
    """A client's decode steps sent together, one per session (client/generate/lockstep.py): `size`
    of them carry `tag`. A hop runs them as one batch once all are in, and passes the tag on."""

    tag: Annotated[int, Bound(0, (1 << 63) - 1)]
    size: Annotated[int, Bound(2, MAX_COHORT)]


@dataclass(frozen=True)
class Step:
    """Hidden states of new positions; the tensor travels beside the header.

    `mask` is the attention mask of the whole sequence so far as bytes of 0/1 [batch, length]
    (None: no padding); `positions` the new tokens' position ids as little-endian int32
    [batch, tokens] (None: their sequence positions); `params` the digest of the parameters the
    client expects this step to use (None: none); `keep` how many of the positions the session's
    cache holds to keep before this step's are added (None: all): a speculative step's rejected
    drafts are dropped so, with no replay; `cohort` the steps of the client's other sessions sent
    with this one (None: none)."""

    kind: ClassVar[str] = "step"
    step: int
    timings: Timings = field(default_factory=list)
    receipts: Receipts = field(default_factory=list)
    certs: Certs = field(default_factory=list)
    mask: bytes | None = None
    positions: bytes | None = None
    params: Id | None = None
    keep: Count | None = None
    cohort: Cohort | None = None


@dataclass(frozen=True)
class Params:
    """A session's trainable parameters, as one float32 tensor of the entries' values in order."""

    kind: ClassVar[str] = "params"
    digest: Id
    scaling: float
    entries: Entries  # (global parameter name, shape)


@dataclass(frozen=True)
class ParamGrads:
    """The gradients of one hop's parameters for a training step, as one float32 tensor."""

    kind: ClassVar[str] = "param_grads"
    step: int
    entries: Entries  # (global parameter name, shape)


@dataclass(frozen=True)
class Backward:
    """The gradient of a training step's output (toward the last hop) or of its input (upstream)."""

    kind: ClassVar[str] = "backward"
    step: int
    timings: Timings = field(default_factory=list)


@dataclass(frozen=True)
class Result:
    kind: ClassVar[str] = "result"
    step: int
    timings: Timings = field(default_factory=list)
    receipts: Receipts = field(default_factory=list)
    certs: Certs = field(default_factory=list)


@dataclass(frozen=True)
class Error:
    """Its text is cut to MAX_ERROR_TEXT, whoever wrote it: it ends up on a user's terminal."""

    kind: ClassVar[str] = "error"
    message: str
    step: int = -1
    failed_peer: Id | None = None
    code: ErrorCode | None = None  # not a fault, see the module's docstring
    retry_after: Annotated[float, Bound(0, MAX_RETRY_AFTER)] | None = None  # with BUSY: seconds until the peer expects room

    def __post_init__(self):
        if len(self.message) > MAX_ERROR_TEXT:
            object.__setattr__(self, "message", self.message[:MAX_ERROR_TEXT])


@dataclass(frozen=True)
class Leaving:
    kind: ClassVar[str] = "leaving"
    peer_id: Id


@dataclass(frozen=True)
class Close:
    kind: ClassVar[str] = "close"


@dataclass(frozen=True)
class Ping:
    kind: ClassVar[str] = "ping"


MESSAGES: dict[str, type] = {
    cls.kind: cls
    for cls in (Subscribe, Open, Ack, Step, Backward, Result, Error, Close, Leaving, Params, ParamGrads, Ping)
}
TENSOR_KINDS = frozenset({Step.kind, Result.kind, Backward.kind, Params.kind, ParamGrads.kind})


def to_header(message: Any) -> dict[str, Any]:
    return {"kind": message.kind, **encode(message)}


def from_header(header: dict[str, Any], table: dict[str, type] = MESSAGES) -> Any:
    """The message a decoded header holds (its kind looked up in `table`), or a RequestError saying why not."""
    kind = header.get("kind")
    cls = table.get(kind) if isinstance(kind, str) else None  # a list or map is no kind (and unhashable)
    if cls is None:
        raise RequestError(f"unknown message kind {str(kind)[:40]!r}")
    return decode_as(cls, header, kind)


def raise_for_error(reply: Any) -> None:
    """Raise an Error reply: PeerBusy or SessionExpired by its code, PeerFailed when it names a
    failed peer (route around it), else PeerRefused."""
    if isinstance(reply, Error):
        if reply.code == ErrorCode.BUSY:
            raise PeerBusy(reply.message, reply.failed_peer, reply.retry_after)
        if reply.code == ErrorCode.EXPIRED:
            raise SessionExpired(reply.message, reply.failed_peer)
        if reply.failed_peer is not None:
            raise PeerFailed(reply.message, reply.failed_peer)
        raise PeerRefused(reply.message)
