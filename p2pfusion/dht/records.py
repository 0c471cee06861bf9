"""What a peer announces in the DHT, and how records are keyed.

Every peer of a model writes one subkey under the model's key. The subkey carries the peer's
RSA public key (hivemind's `[owner:...]` marker), so the DHT's signature validator rejects any
write to it not signed by that key: no peer can overwrite another's record.

Throughput is announced as two measured rates, so that anyone can work out what a peer would
carry over any span of layers: `compute_rate` (one-token steps per second through one layer)
and `network_rate` (hidden states per second its links carry; None when not measured).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from p2pfusion.errors import RequestError
from p2pfusion.net.run_messages import check_run_name


class PeerState(str, Enum):
    JOINING = "joining"
    ONLINE = "online"
    BACKUP = "backup"
    OFFLINE = "offline"


def span_throughput(compute_rate: float, network_rate: float | None, span: int) -> float:
    """Tokens/s a peer carries through `span` layers: its compute shared by them, capped by its links."""
    compute = compute_rate / max(span, 1)
    return compute if network_rate is None else min(compute, network_rate)


MAX_DATA_ADDRS = 8
LOAD_FIELDS = ("sessions", "queued", "cache_used", "cache_total", "token_bytes")
MAX_COUNT = 1 << 53  # any load figure past it is no figure a peer could hold (and not exact as a float)


MAX_FORMAT_NAME = 16


def _format_name(raw: Any) -> str:
    """A format's name as another peer wrote it: short and plain (whether it is known is the reader's call)."""
    if not isinstance(raw, str) or not 0 < len(raw) <= MAX_FORMAT_NAME or not raw.isalnum():
        raise ValueError(f"not a format name: {raw!r}")
    return raw


def _run_name(raw: Any) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise ValueError(f"not a run name: {raw!r}")
    try:
        return check_run_name(raw)
    except RequestError as exc:
        raise ValueError(str(exc)) from None


def _count(raw: Any) -> int:
    if type(raw) is not int or not 0 <= raw <= MAX_COUNT:
        raise ValueError(f"not a count: {raw!r}")
    return raw


@dataclass(frozen=True)
class PeerRecord:
    model: str
    peer_id: str
    maddrs: list[str]
    start: int
    end: int
    state: PeerState
    compute_rate: float
    network_rate: float | None
    device: str
    load: float = 0.0  # tokens/s it actually processed lately, so others can see demand
    batch_rate: float = 0.0  # tokens/s through one layer in a batch forward
    rtt: float | None = None  # seconds, to the peers it measured
    moving_to: tuple[int, int] | None = None  # a range it is loading, to serve instead of this one
    data_addrs: list[str] = field(default_factory=list)  # host:port of its direct TLS listener
    max_length: int = 2048  # longest session (in tokens) it accepts
    # the peer's own clock when it entered this state and range: a client that avoided the peer
    # takes it back once a newer record says it serves again (compared only with the same peer's)
    since: float = 0.0
    # what it holds now, so clients spread sessions over equivalent peers (client/route/planner.py)
    sessions: int = 0  # sessions open
    queued: int = 0  # steps waiting for its compute thread
    cache_used: int = 0  # bytes of KV cache its sessions reserve
    cache_total: int = 0  # bytes of KV cache it gives sessions (0: not announced)
    token_bytes: int = 0  # bytes of KV cache one token reserves through its layers (0: not announced)
    # the format its layers are held in (models/formats.py): clients choose which they accept
    weights: str = "float32"
    # the training run whose replica it is (peer/replica.py): it serves that run's micro-batches
    # only, so inference routing and balancing never count it; None: a serving peer
    train_run: str | None = None

    @property
    def span(self) -> int:
        return self.end - self.start

    @property
    def throughput(self) -> float:
        return span_throughput(self.compute_rate, self.network_rate, self.span)

    @property
    def serving(self) -> bool:
        """Counted as capacity: online, or about to be (joining peers are loading their layers)."""
        return self.state in (PeerState.ONLINE, PeerState.JOINING)

    def to_value(self) -> dict[str, Any]:
        value = {**asdict(self), "state": self.state.value}
        value["moving_to"] = list(self.moving_to) if self.moving_to is not None else None
        return value

    @classmethod
    def from_value(cls, value: Any) -> PeerRecord | None:
        """Parse a DHT value; None for anything malformed, since other peers' values are untrusted."""
        if not isinstance(value, dict):
            return None
        try:
            network = value["network_rate"]
            moving = value.get("moving_to")
            record = cls(
                model=str(value["model"]),
                peer_id=str(value["peer_id"]),
                maddrs=[str(m) for m in value["maddrs"]],
                start=int(value["start"]),
                end=int(value["end"]),
                state=PeerState(value["state"]),
                compute_rate=float(value["compute_rate"]),
                network_rate=None if network is None else float(network),
                device=str(value["device"]),
                load=float(value.get("load", 0.0)),
                batch_rate=float(value.get("batch_rate", 0.0)),
                rtt=None if value.get("rtt") is None else float(value["rtt"]),
                moving_to=None if moving is None else (int(moving[0]), int(moving[1])),
                data_addrs=[str(a) for a in value.get("data_addrs", [])][:MAX_DATA_ADDRS],
                max_length=int(value.get("max_length", 2048)),
                since=float(value.get("since", 0.0)),
                weights=_format_name(value.get("weights", "float32")),
                train_run=_run_name(value.get("train_run")),
                **{name: _count(value.get(name, 0)) for name in LOAD_FIELDS},
            )
        except (KeyError, TypeError, ValueError, IndexError):
            return None
        if record.cache_used > record.cache_total:
            return None
        optional = [x for x in (record.network_rate, record.rtt) if x is not None]
        rates = [record.compute_rate, record.load, record.batch_rate, record.since, *optional]
        if not all(math.isfinite(x) and x >= 0 for x in rates) or record.compute_rate <= 0 or record.max_length < 1:
            return None
        ranges = [(record.start, record.end)] + ([record.moving_to] if record.moving_to is not None else [])
        return record if all(0 <= a < b for a, b in ranges) else None


