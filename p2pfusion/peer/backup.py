"""When a warm backup takes over a stage: pure functions of two snapshots of the DHT's records.

A stage has lost a peer when a peer that served layers of the backup's range has since expired,
announced itself offline, or was reported unreachable by a client and failed our own check.
For one loss, exactly one backup should promote. With no broker to ask, every candidate ranks the
candidates the same way (fastest first, then by peer id); the first promotes at once, and each
later one waits its turn and promotes only if the stage still has no new server by then.
"""

from __future__ import annotations

from p2pfusion.dht.records import PeerRecord, PeerState

PROMOTION_STAGGER = 3.0  # seconds between candidates: longer than a DHT write takes to be seen


def _overlaps(r: PeerRecord, start: int, end: int) -> bool:
    return r.start < end and start < r.end


def stage_servers(records: list[PeerRecord], start: int, end: int, gone: set[str] = frozenset()) -> set[str]:
    """Peers that serve some layer of [start, end) now, leaving out those known to be gone."""
    return {
        r.peer_id for r in records
        if r.state == PeerState.ONLINE and _overlaps(r, start, end) and r.peer_id not in gone
    }


def lost_servers(before: set[str], records: list[PeerRecord], start: int, end: int, gone: set[str]) -> set[str]:
    return before - stage_servers(records, start, end, gone)


def promotion_rank(records: list[PeerRecord], me: PeerRecord) -> int:
    """My place among the backups of my stage: 0 promotes first."""
    candidates = [
        r for r in records
        if r.state == PeerState.BACKUP and (r.start, r.end) == (me.start, me.end) and r.moving_to is None
    ]  # a backup announcing a move to another stage is not waited for
    if me.peer_id not in {r.peer_id for r in candidates}:
        candidates.append(me)
    ordered = sorted(candidates, key=lambda r: (-r.compute_rate, r.peer_id))
    return [r.peer_id for r in ordered].index(me.peer_id)


def replaced(before: set[str], records: list[PeerRecord], start: int, end: int, gone: set[str]) -> bool:
    """Has a peer that did not serve the stage before the loss started to serve it since?"""
    return bool(stage_servers(records, start, end, gone) - before)
