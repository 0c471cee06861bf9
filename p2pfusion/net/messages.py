"""Typed messages of the inference protocol, and their conversion to and from frame headers.

A session's hidden states flow client -> stage 1 -> stage 2 -> ... -> client:
1. The client opens an output stream to the last hop (`Subscribe`), which delivers results there.
2. The client opens the input stream to the first hop with `Open`, naming the remaining route;
   each hop opens the next hop the same way, so the route is set up peer to peer.
3. Each `Step` carries hidden states to a hop, which computes and pushes a `Step` to the next hop,
   or a `Result` to the client's output stream if it is the last.
4. In a training session, `Backward` carries the gradient of a step's output from the client to
   the last hop, and each hop sends the gradient of its input upstream, down to the client.
5. An `Adapter` travels down before the steps that use it: the session's own trainable parameters
   (LoRA, deep prompts), sent once per version and named by a digest that each `Step` repeats.
   Each hop keeps the part for its layers and passes the rest on. In training, each hop sends the
   gradients of its part upstream as `ParamGrads`, before its input's `Backward`.
6. `Error` travels back upstream to the client; `Close` travels down and frees every KV cache.
   An error that names `failed_peer` means that peer is gone: the client routes around it.
7. A peer that is leaving sends `Leaving` upstream once its steps in flight are done, so the
   client moves its session before its next step, with no error.
8. `Ping` on a fresh stream asks a peer whether it serves: `Ack`, or an `Error` naming itself
   when it is leaving. A client confirms with it what one peer says about another.
Each hop adds its own compute time to a step's `timings`, for logs; routing never trusts them.
An `Error` may carry a `code`: "busy" (no room now: try another peer, or this one after its
`retry_after` seconds) or "expired" (the session sat idle and was closed: open it again). Neither
is a fault of the peer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from p2pfusion.errors import PeerBusy, PeerFailed, PeerRefused, RequestError, SessionExpired
from p2pfusion.net.compression import AUTO, LinkSpeed, Purpose, parse_compression

PROTOCOL = "p2pfusion.inference.v3"
MAX_STEP_TOKENS = 8192  # batch x tokens of one step: bounds a peer's memory per step
MAX_SAVED = 8  # training steps a peer keeps awaiting their backward pass, per session
BUSY = "busy"
EXPIRED = "expired"
ERROR_CODES = (BUSY, EXPIRED)


@dataclass(frozen=True)
class Hop:
    peer_id: str
    data_addrs: list[str]  # where its direct TLS listener is; empty: reach it through libp2p
    start: int
    end: int


@dataclass(frozen=True)
class Subscribe:
    kind: ClassVar[str] = "subscribe"
    session_id: str


@dataclass(frozen=True)
class Open:
    kind: ClassVar[str] = "open"
    session_id: str
    max_length: int
    route: list[Hop] = field(default_factory=list)
    compression: str = AUTO  # or a codec every hop must use
    purpose: Purpose = Purpose.INFERENCE
    link: LinkSpeed | None = None  # between the sender of this Open and its receiver (for gradients)
    client_link: LinkSpeed | None = None  # between the client and the last hop (for results)
    batch: int = 1  # the most sequences a step may carry: the peer reserves batch x max_length of KV
    # set by a hop relaying the session: the client it came from, so the next hops share compute
    # fairly among the clients within that hop's own share (a claim, which divides only its share)
    client: str | None = None
    # set by a hop relaying the session: the address the first hop saw the client at, which the
    # next hops count the session's caps against where the swarm lists the relaying peer
    origin: str | None = None


@dataclass(frozen=True)
class Ack:
    kind: ClassVar[str] = "ack"


@dataclass(frozen=True)
class Step:
    """Hidden states of new positions; the tensor travels beside the header.

    `mask` is the attention mask of the whole sequence so far as bytes of 0/1 [batch, length]
    (None: no padding); `positions` the new tokens' position ids as little-endian int32
    [batch, tokens] (None: their sequence positions); `adapter` the digest of the parameters the
    client expects this step to use (None: none)."""

    kind: ClassVar[str] = "step"
    step: int
    timings: list[tuple[str, float]] = field(default_factory=list)  # (peer id, compute seconds) per hop
    mask: bytes | None = None
    positions: bytes | None = None
    adapter: str | None = None


@dataclass(frozen=True)
class Adapter:
    """A session's trainable parameters, as one float32 tensor of the entries' values in order."""

    kind: ClassVar[str] = "adapter"
    digest: str
    scaling: float
    entries: list[tuple[str, list[int]]]  # (global parameter name, shape)


@dataclass(frozen=True)
class ParamGrads:
    """The gradients of one hop's adapter parameters for a training step, as one float32 tensor."""

    kind: ClassVar[str] = "param_grads"
    step: int
    entries: list[tuple[str, list[int]]]  # (global parameter name, shape)


