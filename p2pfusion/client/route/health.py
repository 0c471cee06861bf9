"""What a client has learned about peers: who failed it (banned, with growing back-off), who had
no room for it (skipped a while, as the peer's retry hint says), and how fast each peer really was
for it (an exponential moving average of observed speed).

Observed speed is kept per layer (layer-tokens/s), so it compares across spans, and it is saved
in the cache folder, so later runs and `p2pfusion swarm` start from what this machine saw. It
comes only from this client's own clock: the time its steps took end to end, shared by the
route's layers, and its one-hop timings of a peer (client/survey.py). Only finite positive figures are kept,
for the MAX_OBSERVED peers seen most recently.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from collections.abc import Iterable
from pathlib import Path

from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.models.source import cache_root, safe_name, write_json

log = logging.getLogger(__name__)

BAN_BASE = 5.0
BAN_MAX = 600.0
MAX_BANS = 10_000
EMA_WEIGHT = 0.2  # share of a new observation in the average
MAX_OBSERVED = 1000  # peers whose speed is kept: records are cheap to make, memory and disk are not
BUSY_BASE = 1.0  # a busy peer that gave no hint is skipped this long, twice as long each time in a row
BUSY_MAX = 16.0
HINT_MAX = 60.0  # a peer's hint is taken up to this long: it may not keep clients away for good


@dataclass
class Ban:
    failures: int
    until: float
    since: float = 0.0  # the peer's record's `since` when it failed us; a newer record lifts the ban


@dataclass
class Busy:
    times: int  # busy answers in a row
    until: float


@dataclass
class PeerHealth:
    bans: dict[str, Ban] = field(default_factory=dict)
    observed: dict[str, float] = field(default_factory=dict)
    busy: dict[str, Busy] = field(default_factory=dict)

    def was_busy(self, peer_id: str, retry_after: float | None = None, now: float | None = None) -> float:
        """Skip a peer that had no room: for its own `retry_after` (BUSY_BASE without one), twice
        as long each time it is busy again in a row, at most BUSY_MAX (or its hint, up to
        HINT_MAX). Returns the seconds it is skipped. Not a ban: every session of this client
        skips it, and tries it again after that."""
        now = time.monotonic() if now is None else now
        last = self.busy.get(peer_id)
        times = last.times + 1 if last is not None and last.until > now - BUSY_MAX else 1
        base = BUSY_BASE if retry_after is None else min(retry_after, HINT_MAX)
        seconds = min(base * 2 ** min(times - 1, 8), max(base, BUSY_MAX))
        if len(self.busy) >= MAX_BANS:
            self.busy = {p: b for p, b in self.busy.items() if b.until > now}
        self.busy[peer_id] = Busy(times, now + seconds)
        return seconds

    def skipped(self, now: float | None = None) -> set[str]:
        now = time.monotonic() if now is None else now
        return {peer for peer, busy in self.busy.items() if busy.until > now}

    def room_at(self, now: float | None = None) -> float | None:
        """When the first skipped peer may have room again; None if none is skipped."""
        now = time.monotonic() if now is None else now
        return min((b.until for b in self.busy.values() if b.until > now), default=None)

    def failed(self, peer_id: str, since: float = 0.0, now: float | None = None) -> float:
        """Ban a peer that failed us: 5 s, then twice as long each time it fails again. Returns the ban.
        `since` is when the record we routed by says the peer entered its state."""
        now = time.monotonic() if now is None else now
        failures = self.bans[peer_id].failures + 1 if peer_id in self.bans else 1
        if len(self.bans) >= MAX_BANS:  # fake records are cheap: forget the bans long over first
            self.bans = {p: b for p, b in self.bans.items() if b.until > now - BAN_MAX}
        duration = min(BAN_BASE * 2 ** (failures - 1), BAN_MAX)
        self.bans[peer_id] = Ban(failures, now + duration, since)
        return duration

    def banned(self, records: Iterable[PeerRecord] = (), now: float | None = None) -> set[str]:
        """Peers still banned. A peer whose record is newer than the one it failed under (it
        restarted, or moved and came back) is forgiven: it is a new process or a new stage."""
        now = time.monotonic() if now is None else now
        for r in records:
            ban = self.bans.get(r.peer_id)
            if ban is not None and r.since > ban.since and r.state in (PeerState.ONLINE, PeerState.BACKUP):
                del self.bans[r.peer_id]
        return {peer for peer, ban in self.bans.items() if ban.until > now}

    def succeeded(self, peer_id: str) -> None:
        """A peer that served a whole session well starts its back-off over."""
        self.bans.pop(peer_id, None)

    def observe(self, peer_id: str, layers: int, seconds: float, tokens: int = 1) -> None:
        """`layers` of a peer took `seconds` for `tokens` tokens, as this client timed them."""
        if not (0 < seconds < math.inf) or layers <= 0 or tokens <= 0:
            return
        rate = layers * tokens / seconds
        old = self.observed.pop(peer_id, None)  # re-inserted last: the most recently seen
        self.observed[peer_id] = rate if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * rate
        while len(self.observed) > MAX_OBSERVED:
            del self.observed[next(iter(self.observed))]


def _valid(rate: object) -> bool:
    return isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate < math.inf


def recent(observed: dict[str, float]) -> dict[str, float]:
    """The valid figures of the MAX_OBSERVED peers seen last (a dict keeps the order they were seen in)."""
    valid = [(str(k), float(v)) for k, v in observed.items() if _valid(v)]
    return dict(valid[-MAX_OBSERVED:])


def _path(model: str) -> Path:
    return cache_root() / "observed" / f"{safe_name(model)}.json"


def load_observed(model: str) -> dict[str, float]:
    try:
        raw = json.loads(_path(model).read_text())
    except (OSError, ValueError):
        return {}
    return recent(raw) if isinstance(raw, dict) else {}


def save_observed(model: str, observed: dict[str, float]) -> None:
    path = _path(model)
    try:
        write_json(path, recent(observed))
    except OSError as exc:  # a read-only cache must not fail an inference
        log.warning("cannot save observed peer speeds to %s: %s", path, exc)
