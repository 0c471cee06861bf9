"""Typed messages of the training-run protocol: how a run's driver steers the replicas of each stage,
and how a joining replica copies the state of one already training.

Each request goes on a fresh stream and gets its answers there:
- `ApplyStep`: the inner step is complete on this replica (every micro-batch the driver routed here
  ran its backward pass): take the optimizer step. `Ack`, or an `Error` saying why not (the weights
  are then untouched).
- `DiscardStep`: drop the gradients gathered for the step (the driver redoes it elsewhere).
- `OuterStep`: average the pseudo-gradient with the group named and take the outer step. `OuterDone`
  once done (the members the robust mean left out, proof against those that sealed two digests,
  and the digest of the replica's outer weights after the step), or an `Error` (the weights are
  then untouched, and the driver may retry the round with the members that answer).
- `FetchState`: the replica's state, as `StatePart` frames (one tensor each) and a `StateEnd`.
- `Status`: a `StateEnd` alone: where the replica is. One behind the driver's round catches up
  by copying the state of a replica that is not; one at it whose outer weights are not those
  most replicas hold (the request's `digest`) copies theirs.
The micro-batches themselves travel as training sessions of the inference protocol (net/messages.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from p2pfusion.errors import RequestError
from p2pfusion.net import messages as m
from p2pfusion.net.wire import MAX_PEER_KEY_BYTES, MAX_PEER_SIG_BYTES, Bound, Check, Length

PROTOCOL = "p2pfusion.train.v1"
MAX_GROUP = 64  # replicas of one stage that average together
MAX_RUN_NAME = 64
MAX_NUMBER = 1 << 53  # counts past it are no count a replica could hold
STATE_KINDS = ("outer", "momentum", "exp_avg", "exp_avg_sq")
MAX_PROOFS = 16  # two-faced members a replica reports for one round


def averaging_namespace(model: str, run: str) -> str:
    """What a run's averaging rounds are sealed under: two runs on one host never mix their rounds."""
    return f"{model}.{run}"


def group_id(model: str, run: str, start: int, end: int, round_: int, attempt: int, group: list[str]) -> bytes:
    """One averaging round of a stage: the driver and every member name it alike."""
    text = f"{model}|{run}|{start}:{end}|{round_}|{attempt}|{','.join(sorted(group))}"
    return hashlib.sha256(text.encode()).digest()[:16]


def is_run_name(name: str) -> bool:
    return 0 < len(name) <= MAX_RUN_NAME and all(c.isalnum() or c in "-_." for c in name)


def check_run_name(name: str) -> str:
    """`name`, or a RequestError saying what a run name is (for names a user typed)."""
    if not is_run_name(name):
        raise RequestError(f"a run name is 1 to {MAX_RUN_NAME} letters, digits, '-', '_' or '.', got {name[:80]!r}")
    return name


RunName = Annotated[str, Check(is_run_name, f"a run name: 1 to {MAX_RUN_NAME} letters, digits, '-', '_' or '.'")]
Count = Annotated[int, Bound(0, MAX_NUMBER)]
Text = Annotated[str, Length(256)]
StateKind = Annotated[str, Check(lambda part: part in STATE_KINDS, f"one of {', '.join(STATE_KINDS)}")]


@dataclass(frozen=True)
class ApplyStep:
    kind: ClassVar[str] = "apply_step"
    run: RunName
    round: Count  # the outer step the driver's window follows: a replica behind it is refused
    step: Count
    passes: Count  # backward passes the driver's micro-batches ran here (a check)
    chains: Count  # micro-batches among them, each with its own mean loss: the gradients' divisor
    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass(frozen=True)
class DiscardStep:
    kind: ClassVar[str] = "discard_step"
    run: RunName
    step: Count


@dataclass(frozen=True)
class OuterStep:
    kind: ClassVar[str] = "outer_step"
    run: RunName
    round: Count
    group: Annotated[list[m.Id], Length(MAX_GROUP)]
    attempt: Count = 0
    lr: float = 0.7
    momentum: float = 0.9
    timeout: float = 30.0
    compression: Text = "none"


@dataclass(frozen=True)
class TwoSeals:
    """A member's seals over two digests in one averaging round, with its public key: proof that
    it sent different tensors to different members (net/seals.py checks it)."""

    member: m.Id
    key: Annotated[bytes, Length(MAX_PEER_KEY_BYTES)]
    first: Annotated[bytes, Length(32, 32)]
    first_sig: Annotated[bytes, Length(MAX_PEER_SIG_BYTES)]
    second: Annotated[bytes, Length(32, 32)]
    second_sig: Annotated[bytes, Length(MAX_PEER_SIG_BYTES)]


@dataclass(frozen=True)
class OuterDone:
    """A replica took the outer step; `left_out`: the members whose pseudo-gradients its robust
    mean left out (every honest member leaves out the same)."""

    kind: ClassVar[str] = "outer_done"
    left_out: Annotated[list[m.Id], Length(MAX_GROUP)]
    digest: Annotated[bytes, Length(32)] = b""  # sha256 of its outer weights after the step
    two_faced: Annotated[list[TwoSeals], Length(MAX_PROOFS)] = field(default_factory=list)


@dataclass(frozen=True)
class FetchState:
    kind: ClassVar[str] = "fetch_state"
    run: RunName
    model: Text
    start: Count
    end: Count
    weights_only: bool = False


@dataclass(frozen=True)
class Status:
    kind: ClassVar[str] = "status"
    run: RunName
    round: Count = 0  # the driver's: a replica behind it fetches the current state from another replica
    # the outer weights' digest most of the stage's replicas took the driver's last outer step to:
    # a replica at `round` holding others copies theirs (an averaging round it saw otherwise)
    digest: Annotated[bytes, Length(32)] = b""


@dataclass(frozen=True)
class StatePart:
    """One parameter's tensor of one kind (`STATE_KINDS`); the tensor travels beside the header."""

    kind: ClassVar[str] = "state_part"
    part: StateKind
    name: Text


@dataclass(frozen=True)
class StateEnd:
    kind: ClassVar[str] = "state_end"
    run: RunName
    start: Count
    end: Count
    step: Count
    round: Count
    micro: Count
    adam_steps: Count
    names: Count  # parameters the replica holds (StatePart frames per kind)
    averaged_bytes: Count = 0  # tensor bytes it sent in its averaging rounds, since it started
    digest: Annotated[bytes, Length(32)] = b""  # sha256 of its outer weights: replicas in step hold the same


MESSAGES = {
    cls.kind: cls for cls in (
        ApplyStep, DiscardStep, OuterStep, OuterDone, FetchState, Status, StatePart, StateEnd, m.Ack, m.Error,
    )
}


def to_header(message: Any) -> dict[str, Any]:
    return m.to_header(message)


def from_header(header: dict[str, Any]) -> Any:
    """The training-run message (or Ack, Error reply) a decoded header holds, or a RequestError saying why not."""
    return m.from_header(header, MESSAGES)
