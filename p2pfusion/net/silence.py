"""Telling a silent peer from a slow one, when several are asked at once.

A killed peer resets its connections and is known dead at once. A frozen one (its host suspended,
or gone without a reset) keeps them open and answers nothing, so a ping to it lasts its whole
timeout, and a timeout must be long enough for a fresh connection across a continent. Asked
together with others, a peer need not be waited for that long: once another peer has answered,
one still silent after `grace()` (many times the round trip it answered in before, never under
MIN_GRACE) is taken as silent. A peer never heard from before waits out the timeout, unless the
caller says to judge it by the first answer's time instead (`unknown_like_first`: a peer
checking a report that another peer is dead, where being wrong costs little); and every peer
waits out the timeout while none has answered (this machine's own network may be what failed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

MIN_GRACE = 1.0  # seconds: a busy peer's event loop answers a ping late, not this late
GRACE_FACTOR = 10.0  # times the round trip the peer answered in before: a fresh stream's handshakes


def grace(rtt: float | None, timeout: float) -> float:
    """How long a peer whose last answer took `rtt` seconds (None: it never answered) is waited
    for once another peer has answered."""
    if rtt is None:
        return timeout
    return min(timeout, max(MIN_GRACE, GRACE_FACTOR * rtt))


def given_up(elapsed: float, rtt: float | None, timeout: float, another_answered: bool) -> bool:
    """Whether a request `elapsed` seconds old, to a peer whose last answer took `rtt`, is over."""
    return elapsed >= timeout or (another_answered and elapsed >= grace(rtt, timeout))


async def ask_all(
    calls: Mapping[K, Awaitable[T]], rtts: Mapping[K, float], timeout: float, answered: Callable[[T], bool],
    unknown_like_first: bool = False,
) -> dict[K, T | None]:
    """Run `calls` at once; each one's result, or None for those given up (`given_up`). The calls
    return rather than raise, and end by themselves within `timeout`; those given up are cancelled.
    `answered` says which results count as an answer (a peer that says it is leaving answered)."""
    loop = asyncio.get_running_loop()
    tasks = {asyncio.ensure_future(call): key for key, call in calls.items()}
    results: dict[K, T | None] = dict.fromkeys(calls)
    start, first = loop.time(), None  # first: seconds the first answer took
    pending = set(tasks)

    def rtt(task: asyncio.Future) -> float | None:
        return rtts.get(tasks[task], first if unknown_like_first else None)

    try:
        while pending:
            elapsed = loop.time() - start
            waits = [grace(rtt(t), timeout) if first is not None else timeout for t in pending]
            done, pending = await asyncio.wait(pending, timeout=max(min(waits) - elapsed, 0.0),
                                               return_when=asyncio.FIRST_COMPLETED)
            elapsed = loop.time() - start
            for task in done:
                results[tasks[task]] = task.result()
                if first is None and answered(task.result()):
                    first = elapsed
            pending = {t for t in pending if not given_up(elapsed, rtt(t), timeout, first is not None)}
    finally:
        for task in tasks:
            task.cancel()
    return results
