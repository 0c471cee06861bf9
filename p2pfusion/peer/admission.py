"""Which sessions a peer admits: a memory budget for KV caches, a cap on sessions, and each
source's share of them (pure).

A session reserves, when it opens, all the KV cache it may grow to (`batch` x its `length` x the
stage's bytes per token), and gives it back when it ends. So a peer never promises more memory
than its budget, and one source (one client's address) cannot take it all: it gets at most
`source_share` of the budget and `source_sessions` sessions. A session a listed peer relays counts
against the address its first hop saw the client at (`vouched_origin`), not the relaying peer's. A refusal is "busy",
not a fault: the client tries another peer, or this one after the refusal's `retry_after`. A
session larger than any source may ever reserve here is no busy peer's: it never fits.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
# seconds a refused client should wait before asking again: sessions of other clients end at any
# moment (and the client tries other peers meanwhile); its own end only when it closes them
ROOM_RETRY = 2.0
SHARE_RETRY = 10.0
ORIGIN_KINDS = ("ip:", "circuit:")  # the addresses a first hop counts a client's sessions against (net.clients)


@dataclass(frozen=True)
class Reservation:
    source: str  # "ip:<address>" or "circuit:<relay id>", as the transport names who sent the Open
    nbytes: int


@dataclass(frozen=True)
class Budget:
    total: int  # bytes of KV cache this peer gives all sessions together
    source_share: float = 0.5  # of `total`, at most this much for one source
    source_sessions: int = 64  # sessions open at once per source
    sessions: int = 256  # sessions open at once, all sources together


@dataclass(frozen=True)
class Refusal:
    reason: str
    retry_after: float | None  # seconds until room may come; None: the request never fits here


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of one position through `layers` layers."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def _size(nbytes: float) -> str:
    if nbytes < MIB / 10:  # a small model's sessions: in MiB they would all read 0.0
        return f"{nbytes / 1024:.0f} KiB"
    return f"{nbytes / MIB:.1f}".removesuffix(".0") + " MiB"


def refusal(budget: Budget, held: list[Reservation], request: Reservation) -> Refusal | None:
    """Why `request` cannot be admitted beside the reservations `held`, or None when it can."""
    share = budget.total * budget.source_share
    if request.nbytes > share:
        return Refusal(
            f"a session of {_size(request.nbytes)} never fits here: one client may reserve at most "
            f"{_size(share)}; ask for a shorter session or batch", None,
        )
    if len(held) >= budget.sessions:
        return Refusal(f"{len(held)} sessions open, at most {budget.sessions}", ROOM_RETRY)
    in_use = sum(r.nbytes for r in held)
    if in_use + request.nbytes > budget.total:
        return Refusal(
            f"no room for a {_size(request.nbytes)} session ({_size(in_use)} of {_size(budget.total)} reserved)",
            ROOM_RETRY,
        )
    own = [r for r in held if r.source == request.source]
    if len(own) >= budget.source_sessions:
        return Refusal(f"this client already has {len(own)} sessions open here (at most {budget.source_sessions})", SHARE_RETRY)
    own_bytes = sum(r.nbytes for r in own)
    if own_bytes + request.nbytes > share:
        return Refusal(
            f"this client already reserves {_size(own_bytes)} here; one client may hold at most {_size(share)}",
            SHARE_RETRY,
        )
    return None


def vouched_origin(origin: str | None, relay_serves: tuple[int, int] | None, start: int) -> str | None:
    """The client address a relayed session's caps count against, or None: count it against the
    sender's own. `origin`: the client's address as the Open names it; `relay_serves`: the layers the
    swarm lists the sender serving, when the sender proved its peer id (None: not a listed peer);
    `start`: this hop's first layer. A relay serves many clients, so a peer that serves the layers
    just before this hop speaks for its client; anyone else's claim is ignored."""
    if origin is None or relay_serves is None or not origin.startswith(ORIGIN_KINDS):
        return None
    first, end = relay_serves
    return origin if first < start <= end else None
