"""Not waiting on a DHT node that stays silent while others answer.

hivemind's traversals (a read, a store's search for the key's nearest nodes, a join's search for
its own neighbours) end only when every node they asked has answered or timed out, after the
protocol's `wait_timeout` (3 s). A node that neither answers nor refuses (its host suspended, or
gone without a reset, its connection still open) then costs 3 s to every traversal that asks it,
and every client that joins beside it pays that at least once (docs/benchmarks.md, "Silent peers").

`Patience` wraps the protocol's `call_find`, through which all of them ask, its `call_store`, on
which a store waits for every replica it sends to, and the pings of `SwarmNode.heal` (a read that
found nothing pings the peers its node lost). A request is given up, as a failed one, once it has
waited `grace()` (a few times the slower answers that node gave lately, or, where it gave none,
all nodes; never under MIN_GRACE) and another node has answered: in the same read (`reading()`),
or, for hivemind's own traversals and stores, since the request was sent. A store then sends to
the next nearest node instead. Nothing is given up while no node answers, so a slow network, or a
busy machine where every answer is late, waits as before. A request given up goes on: an answer
that comes later still counts towards `grace()` and lifts the node's blacklisting (hivemind
blacklists a node whose request failed, for seconds).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from hivemind.dht.node import Blacklist
from hivemind.p2p import PeerID

MIN_GRACE = 0.5  # seconds: a first dial's handshake across a continent takes a few round trips
GRACE_FACTOR = 4.0  # times the slower answers of late
RECENT = 32  # answers remembered
PEER_RECENT = 8  # answers remembered of each peer
MAX_PEERS = 1024  # peers whose answers are remembered
QUANTILE = 0.9


@dataclass
class _Read:
    answered: int = 0  # nodes that answered this read so far


_read: ContextVar[_Read | None] = ContextVar("dht_read", default=None)


@contextmanager
def reading() -> Iterator[None]:
    """The scope of one read: its traversal's requests (tasks it starts inherit the scope) count
    each other's answers."""
    token = _read.set(_Read())
    try:
        yield
    finally:
        _read.reset(token)


class Patience:
    """The answers a DHT node got lately, and its protocol's calls that give up on silent nodes
    (`wrap`; see the module's docstring)."""

    def __init__(self, blacklist: Blacklist):
        self._blacklist = blacklist
        self._answered = 0  # answers so far
        self._recent: deque[float] = deque(maxlen=RECENT)  # seconds each took
        self._by_peer: dict[PeerID, deque[float]] = {}  # the same, per peer, for the last MAX_PEERS peers
        self._answer = asyncio.Event()  # set, then replaced, at every answer

    def grace(self, peer: PeerID) -> float:
        """How long a request to `peer` waits, once others answered: its own answers' pace where
        it answered lately (the nodes holding a key many read are the busiest, and the slowest to
        answer: judged by the others' pace, they would be given up on, with the newest values),
        else all nodes'."""
        recent = self._by_peer.get(peer) or self._recent
        if not recent:
            return MIN_GRACE
        ordered = sorted(recent)
        return max(MIN_GRACE, GRACE_FACTOR * ordered[int(QUANTILE * (len(ordered) - 1))])

    def wrap(self, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """`call` (a DHTProtocol method to a peer, answering None when that peer fails) given up as
        failed when the peer stays silent while others answer."""

        async def patient(peer: PeerID, *args: Any, **kwargs: Any) -> Any:
            return await self._ask(call(peer, *args, **kwargs), peer)

        return patient

    async def _ask(self, request: Awaitable[Any], peer: PeerID) -> Any:
        loop = asyncio.get_running_loop()
        sent, answered, read = loop.time(), self._answered, _read.get()
        call = asyncio.ensure_future(request)
        call.add_done_callback(lambda done: self._settled(done, peer, loop.time() - sent, read))
        while not call.done():
            others = read.answered > 0 if read is not None else self._answered > answered
            left = sent + self.grace(peer) - loop.time() if others else None
            if left is not None and left <= 0:
                return None  # hivemind's own answer for a node that failed
            answer = asyncio.ensure_future(self._answer.wait())
            try:
                await asyncio.wait((call, answer), timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                answer.cancel()
        return call.result()

    def _settled(self, call: asyncio.Future, peer: PeerID, seconds: float, read: _Read | None) -> None:
        if call.cancelled() or call.exception() is not None or call.result() is None:
            return  # hivemind's calls answer None for every failure of their own
        self._recent.append(seconds)
        own = self._by_peer.pop(peer, None) or deque(maxlen=PEER_RECENT)
        own.append(seconds)
        self._by_peer[peer] = own  # the latest last
        if len(self._by_peer) > MAX_PEERS:
            del self._by_peer[next(iter(self._by_peer))]
        self._answered += 1
        if read is not None:
            read.answered += 1
        self._blacklist.register_success(peer)
        self._answer.set()
        self._answer = asyncio.Event()
