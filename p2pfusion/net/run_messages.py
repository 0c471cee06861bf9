"""Typed messages of the training-run protocol: how a run's driver steers the replicas of each stage,
and how a joining replica copies the state of one already training.

Each request goes on a fresh stream and gets its answers there:
- `ApplyStep`: the inner step is complete on this replica (every micro-batch the driver routed here
  ran its backward pass): take the optimizer step. `Ack`, or an `Error` saying why not (the weights
  are then untouched).
- `DiscardStep`: drop the gradients gathered for the step (the driver redoes it elsewhere).
- `OuterStep`: average the pseudo-gradient with the group named and take the outer step. `Ack`
  once done, or an `Error` (the weights are then untouched, and the driver may retry the round
  with the members that answer).
- `FetchState`: the replica's state, as `StatePart` frames (one tensor each) and a `StateEnd`.
- `Status`: a `StateEnd` alone: where the replica is. One behind the driver's round catches up
  by copying the state of a replica that is not.
The micro-batches themselves travel as training sessions of the inference protocol (net/messages.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from p2pfusion.errors import RequestError
from p2pfusion.net import messages as m

PROTOCOL = "p2pfusion.train.v1"
MAX_GROUP = 64  # replicas of one stage that average together
MAX_RUN_NAME = 64
STATE_KINDS = ("outer", "momentum", "exp_avg", "exp_avg_sq")


def check_run_name(name: str) -> str:
    if not 0 < len(name) <= MAX_RUN_NAME or not all(c.isalnum() or c in "-_." for c in name):
        raise RequestError(f"a run name is 1 to {MAX_RUN_NAME} letters, digits, '-', '_' or '.', got {name[:80]!r}")
    return name


@dataclass(frozen=True)
class ApplyStep:
    kind: ClassVar[str] = "apply_step"
    run: str
    round: int  # the outer step the driver's window follows: a replica behind it is refused
    step: int
    passes: int  # backward passes the driver's micro-batches ran here (a check)
    chains: int  # micro-batches among them, each with its own mean loss: the gradients' divisor
    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass(frozen=True)
class DiscardStep:
    kind: ClassVar[str] = "discard_step"
    run: str
    step: int


@dataclass(frozen=True)
class OuterStep:
    kind: ClassVar[str] = "outer_step"
    run: str
    round: int
    group: list[str]
    attempt: int = 0
    lr: float = 0.7
    momentum: float = 0.9
    timeout: float = 30.0
    compression: str = "none"


@dataclass(frozen=True)
class FetchState:
    kind: ClassVar[str] = "fetch_state"
    run: str
    model: str
    start: int
    end: int
    weights_only: bool = False


@dataclass(frozen=True)
class Status:
    kind: ClassVar[str] = "status"
    run: str
    round: int = 0  # the driver's: a replica behind it fetches the current state from another replica


@dataclass(frozen=True)
class StatePart:
    """One parameter's tensor of one kind (`STATE_KINDS`); the tensor travels beside the header."""

    kind: ClassVar[str] = "state_part"
    part: str
    name: str


@dataclass(frozen=True)
class StateEnd:
    kind: ClassVar[str] = "state_end"
    run: str
    start: int
    end: int
    step: int
    round: int
    micro: int
    adam_steps: int
    names: int  # parameters the replica holds (StatePart frames per kind)
    averaged_bytes: int = 0  # tensor bytes its averaging rounds received and sent, since it started


MESSAGES = {cls.kind: cls for cls in (ApplyStep, DiscardStep, OuterStep, FetchState, Status, StatePart, StateEnd)}
REPLIES = {m.Ack.kind: m.Ack, m.Error.kind: m.Error}


def to_header(message: Any) -> dict[str, Any]:
    return {"kind": message.kind, **asdict(message)}


def _field(name: str, kind: str, raw: Any) -> Any:
    """A field's value checked against its annotation (a string: this module's annotations are postponed)."""
    if kind == "int":
        if type(raw) is not int or not 0 <= raw < 1 << 53:
            raise RequestError(f"field {name!r} must be a whole number >= 0")
        return raw
    if kind == "float":
        if not isinstance(raw, (int, float)) or isinstance(raw, bool) or not math.isfinite(raw):
            raise RequestError(f"field {name!r} must be a finite number")
        return float(raw)
    if kind == "bool":
        if not isinstance(raw, bool):
            raise RequestError(f"field {name!r} must be true or false")
        return raw
    if kind == "str":
        if not isinstance(raw, str) or len(raw) > 256:
            raise RequestError(f"field {name!r} must be a string of at most 256 characters")
        return raw
    if not isinstance(raw, list) or len(raw) > MAX_GROUP or not all(isinstance(p, str) and 0 < len(p) <= m.MAX_ID for p in raw):
        raise RequestError(f"field {name!r} must list at most {MAX_GROUP} peer ids")
    return list(raw)


def from_header(header: dict[str, Any]) -> Any:
    """Validate a decoded header into its message type, or raise RequestError saying why."""
    kind = header.get("kind")
    if isinstance(kind, str) and kind in REPLIES:
        return m.from_header(header)
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RequestError(f"unknown training message kind {str(kind)[:40]!r}")
    values = {}
    for f in fields(cls):
        if f.name in header:
            values[f.name] = _field(f.name, f.type, header[f.name])
        elif f.default is f.default_factory:  # dataclasses.MISSING on both: a required field
            raise RequestError(f"{kind}: field {f.name!r} is missing")
    message = cls(**values)
    if hasattr(message, "run"):
        check_run_name(message.run)
    if isinstance(message, StatePart) and message.part not in STATE_KINDS:
        raise RequestError(f"state part must be one of {STATE_KINDS}, got {message.part[:40]!r}")
    return message
