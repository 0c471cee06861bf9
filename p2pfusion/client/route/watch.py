"""Finding the hop that froze: a step (or a route's opening) that takes far longer than usual is
looked into.

A peer that is killed resets its connections, and its neighbours and the client learn at once. A
peer whose host is suspended, or gone without a reset, keeps them open and answers nothing. A step
through it waited out its whole timeout, which names no peer; the next route, among peers that
had answered a ping within the last minute, could go through it again, and its opening, which
waits for every hop to hand over to the next, then blamed the first hop (docs/benchmarks.md,
"Churn and balancing": a frozen peer cost a generation 31 s with a warm backup beside it). So once
a step or an opening has run `suspect_after` (many times the usual step, at least MIN_SUSPECT),
the client pings the route's hops itself, all at once, and a peer off the route that answered it
lately beside them; a hop still silent once another peer answered, after many times its usual
round trip (net/silence.py; within SILENCE in any case), is the one that failed. When every hop
answers (a long prefill, a busy peer), the step goes on, looked into again each `suspect_after`;
when no peer answers, the fault is more likely this client's own network, and the step's
timeout decides.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from p2pfusion.client.route.pings import ReachBook
from p2pfusion.dht.records import PeerRecord
from p2pfusion.errors import PeerFailed
from p2pfusion.net.transport import Transport

SUSPECT_FACTOR = 5.0  # times the usual one-token step: a step looked into for nothing costs a ping a hop
MIN_SUSPECT = 1.0  # seconds
SILENCE = 2.0  # seconds a live peer has to answer a ping: a fresh connection across a continent

T = TypeVar("T")


def suspect_after(step_seconds: float | None) -> float:
    """Seconds a step runs before its hops are pinged: the usual one-token step's time (None
    before any) times SUSPECT_FACTOR, at least MIN_SUSPECT."""
    return max(MIN_SUSPECT, SUSPECT_FACTOR * (step_seconds or 0.0))


def frozen_hop(route: list[PeerRecord], silent: set[str], reference_answered: bool = False) -> str | None:
    """The hop to blame: the first of the route's that did not answer, when some other peer did
    (another hop, or the reference pinged beside them)."""
    if not silent or (all(r.peer_id in silent for r in route) and not reference_answered):
        return None
    return next((r.peer_id for r in route if r.peer_id in silent), None)


async def watched(
    step: Awaitable[T], route: list[PeerRecord], reach: ReachBook, transport: Transport, step_seconds: float | None,
    reference: Callable[[], PeerRecord | None] = lambda: None,
) -> T:
    """The step's result; PeerFailed naming a hop that stopped answering while it ran. `reference`:
    the peer off the route to ping beside its hops (`ReachBook.quickest`), asked for only then."""
    loop = asyncio.get_running_loop()
    task, started = asyncio.ensure_future(step), loop.time()
    wait = suspect_after(step_seconds)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=wait)
            if done:
                return task.result()
            asked, beside = loop.time(), reference()
            silent = await reach.screen(transport, route, SILENCE, beside)
            peer = frozen_hop(route, silent, beside is not None and reach.fresh(beside.peer_id))
            if peer is not None and not task.done():
                raise PeerFailed(
                    f"peer {peer} stopped answering: no answer to a ping within {loop.time() - asked:.1f} s, its step "
                    f"{loop.time() - started:.1f} s in (a token's step takes {step_seconds or 0.0:.2f} s)", peer,
                )
    finally:
        if not task.done():
            task.cancel()  # the caller drops the route
