"""Whether a peer answers at all, asked by the client itself: a `Ping` on a fresh stream.

Records are written by strangers: one can name addresses that accept connections and never
answer (a tarpit), and a session opened there would wait out its whole timeout. So before a
route is opened, its peers are pinged, many at once with a short timeout each, and those that do
not answer are banned; answers are kept a minute. A route's search stops waiting for peers never
heard from once the peers that answered make a route (net/silence.py); their pings go on, and
their answers, or silence, count when they come. The same ping checks what one peer says about
another (that it failed, or is leaving) before the client believes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from p2pfusion.dht.records import PeerRecord
from p2pfusion.errors import PeerUnreachable, RequestError
from p2pfusion.net import messages as m
from p2pfusion.net.framing import FrameLimits, read_frame, write_frame
from p2pfusion.net.silence import ask_all, ask_until_enough
from p2pfusion.net.transport import Transport

log = logging.getLogger(__name__)

PING_TIMEOUT = 3.0  # a serving peer answers in milliseconds; a tarpit never does
SCREEN_CONCURRENCY = 64
ANSWER_TTL = 60.0  # how long a peer's answer spares it another ping before a route uses it
PING_LIMITS = FrameLimits(header=4096, body=0, tensor_kinds=frozenset())


class Answer(str, Enum):
    SERVING = "serving"
    LEAVING = "leaving"
    SILENT = "silent"  # no answer in time, a failed dial, or no answer a peer would give


def _answered(answer: tuple[Answer, float]) -> bool:
    return answer[0] != Answer.SILENT


async def ping(transport: Transport, peer_id: str, data_addrs: list[str], timeout: float = PING_TIMEOUT) -> tuple[Answer, float]:
    """Ask a peer whether it serves; returns its answer and the round trip of the ping itself
    (the stream's setup excluded), inf when it did not answer."""
    try:
        return await asyncio.wait_for(_ping(transport, peer_id, data_addrs, timeout), timeout)
    except TimeoutError:
        return Answer.SILENT, float("inf")


async def _ping(transport: Transport, peer_id: str, data_addrs: list[str], timeout: float) -> tuple[Answer, float]:
    try:  # half the time for a direct dial, and half for libp2p should that fail
        reader, writer = await transport.open(peer_id, data_addrs, m.PROTOCOL, timeout / 2)
    except PeerUnreachable as exc:
        log.debug("ping: cannot reach %s: %r", peer_id, exc)
        return Answer.SILENT, float("inf")
    try:
        t0 = time.perf_counter()
        await write_frame(writer, m.to_header(m.Ping()))
        header, _ = await read_frame(reader, PING_LIMITS)
        seconds = time.perf_counter() - t0
        reply = m.from_header(header)
    except (OSError, EOFError, RequestError, RuntimeError) as exc:  # RequestError: a bad frame or message
        log.debug("ping: no answer from %s: %r", peer_id, exc)
        return Answer.SILENT, float("inf")
    finally:
        writer.close()
    if isinstance(reply, m.Ack):
        return Answer.SERVING, seconds
    if isinstance(reply, m.Error) and reply.failed_peer == peer_id:
        return Answer.LEAVING, seconds
    return Answer.SILENT, float("inf")


@dataclass
class ReachBook:
    """The peers that answered this client lately, and how long their pings took."""

    answered: dict[str, float] = field(default_factory=dict)  # peer id -> when it last answered
    rtts: dict[str, float] = field(default_factory=dict)  # peer id -> its ping's round trip
    _asking: dict[str, asyncio.Task] = field(default_factory=dict, repr=False)  # pings a route's search left running

    def fresh(self, peer_id: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now - self.answered.get(peer_id, -ANSWER_TTL) < ANSWER_TTL

    async def screen(
        self, transport: Transport, records: list[PeerRecord], timeout: float = PING_TIMEOUT,
        reference: PeerRecord | None = None,
    ) -> set[str]:
        """Ping these peers, SCREEN_CONCURRENCY at a time; returns those that did not say they
        serve. Once one answers, a peer that answered before is waited for only a few of its round
        trips (net/silence.py); `reference`, a peer pinged beside them, is there to answer."""
        named = {r.peer_id for r in records}
        asked = records + ([reference] if reference is not None and reference.peer_id not in named else [])
        silent = set()
        for first in range(0, len(asked), SCREEN_CONCURRENCY):
            calls = self._calls(transport, asked[first:first + SCREEN_CONCURRENCY], timeout)
            silent |= self._learn(await ask_all(calls, self.rtts, timeout, _answered))
        self._forget_stale()
        return silent & named

    async def screen_for_route(
        self, transport: Transport, records: list[PeerRecord], enough: Callable[[set[str]], bool],
        silent_later: Callable[[str], None], reference: PeerRecord | None = None,
    ) -> tuple[set[str], set[str]]:
        """Ping up to SCREEN_CONCURRENCY of these peers as `screen` does, but stop waiting for those
        never heard from once `enough(the peers that answered)` holds. Returns the silent peers,
        and those not waited for: their pings go on, an answer is kept as any other, and
        `silent_later(peer_id)` is called for each that then does not answer."""
        named = {r.peer_id for r in records}
        asked = ([reference] if reference is not None and reference.peer_id not in named else []) + records
        calls = self._calls(transport, asked[:SCREEN_CONCURRENCY], PING_TIMEOUT)
        answers, left = await ask_until_enough(calls, self.rtts, PING_TIMEOUT, _answered, enough)
        silent = self._learn({k: v for k, v in answers.items() if k not in left})
        for peer_id, task in left.items():
            self._asking[peer_id] = task
            task.add_done_callback(lambda done, peer_id=peer_id: self._late(peer_id, done, silent_later))
        self._forget_stale()
        return silent & named, set(left) & named

    @staticmethod
    def _calls(transport: Transport, records: list[PeerRecord], timeout: float) -> dict:
        return {r.peer_id: ping(transport, r.peer_id, r.data_addrs, timeout) for r in records}

    def _learn(self, answers: dict) -> set[str]:
        """Keep the serving peers' answers; returns the others."""
        silent = set()
        for peer_id, answer in answers.items():
            if answer is not None and answer[0] == Answer.SERVING:
                self.answered[peer_id] = time.monotonic()
                self.rtts[peer_id] = answer[1]
            else:
                self.answered.pop(peer_id, None)
                silent.add(peer_id)
        return silent

    def asking(self) -> set[str]:
        """Peers whose pings a route's search left running: not heard from yet, not judged yet."""
        return set(self._asking)

    def _late(self, peer_id: str, done: asyncio.Task, silent_later: Callable[[str], None]) -> None:
        if self._asking.get(peer_id) is done:
            del self._asking[peer_id]
        if done.cancelled():
            return
        if self._learn({peer_id: done.result()}):
            silent_later(peer_id)

    def quickest(self, records: list[PeerRecord], exclude: set[str]) -> PeerRecord | None:
        """The quickest peer among `records` that answered lately, outside `exclude`: pinged beside
        others so that their silence is told from this client's own network failing."""
        known = [r for r in records if r.peer_id not in exclude and self.fresh(r.peer_id) and r.peer_id in self.rtts]
        return min(known, key=lambda r: self.rtts[r.peer_id], default=None)

    def _forget_stale(self) -> None:
        now = time.monotonic()
        for peer_id in [p for p, t in self.answered.items() if now - t >= ANSWER_TTL]:
            del self.answered[peer_id]
            self.rtts.pop(peer_id, None)