MAX_REASON = 200


@dataclass(frozen=True)
class UnreachableReport:
    """A client's hint that a peer stopped answering. Anyone may write one, so readers verify it."""

    peer_id: str
    reason: str

    def to_value(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "reason": self.reason[:MAX_REASON]}

    @classmethod
    def from_value(cls, value: Any) -> UnreachableReport | None:
        if not isinstance(value, dict) or not is_peer_id(value.get("peer_id")):
            return None
        return cls(peer_id=value["peer_id"], reason=str(value.get("reason", ""))[:MAX_REASON])


MAX_WITNESSES = 8
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class FaultReport:
    """Evidence that a peer computed wrong: a client ran the same step through other peers of the
    same layers (`witnesses`, whose outputs agreed with each other) and the accused's output was off
    by a relative `error`. The digests name the step's input and the accused's claimed output, so
    anyone holding them can check the claim. Who reported it is the signer, never a field."""

    peer_id: str  # the accused
    start: int
    end: int
    error: float
    input_digest: str  # sha256 hex
    output_digest: str  # sha256 hex
    witnesses: tuple[str, ...]
    time: float

    def to_value(self) -> dict[str, Any]:
        return {**asdict(self), "witnesses": list(self.witnesses)}

    @classmethod
    def from_value(cls, value: Any) -> FaultReport | None:
        """Parse a DHT value; None for anything malformed (anyone may write one)."""
        if not isinstance(value, dict):
            return None
        try:
            witnesses = value["witnesses"]
            if not isinstance(witnesses, list) or len(witnesses) > MAX_WITNESSES:
                return None
            report = cls(
                peer_id=value["peer_id"],
                start=value["start"],
                end=value["end"],
                error=float(value["error"]),
                input_digest=value["input_digest"],
                output_digest=value["output_digest"],
                witnesses=tuple(witnesses),
                time=float(value["time"]),
            )
        except (KeyError, TypeError, ValueError):
            return None
        ids = [report.peer_id, *report.witnesses]
        if not all(is_peer_id(i) for i in ids) or report.peer_id in report.witnesses:
            return None
        if not all(_is_digest(d) for d in (report.input_digest, report.output_digest)):
            return None
        if type(report.start) is not int or type(report.end) is not int or not 0 <= report.start < report.end:
            return None
        return report if all(math.isfinite(x) and x >= 0 for x in (report.error, report.time)) else None


MAX_ID_LENGTH = 128


def is_peer_id(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_LENGTH and value.isascii() and value.isalnum()


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


MAX_KEY_LENGTH = 128
MAX_NAME_LENGTH = 200
MAX_LAYERS = 100_000
MAX_HIDDEN = 1 << 20


@dataclass(frozen=True)
class ModelEntry:
    """A model listed under MODELS_KEY: its swarm key (see models/fingerprint.py), the name its
    announcing peer knows it by, and what a client needs to probe its peers without the weights."""

    key: str
    name: str
    num_layers: int
    hidden_size: int

    def to_value(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_value(cls, subkey: Any, value: Any) -> ModelEntry | None:
        """Parse a DHT value listed under `subkey` (less its owner marker); None for anything
        malformed (values are untrusted, and names are printed to terminals)."""
        if not isinstance(value, dict):
            return None
        key, name, layers, hidden = (value.get(f) for f in ("key", "name", "num_layers", "hidden_size"))
        if not isinstance(key, str) or key != subkey or not 0 < len(key) <= MAX_KEY_LENGTH:
            return None
        if not all(c.isascii() and (c.isalnum() or c in "-_.") for c in key):
            return None
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LENGTH or not name.isprintable():
            return None
        if type(layers) is not int or type(hidden) is not int:
            return None
        if not (0 < layers <= MAX_LAYERS and 0 < hidden <= MAX_HIDDEN):
            return None
        return cls(key, name, layers, hidden)


def model_key(model: str) -> str:
    """The DHT key of a model's peer records; `model` is its swarm key, never a file name."""
    return f"p2pfusion.model.{model}"


def unreachable_key(model: str) -> str:
    return f"p2pfusion.unreachable.{model}"


def fault_key(model: str) -> str:
    """The DHT key of the fault reports against a model's peers (one subkey per accused and reporter)."""
    return f"p2pfusion.faults.{model}"


MODELS_KEY = "p2pfusion.models"  # one ModelEntry per model, under the model's swarm key as subkey
