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

A caller that needs only some answers (a route needs one peer per stage) says when it has
`enough`: from then on a peer never heard from is waited for only `settled_grace()` more, and is
not judged at all: its call goes on, for the caller to learn its answer later. A record naming a
tarpit then costs a route a fraction of a second, not the timeout, and a far peer that answers
slowly is only left out of this one route.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

MIN_GRACE = 1.0  # seconds: a busy peer's event loop answers a ping late, not this late
GRACE_FACTOR = 10.0  # times the round trip the peer answered in before: a fresh stream's handshakes
SETTLED_GRACE = 0.1  # seconds: leaving a peer out of one route costs little, and nothing is judged
SETTLED_FACTOR = 3.0  # times the first answer's time: the spread of round trips among nearby peers


def grace(rtt: float | None, timeout: float) -> float:
    """How long a peer whose last answer took `rtt` seconds (None: it never answered) is waited
    for once another peer has answered."""
    if rtt is None:
        return timeout
    return min(timeout, max(MIN_GRACE, GRACE_FACTOR * rtt))


def settled_grace(first: float) -> float:
    """How much longer a peer never heard from is waited for once the caller has enough answers,
    the first of which took `first` seconds."""
    return max(SETTLED_GRACE, SETTLED_FACTOR * first)


def deadline(rtt: float | None, timeout: float, first: float | None, settled: float | None = None) -> float:
    """Seconds after the asking at which a peer whose last answer took `rtt` (None: never heard
    from) is given up: `first`, when the first answer came (None: none yet); `settled`, when the
    caller had enough (None: not yet, or it needs every answer)."""
    if first is None:
        return timeout
    if rtt is not None:
        return grace(rtt, timeout)
    if settled is not None:
        return min(timeout, settled + settled_grace(first))
    return timeout


async def ask_all(
    calls: Mapping[K, Awaitable[T]], rtts: Mapping[K, float], timeout: float, answered: Callable[[T], bool],
    unknown_like_first: bool = False,
) -> dict[K, T | None]:
    """Run `calls` at once; each one's result, or None for those given up (`deadline`). The calls
    return rather than raise, and end by themselves within `timeout`; those given up are cancelled.
    `answered` says which results count as an answer (a peer that says it is leaving answered)."""
    results, _ = await _ask(calls, rtts, timeout, answered, unknown_like_first, None)
    return results


async def ask_until_enough(
    calls: Mapping[K, Awaitable[T]], rtts: Mapping[K, float], timeout: float, answered: Callable[[T], bool],
    enough: Callable[[set[K]], bool],
) -> tuple[dict[K, T | None], dict[K, asyncio.Task]]:
    """Like `ask_all`, but once `enough(the keys that answered)` holds, peers never heard from are
    waited for only `settled_grace()` more: the second mapping holds their calls, still running
    (None in the first), which the caller owns from then on."""
    return await _ask(calls, rtts, timeout, answered, False, enough)


async def _ask(calls, rtts, timeout, answered, unknown_like_first, enough):
    loop = asyncio.get_running_loop()
    tasks = {asyncio.ensure_future(call): key for key, call in calls.items()}
    results: dict = dict.fromkeys(calls)
    left: dict = {}
    start, first, settled = loop.time(), None, None  # seconds the first answer took; when enough held
    heard: set = set()
    pending = set(tasks)

    def rtt(task: asyncio.Future) -> float | None:
        return rtts.get(tasks[task], first if unknown_like_first else None)

    def due(task: asyncio.Future) -> float:
        return deadline(rtt(task), timeout, first, settled)

    try:
        while pending:
            done, pending = await asyncio.wait(pending, timeout=max(min(map(due, pending)) - (loop.time() - start), 0.0),
                                               return_when=asyncio.FIRST_COMPLETED)
            elapsed = loop.time() - start
            for task in done:
                results[tasks[task]] = task.result()
                if answered(task.result()):
                    heard.add(tasks[task])
                    first = elapsed if first is None else first
            if settled is None and enough is not None and heard and enough(set(heard)):
                settled = elapsed
            over = {t for t in pending if elapsed >= due(t)}
            left.update((tasks[t], t) for t in over if settled is not None and rtt(t) is None and elapsed < timeout)
            pending -= over
    finally:
        kept = set(left.values())
        for task in tasks:
            if task not in kept:
                task.cancel()
    return results, left