@dataclass(frozen=True)
class Backward:
    """The gradient of a training step's output (toward the last hop) or of its input (upstream)."""

    kind: ClassVar[str] = "backward"
    step: int
    timings: list[tuple[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Result:
    kind: ClassVar[str] = "result"
    step: int
    timings: list[tuple[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Error:
    kind: ClassVar[str] = "error"
    message: str
    step: int = -1
    failed_peer: str | None = None
    code: str | None = None  # BUSY or EXPIRED: not a fault, see the module's docstring
    retry_after: float | None = None  # with BUSY: seconds until the peer expects room, at most MAX_RETRY_AFTER


@dataclass(frozen=True)
class Leaving:
    kind: ClassVar[str] = "leaving"
    peer_id: str


@dataclass(frozen=True)
class Close:
    kind: ClassVar[str] = "close"


@dataclass(frozen=True)
class Ping:
    kind: ClassVar[str] = "ping"


MESSAGES = {
    cls.kind: cls
    for cls in (Subscribe, Open, Ack, Step, Backward, Result, Error, Close, Leaving, Adapter, ParamGrads, Ping)
}
TENSOR_KINDS = frozenset({Step.kind, Result.kind, Backward.kind, Adapter.kind, ParamGrads.kind})


def to_header(message: Any) -> dict[str, Any]:
    header = {"kind": message.kind, **asdict(message)}
    if isinstance(message, Open):
        header["purpose"] = message.purpose.value
    return header


def _typed(value: Any, expected: type, name: str) -> Any:
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise RequestError(f"field {name!r} must be {expected.__name__}, got {type(value).__name__}")
    return value


MAX_ROUTE = 256  # hops in one route
MAX_HOP_ADDRS = 8  # a peer dials at most MAX_DIALED of them, and only those its next hop announced
MAX_ID = 128  # characters of a peer or session id


def _short(value: Any, name: str) -> str:
    text = _typed(value, str, name)
    if not 0 < len(text) <= MAX_ID:
        raise RequestError(f"field {name!r} must be 1 to {MAX_ID} characters")
    return text


def _hop(raw: Any) -> Hop:
    if not isinstance(raw, dict):
        raise RequestError("route entries must be maps")
    addrs = _typed(raw.get("data_addrs"), list, "data_addrs")
    if len(addrs) > MAX_HOP_ADDRS:
        raise RequestError(f"a hop lists at most {MAX_HOP_ADDRS} data addresses, got {len(addrs)}")
    return Hop(
        peer_id=_short(raw.get("peer_id"), "peer_id"),
        data_addrs=[_typed(a, str, "data_addrs")[:MAX_ID] for a in addrs],
        start=_typed(raw.get("start"), int, "start"),
        end=_typed(raw.get("end"), int, "end"),
    )


def from_header(header: dict[str, Any]) -> Any:
    """Validate a decoded header into its message type, or raise RequestError saying why."""
    kind = header.get("kind")
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None  # a list or map is no kind (and unhashable)
    if cls is None:
        raise RequestError(f"unknown message kind {str(kind)[:40]!r}")
    if cls is Open:
        route = _typed(header.get("route"), list, "route")
        if len(route) > MAX_ROUTE:
            raise RequestError(f"a route has at most {MAX_ROUTE} hops, got {len(route)}")
        try:
            compression = parse_compression(_typed(header.get("compression", AUTO), str, "compression"))
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        try:
            purpose = Purpose(header.get("purpose", Purpose.INFERENCE.value))
        except ValueError:
            raise RequestError(f"unknown session purpose {header.get('purpose')!r}") from None
        return Open(
            session_id=_short(header.get("session_id"), "session_id"),
            max_length=_typed(header.get("max_length"), int, "max_length"),
            route=[_hop(h) for h in route],
            compression=compression,
            purpose=purpose,
            link=_link(header.get("link"), "link"),
            client_link=_link(header.get("client_link"), "client_link"),
            batch=_typed(header.get("batch", 1), int, "batch"),
            client=None if header.get("client") is None else _short(header.get("client"), "client"),
            origin=None if header.get("origin") is None else _short(header.get("origin"), "origin"),
        )
    if cls is Subscribe:
        return Subscribe(session_id=_short(header.get("session_id"), "session_id"))
    if cls is Step:
        return Step(
            step=_typed(header.get("step"), int, "step"),
            timings=_timings(header.get("timings", [])),
            mask=_optional(header.get("mask"), bytes, "mask"),
            positions=_optional(header.get("positions"), bytes, "positions"),
            adapter=_optional(header.get("adapter"), str, "adapter"),
        )
    if cls in (Backward, Result):
        return cls(step=_typed(header.get("step"), int, "step"), timings=_timings(header.get("timings", [])))
    if cls is Adapter:
        return Adapter(
            digest=_typed(header.get("digest"), str, "digest"),
            scaling=_finite(header.get("scaling"), "scaling"),
            entries=[_entry(e) for e in _typed(header.get("entries"), list, "entries")],
        )
    if cls is ParamGrads:
        entries = [_entry(e) for e in _typed(header.get("entries"), list, "entries")]
        return ParamGrads(step=_typed(header.get("step"), int, "step"), entries=entries)
    if cls is Error:
        failed, code = header.get("failed_peer"), header.get("code")
        return Error(
            message=str(header.get("message"))[:MAX_ERROR_TEXT],
            step=_typed(header.get("step", -1), int, "step"),
            failed_peer=None if failed is None else _short(failed, "failed_peer"),
            code=code if code in ERROR_CODES else None,
            retry_after=_retry_after(header.get("retry_after")),
        )
    if cls is Leaving:
        return Leaving(peer_id=_short(header.get("peer_id"), "peer_id"))
    return cls()


def _optional(value: Any, expected: type, name: str) -> Any:
    return None if value is None else _typed(value, expected, name)


MAX_ENTRY_DIMS = 4


def _entry(raw: Any) -> tuple[str, list[int]]:
    if not (isinstance(raw, (list, tuple)) and len(raw) == 2):
        raise RequestError("adapter entries must be [name, shape]")
    shape = _typed(raw[1], list, "entries shape")
    if not 0 < len(shape) <= MAX_ENTRY_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
        raise RequestError(f"adapter entry shape must be 1 to {MAX_ENTRY_DIMS} positive ints, got {shape!r}")
    return _typed(raw[0], str, "entries name"), shape


MAX_ERROR_TEXT = 500  # error texts reach users' terminals and logs


def raise_for_error(reply: Any) -> None:
    """Raise an Error reply: PeerBusy or SessionExpired by its code, PeerFailed when it names a
    failed peer (route around it), else PeerRefused."""
    if isinstance(reply, Error):
        if reply.code == BUSY:
            raise PeerBusy(reply.message, reply.failed_peer, reply.retry_after)
        if reply.code == EXPIRED:
            raise SessionExpired(reply.message, reply.failed_peer)
        if reply.failed_peer is not None:
            raise PeerFailed(reply.message, reply.failed_peer)
        raise PeerRefused(reply.message)


def _finite(raw: Any, name: str) -> float:
    if not isinstance(raw, (int, float)) or isinstance(raw, bool) or not abs(raw) < float("inf"):
        raise RequestError(f"field {name!r} must be a finite number")
    return float(raw)


def _non_negative(raw: Any, name: str) -> float:
    if not isinstance(raw, (int, float)) or isinstance(raw, bool) or not 0 <= raw < float("inf"):
        raise RequestError(f"field {name!r} must be a finite number >= 0")
    return float(raw)


MAX_RETRY_AFTER = 600.0  # seconds; a longer wait is no hint a client can act on


def _retry_after(raw: Any) -> float | None:
    if raw is None:
        return None
    seconds = _non_negative(raw, "retry_after")
    if seconds > MAX_RETRY_AFTER:
        raise RequestError(f"field 'retry_after' must be at most {MAX_RETRY_AFTER:g} s")
    return seconds


def _link(raw: Any, name: str) -> LinkSpeed | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RequestError(f"field {name!r} must be a map")
    bandwidth = _non_negative(raw.get("bytes_per_second"), f"{name}.bytes_per_second")
    if bandwidth == 0:
        raise RequestError(f"field {name}.bytes_per_second must be positive")
    return LinkSpeed(rtt=_non_negative(raw.get("rtt"), f"{name}.rtt"), bytes_per_second=bandwidth)


def _timings(raw: Any) -> list[tuple[str, float]]:
    entries = _typed(raw, list, "timings")
    if len(entries) > MAX_ROUTE:
        raise RequestError(f"timings list at most {MAX_ROUTE} hops")
    out = []
    for entry in entries:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            raise RequestError("timings entries must be [peer_id, seconds]")
        out.append((_short(entry[0], "timings"), _non_negative(entry[1], "timings seconds")))
    return out
