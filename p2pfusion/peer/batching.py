"""Which waiting jobs a stage runs next, and which of them run together as one batch (pure).

Jobs are steps of sessions: decode steps of a token or two, prefill chunks, training steps. Each
job names its fairness unit: the connection that sent the session (a client's key within its
address, or the upstream peer that relays it), then, for relayed sessions, the client that the
relaying hop names ("conn>client"). Shares are split at the connection first and among its clients
second, so a relaying peer's claims divide only its own share. Each unit is charged the compute
time its jobs took (`used`, with an entry for the connection and one for the unit). So:
- the least-served unit goes first, not the oldest job: a client sending prefill after prefill,
  or running hundreds of sessions, falls behind the others instead of ahead of them;
- of equally served units' jobs, decode steps (one position per sequence) go before prefill chunks
  and training steps, and after one of those, decode steps waiting go next unless all of them
  are of units served more than a chunk's: a decode step waits for at most one chunk, however
  many sessions of its client are starting at the same moment, except behind the prompt of a
  unit served less (which the scheduler lets come back at most RETURN_CREDIT behind);
- the first job's decode steps of the same stage and kind (`key`) run in the same batch with
  those of other units, least served first, taking turns, at most SOURCE_ROWS positions per
  unit; a unit more than `slack` seconds of compute ahead of the first's does not join, so a
  heavy client cannot slow everyone's batch down by filling it (it runs its own in between);
- decode steps that a client sent as one cohort (client/generate/lockstep.py; net/messages.py
  `Cohort`) run once all of the cohort's steps are here: until then they are `unready`, and wait
  for the rest rather than split it (a cohort split in two pays for two reads of the stage's
  weights, at every hop after), up to a batch's share of one unit; the scheduler's gathering
  moment bounds that wait.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

MAX_BATCH_ROWS = 64  # positions in one batched forward
SOURCE_ROWS = 16  # positions of one unit in one batched forward
SLACK = 0.25  # seconds of compute a unit may be ahead of the first job's and still share its batch
# a decode step's compute counts for this much of its time: between a client decoding and one
# prefilling, both wanting more than half the peer, the decoding one gets two thirds, so a flood
# of prefills slows others' tokens by less than half (docs/benchmarks.md)
DECODE_CHARGE = 0.5
UNIT_SEPARATOR = ">"


def fairness_unit(connection: str, claimed: str | None) -> str:
    """The unit a session's steps are charged to: its connection, and the client it claims."""
    return connection if claimed is None else f"{connection}{UNIT_SEPARATOR}{claimed}"


def connection_of(unit: str) -> str:
    return unit.split(UNIT_SEPARATOR, 1)[0]


@dataclass(frozen=True)
class Pending:
    source: str  # the fairness unit
    rows: int
    order: int  # arrival
    key: Hashable | None = None  # jobs with the same key may run as one batch; None: alone
    prefill: bool = False  # many positions per sequence: a prefill chunk or a training step
    cohort: tuple[int, int] | None = None  # (tag, size) of the cohort its client sent it in


def charged(job: Pending, seconds: float) -> float:
    """The compute seconds a unit is charged for `seconds` of its job's run."""
    return seconds if job.prefill else DECODE_CHARGE * seconds


def served(unit: str, used: Mapping[str, float]) -> tuple[float, float]:
    """How much a unit was served: its connection's seconds, then its own."""
    return used.get(connection_of(unit), 0.0), used.get(unit, 0.0)


def next_batch(
    pending: list[Pending],
    used: Mapping[str, float],
    after_prefill: bool,
    max_rows: int = MAX_BATCH_ROWS,
    source_rows: int = SOURCE_ROWS,
    slack: float = SLACK,
) -> list[int]:
    """Indices into `pending` of the jobs to run next, together (the first leads). `used`: compute
    seconds so far per connection and per unit (absent: 0); `after_prefill`: the last job was a prefill."""
    decode = [i for i, job in enumerate(pending) if not job.prefill]
    # after a chunk, decode steps go next, unless all are of units served more than some waiting
    # job's: a returning user's prompt is not cut by a busier unit's steps at every chunk
    least = min(served(job.source, used) for job in pending)
    turn = after_prefill and decode and min(served(pending[i].source, used) for i in decode) <= least
    candidates = decode if turn else range(len(pending))
    lead = min(candidates, key=lambda i: (served(pending[i].source, used), pending[i].prefill, pending[i].order))
    key = pending[lead].key
    if key is None:
        return [lead]
    chosen, rows = [lead], pending[lead].rows
    per_unit = {pending[lead].source: rows}
    near = [
        i for i, job in enumerate(pending)
        if i != lead and job.key == key and within(job.source, pending[lead].source, used, slack)
    ]
    for i in _turns(near, pending, used):
        job = pending[i]
        own = per_unit.get(job.source, 0) + job.rows
        if rows + job.rows <= max_rows and own <= source_rows:
            chosen.append(i)
            rows += job.rows
            per_unit[job.source] = own
    return chosen


def unready(pending: list[Pending], source_rows: int = SOURCE_ROWS) -> set[int]:
    """Indices of the steps whose cohort has not all come yet: fewer of its connection's steps with
    its tag are waiting than its size, and fewer of its unit's rows than a batch takes of one unit
    (`source_rows`: a bigger cohort runs in parts anyway, each as soon as it is in). A
    connection's tags are its own, so no other connection completes them; the units it names
    share them (an API's cohorts hold several users' sessions)."""
    steps, rows = Counter(), Counter()
    for job in pending:
        if job.cohort is not None:
            steps[connection_of(job.source), job.cohort] += 1
            rows[job.source, job.cohort] += job.rows
    return {
        i for i, job in enumerate(pending)
        if job.cohort is not None
        and steps[connection_of(job.source), job.cohort] < job.cohort[1] and rows[job.source, job.cohort] < source_rows
    }


def within(unit: str, lead: str, used: Mapping[str, float], slack: float = SLACK) -> bool:
    """Whether `unit` was served at most `slack` more than `lead`: compared at the connection,
    or, within one connection, between the two units."""
    (conn, own), (lead_conn, lead_own) = served(unit, used), served(lead, used)
    if connection_of(unit) != connection_of(lead):
        return conn <= lead_conn + slack
    return own <= lead_own + slack


def _turns(indices: list[int], pending: list[Pending], used: Mapping[str, float]) -> list[int]:
    """`indices` ordered so that units take turns, least served first, each oldest first."""
    by_unit: dict[str, list[int]] = {}
    for i in sorted(indices, key=lambda i: pending[i].order):
        by_unit.setdefault(pending[i].source, []).append(i)
    queues = [by_unit[u] for u in sorted(by_unit, key=lambda u: (served(u, used), u))]
    ordered = []
    for depth in range(max((len(q) for q in queues), default=0)):
        ordered.extend(q[depth] for q in queues if depth < len(q))
    return ordered
