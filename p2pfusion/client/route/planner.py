"""Pick a chain of peers that covers every layer: a pure function of the DHT's records and of
what this client has seen itself (peers' observed speeds and ping times, peers it has banned, the
sessions it has open through each). Nothing a peer reports about another peer's speed is used;
what a peer says of its own load only steers sessions away from it."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import replace

from p2pfusion.dht.coverage import planned
from p2pfusion.dht.records import PeerRecord, PeerState, span_throughput
from p2pfusion.errors import PromptTooLong, RouteError

log = logging.getLogger(__name__)


def usable(
    records: list[PeerRecord], banned: Collection[str] = (), *, backups: bool = False, length: int = 0
) -> list[PeerRecord]:
    """Peers a route may use: online ones (and warm backups when failing over) that accept sessions
    of `length` tokens."""
    states = (PeerState.ONLINE, PeerState.BACKUP) if backups else (PeerState.ONLINE,)
    return [r for r in records if r.state in states and r.peer_id not in banned and r.session_limit >= length]


def _covered(records: list[PeerRecord], num_layers: int, first: int) -> list[bool]:
    covered = [layer < first for layer in range(num_layers)]
    for r in records:
        for layer in range(r.start, min(r.end, num_layers)):
            covered[layer] = True
    return covered


def _ranges(flags: list[bool]) -> list[tuple[int, int]]:
    """The runs of True in `flags`, as ranges [start, end)."""
    runs, start = [], None
    for layer, flag in enumerate(flags + [False]):
        if flag and start is None:
            start = layer
        elif not flag and start is not None:
            runs.append((start, layer))
            start = None
    return runs


def pinned(records: list[PeerRecord], peer_id: str) -> list[PeerRecord]:
    """The records a route through `peer_id` may use: its own, and those of other peers whose
    layers do not overlap its (empty when it has no record)."""
    own = [r for r in records if r.peer_id == peer_id]
    if not own:
        return []
    start, end = own[0].start, own[0].end
    return [r for r in records if r.peer_id == peer_id or r.end <= start or r.start >= end]


def missing_layers(records: list[PeerRecord], num_layers: int, first: int = 0) -> list[tuple[int, int]]:
    """Ranges [start, end) from layer `first` on that none of these peers serves."""
    return _ranges([not ok for ok in _covered(records, num_layers, first)])


def gaps_closing(records: list[PeerRecord], num_layers: int, banned: Collection[str] = (), first: int = 0) -> bool:
    """Do peers already make ready every layer from `first` on that online peers (less `banned`)
    leave unserved: warm backups, joining peers loading them, peers announcing a move there? A
    session about to open then waits for them, as one in progress does; with no peer coming it
    fails at once, naming the layers."""
    online = usable(records, banned)
    if not missing_layers(online, num_layers, first):
        return False
    coming = [
        planned(r) for r in records
        if r.peer_id not in banned and (r.state in (PeerState.BACKUP, PeerState.JOINING) or r.moving_to is not None)
    ]
    return not missing_layers(online + coming, num_layers, first)


def format_ranges(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}:{b}" for a, b in ranges)


def refused_only(
    records: list[PeerRecord], accepted: list[PeerRecord], num_layers: int, first: int = 0
) -> tuple[list[tuple[int, int]], list[str]]:
    """The layers from `first` on that online peers serve only in formats the client refused
    (`records` less `accepted`), as ranges, and those formats."""
    online = [r for r in records if r.state == PeerState.ONLINE]
    kept = {r.peer_id for r in accepted}
    served = _covered(online, num_layers, first)
    taken = _covered([r for r in online if r.peer_id in kept], num_layers, first)
    ranges = _ranges([s and not t for s, t in zip(served, taken)])
    return ranges, sorted({r.weights for r in online if r.peer_id not in kept})


HOP_SECONDS = 0.003  # a round trip to a peer, or between two, where nobody measured it
UNOBSERVED_CAP = 4.0  # a peer never observed is expected at most this many times the best one observed


def expected_throughput(record: PeerRecord, observed: Mapping[str, float], best: float | None = None) -> float:
    """Tokens/s this client expects of a peer through its span: what the peer advertises, but
    never more than this client observed of it, nor, for a peer it never observed, more than
    UNOBSERVED_CAP times the best per-layer rate it observed of any peer (`best`, by default
    taken from `observed`). A record may claim anything; a claim wins only until it is observed."""
    rate = observed.get(record.peer_id)
    if rate is None:
        best = max(observed.values(), default=None) if best is None else best
        if best is None:
            return record.throughput
        rate = UNOBSERVED_CAP * best
    return min(record.throughput, span_throughput(rate, None, record.span))


FULL_SECONDS = 1.0  # per token, at a peer without cache room for the session: a last resort
NEAR_FULL = 0.75  # of a peer's cache budget reserved: past it, the peer costs more as it fills
NEAR_FULL_SECONDS = 0.05  # per token, at a peer that the session would fill to its budget
MAX_BATCH_GAIN = 64.0  # a token in a batch costs at least 1/64 of a step alone, whatever a record claims


def load_seconds(record: PeerRecord, step: float, tokens: int = 0, own: int = 0) -> float:
    """Seconds per token a session expects to lose at a peer to what the peer holds already.

    `step` is the seconds a token takes through the peer alone, `tokens` the KV positions the
    session reserves (batch x length), `own` the sessions this client has open through the
    peer (its record may not count them yet). Each step already queued comes first; each open
    session shares the peer's batched forward (`batch_rate`; a peer announcing none runs steps
    one by one); and a peer filling its KV cache budget refuses sessions soon: it costs more past
    NEAR_FULL of it, and FULL_SECONDS when the session does not fit.
    """
    sessions = max(record.sessions, own)
    batched = record.span / record.batch_rate if record.batch_rate > 0 else step
    share = sessions * max(batched, step / MAX_BATCH_GAIN)
    seconds = record.queued * step + share
    if record.cache_total <= 0:
        return seconds
    filled = (record.cache_used + tokens * record.token_bytes) / record.cache_total
    if filled > 1:
        return seconds + FULL_SECONDS
    return seconds + NEAR_FULL_SECONDS * max(filled - NEAR_FULL, 0.0) / (1 - NEAR_FULL)


def find_route(
    records: list[PeerRecord],
    num_layers: int,
    *,
    observed: Mapping[str, float] | None = None,
    banned: Collection[str] = (),
    backups: bool = False,
    length: int = 0,
    rtts: Mapping[str, float] | None = None,
    batch: int = 1,
    own: Mapping[str, int] | None = None,
    first: int = 0,
) -> list[PeerRecord]:
    """The chain of peers with the least expected time per token from layer `first` (the layers
    before it run on the client) to the last, online peers before backups.

    A token's time through a route is its trip around it plus each hop's work: the client's own
    one-way time to the first hop and back from the last (half its ping, `rtts`), the one-way time
    between consecutive hops (`link_seconds`), and at each hop 1/throughput (as
    `expected_throughput` sees it) and what its load costs (`load_seconds`, for a session of
    `batch` x `length` positions, with `own` the sessions this client holds through each peer).
    A hop starts at the exact layer where the previous one ended (a peer's first layer), and may
    end before the peer's last layer, where another hop starts: the peer then runs (and caches)
    only the layers up to there, and the route holds its record cut short (`Stage.first_layers`).
    """
    candidates = [r for r in usable(records, banned, backups=backups, length=length) if r.end <= num_layers]
    gaps = missing_layers(candidates, num_layers, first)
    if gaps:
        if length and not missing_layers(usable(records, banned, backups=backups), num_layers, first):
            raise RouteError(f"no peer accepting sessions of {length} tokens serves layers {format_ranges(gaps)}")
        raise RouteError(f"no peer serves layers {format_ranges(gaps)} of this model{_left_out(records, banned, gaps)}")
    observed, rtts, own = observed or {}, rtts or {}, own or {}
    best_rate = max(observed.values(), default=None)
    exits = {r.start for r in candidates} | {num_layers}  # a hop ending elsewhere leads nowhere
    # best[(peer id, end)] = (backups, seconds per token, layers its hops leave unused, route) of
    # the best route from `first` to that end, its last hop that peer's. Of equally fast routes,
    # the one that cuts peers' ranges least: it leaves the rest of a stage to routes that need it
    best: dict[tuple[str, int], tuple[int, float, int, list[PeerRecord]]] = {}
    ending: dict[int, list[tuple[str, int]]] = {}
    for r in sorted(candidates, key=lambda r: r.start):
        before = [best[key] for key in ending.get(r.start, ())]
        if r.start != first and not before:
            continue
        spare = int(r.state == PeerState.BACKUP)
        for end in sorted(e for e in exits if r.start < e <= r.end):
            hop = r if end == r.end else replace(r, end=end)
            step = 1.0 / max(expected_throughput(hop, observed, best_rate), 1e-9)
            work = step + load_seconds(hop, step, batch * length, own.get(r.peer_id, 0))
            cut = r.end - end
            if r.start == first:
                choice = (spare, rtts.get(r.peer_id, HOP_SECONDS) / 2 + work, cut, [hop])
            else:
                choice = min(
                    ((spares + spare, seconds + link_seconds(route[-1], r, rtts) + work, unused + cut, route + [hop])
                     for spares, seconds, unused, route in before),
                    key=lambda c: c[:3],
                )
            best[(r.peer_id, end)] = choice
            ending.setdefault(end, []).append((r.peer_id, end))
    finished = [
        (spares, seconds + rtts.get(route[-1].peer_id, HOP_SECONDS) / 2, unused, route)
        for key in ending.get(num_layers, ()) for spares, seconds, unused, route in [best[key]]
    ]
    if not finished:
        raise RouteError(f"online peers cover every layer, but their ranges do not chain from layer {first} to the end")
    return min(finished, key=lambda c: c[:3])[3]


def link_seconds(a: PeerRecord, b: PeerRecord, rtts: Mapping[str, float]) -> float:
    """One-way seconds from hop `a` to hop `b`: half the round trip the two peers measured between
    them, the larger of their two words (one lying low cannot draw routes without the other's), and
    never less than this client's own pings allow (a round trip differs from the client's to either
    end by no more than the link itself); HOP_SECONDS where neither measured it."""
    claimed = a.round_trip_with(b)
    to_a, to_b = rtts.get(a.peer_id), rtts.get(b.peer_id)
    floor = abs(to_a - to_b) if to_a is not None and to_b is not None else 0.0
    return max(HOP_SECONDS if claimed is None else claimed, floor) / 2


def _left_out(records: list[PeerRecord], banned: Collection[str], gaps: list[tuple[int, int]]) -> str:
    """What to add when peers do claim some of `gaps` but were left out."""
    claimants = sorted({r.peer_id for r in records if r.peer_id in banned and any(r.start < b and a < r.end for a, b in gaps)})
    if not claimants:
        return ""
    named = ", ".join(claimants[:3]) + (f" and {len(claimants) - 3} more" if len(claimants) > 3 else "")
    return f": peers claim them ({named}), but this client left them out: they did not answer it, were busy, or failed its checks"


def longest_session(
    records: list[PeerRecord], num_layers: int, positions: int, *, banned: Collection[str] = (), first: int = 0
) -> int:
    """The longest session (in tokens) a client can open now: the model's positions, or less where
    no route of online peers from layer `first` accepts more (each peer announces its own
    session limit). A session of that length has a route: `find_route(..., length=...)` picks among
    the peers that accept it."""
    find_route(records, num_layers, banned=banned, first=first)  # no route at all: the RouteError naming the gaps
    lengths = sorted({r.session_limit for r in usable(records, banned)})
    # if the peers accepting n tokens chain through every layer, those accepting fewer do too
    low, high = 0, len(lengths) - 1  # a route accepts lengths[low]
    while low < high:
        mid = (low + high + 1) // 2
        try:
            find_route(records, num_layers, banned=banned, length=lengths[mid], first=first)
            low = mid
        except RouteError:
            high = mid - 1
    return min(positions, lengths[low])


def new_tokens_within(prompt: int, wanted: int, limit: int) -> int:
    """How many of the `wanted` new tokens fit after a `prompt` of that many tokens in the swarm's
    `limit` (`longest_session`): a prompt that fills it is refused, and a generation that would
    pass it is cut there, with a warning, as transformers stops at max_length."""
    if prompt >= limit:
        raise PromptTooLong(f"prompt too long: {prompt} tokens, the swarm accepts {limit}")
    if prompt + wanted > limit:
        log.warning("the swarm accepts %d tokens: generating %d new tokens, not %d", limit, limit - prompt, wanted)
        return limit - prompt
    return wanted
