"""Which sessions a peer admits: a memory budget for KV caches, and each source's share of it (pure).

A session reserves, when it opens, all the KV cache it may grow to (`batch` x `max_length` x the
stage's bytes per token), and gives it back when it ends. So a peer never promises more memory
than its budget, and one source (one client address, or one upstream peer) cannot take it all:
it gets at most `source_share` of the budget and `source_sessions` sessions. A refusal is "busy",
not a fault: the client tries another peer, or later.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reservation:
    source: str  # "ip:<address>" or "peer:<id>", as the transport names who sent the Open
    nbytes: int


@dataclass(frozen=True)
class Budget:
    total: int  # bytes of KV cache this peer gives all sessions together
    source_share: float = 0.5  # of `total`, at most this much for one source
    source_sessions: int = 64  # sessions open at once per source


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of one position through `layers` layers."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def refusal(budget: Budget, held: list[Reservation], request: Reservation) -> str | None:
    """Why `request` cannot be admitted beside the reservations `held`, or None when it can."""
    mib = 1 << 20
    if request.nbytes > budget.total * budget.source_share:
        return (
            f"a session of {request.nbytes / mib:.1f} MiB exceeds what one client may reserve here "
            f"({budget.total * budget.source_share / mib:.0f} MiB); ask for a shorter max_length or batch"
        )
    in_use = sum(r.nbytes for r in held)
    if in_use + request.nbytes > budget.total:
        return f"no room for a {request.nbytes / mib:.1f} MiB session ({in_use / mib:.0f} of {budget.total / mib:.0f} MiB reserved)"
    own = [r for r in held if r.source == request.source]
    if len(own) >= budget.source_sessions:
        return f"this client already has {len(own)} sessions open here (at most {budget.source_sessions})"
    own_bytes = sum(r.nbytes for r in own)
    if own_bytes + request.nbytes > budget.total * budget.source_share:
        return (
            f"this client already reserves {own_bytes / mib:.0f} MiB here; one client may hold at most "
            f"{budget.total * budget.source_share / mib:.0f} MiB"
        )
    return None
