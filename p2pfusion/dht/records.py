"""What a peer announces in the DHT, and how records are keyed.

Every peer of a model writes one subkey under the model's key. The subkey carries the peer's
RSA public key (hivemind's `[owner:...]` marker), so the DHT's signature validator rejects any
write to it not signed by that key: no peer can overwrite another's record.

Throughput is announced as two measured rates, so that anyone can work out what a peer would
carry over any span of layers: `compute_rate` (one-token steps per second through one layer)
and `network_rate` (hidden states per second its links carry; None when not measured).

Every record is a wire type (net/wire.py): anyone may write a DHT value, so `from_value` reads
one strictly, and gives None for anything that is not exactly a record of its kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any

from p2pfusion.net.receipts import Evidence
from p2pfusion.net.run_messages import RunName
from p2pfusion.net.wire import Bound, Check, Length, WireError, decode_as, encode

DEFAULT_SESSION_LIMIT = 2048  # tokens: the longest session a peer accepts unless its operator says otherwise
MAX_ID_LENGTH = 128
MAX_KEY_LENGTH = 128
MAX_NAME_LENGTH = 200
MAX_MADDRS = 8
MAX_DATA_ADDRS = 8
MAX_PEER_LINKS = 12  # round trips one peer record lists
MAX_ADDRESS = 256  # characters of one multiaddr or host:port
MAX_COUNT = 1 << 53  # any load figure past it is no figure a peer could hold (and not exact as a float)
MAX_FORMAT_NAME = 16
MAX_REASON = 200
MAX_LAYERS = 100_000
MAX_HIDDEN = 1 << 20


def is_peer_id(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_LENGTH and value.isascii() and value.isalnum()


def _is_key(value: str) -> bool:
    return 0 < len(value) <= MAX_KEY_LENGTH and all(c.isascii() and (c.isalnum() or c in "-_.") for c in value)


PeerId = Annotated[str, Check(is_peer_id, "a peer id (1 to 128 ASCII letters and digits)")]
ModelKey = Annotated[str, Check(_is_key, "a model key (1 to 128 ASCII letters, digits, '-', '_' or '.')")]
Address = Annotated[str, Length(MAX_ADDRESS, 1)]
Rate = Annotated[float, Bound(0)]
Count = Annotated[int, Bound(0, MAX_COUNT)]
Layer = Annotated[int, Bound(0, MAX_LAYERS)]
FormatName = Annotated[str, Check(lambda f: 0 < len(f) <= MAX_FORMAT_NAME and f.isalnum(), "a weight format's name")]


class PeerState(str, Enum):
    JOINING = "joining"
    ONLINE = "online"
    BACKUP = "backup"
    OFFLINE = "offline"


def span_throughput(compute_rate: float, network_rate: float | None, span: int) -> float:
    """Tokens/s a peer carries through `span` layers: its compute shared by them, capped by its links."""
    compute = compute_rate / max(span, 1)
    return compute if network_rate is None else min(compute, network_rate)


def _read(kind: type, value: Any):
    """`value` as a `kind`, or None when it is anything else (values are untrusted)."""
    try:
        return decode_as(kind, value)
    except WireError:
        return None


@dataclass(frozen=True)
class PeerLink:
    """A round trip (seconds) a peer measured to another: clients price the hop between them by it."""

    peer_id: PeerId
    rtt: Rate


@dataclass(frozen=True)
class PeerRecord:
    model: ModelKey
    peer_id: PeerId
    maddrs: Annotated[list[Address], Length(MAX_MADDRS)]
    start: Layer
    end: Layer
    state: PeerState
    compute_rate: Rate  # positive: see `check`
    network_rate: Rate | None
    device: Annotated[str, Length(MAX_NAME_LENGTH)]
    load: Rate = 0.0  # tokens/s it actually processed lately, so others can see demand
    batch_rate: Rate = 0.0  # tokens/s through one layer in a batch forward
    rtt: Rate | None = None  # seconds, to the peers it measured
    moving_to: tuple[Layer, Layer] | None = None  # a range it is loading, to serve instead of this one
    data_addrs: Annotated[list[Address], Length(MAX_DATA_ADDRS)] = field(default_factory=list)  # its direct TLS listener
    session_limit: Annotated[int, Bound(1)] = DEFAULT_SESSION_LIMIT  # the longest session (in tokens) it accepts
    # the peer's own clock when it entered this state and range: a client that avoided the peer
    # takes it back once a newer record says it serves again (compared only with the same peer's)
    since: Rate = 0.0
    # what it holds now, so clients spread sessions over equivalent peers (client/route/planner.py)
    sessions: Count = 0  # sessions open
    queued: Count = 0  # steps waiting for its compute thread
    cache_used: Count = 0  # bytes of KV cache its sessions reserve
    cache_total: Count = 0  # bytes of KV cache it gives sessions (0: not announced)
    token_bytes: Count = 0  # bytes of KV cache one token reserves through its layers (0: not announced)
    # the format its layers are held in (models/formats.py): clients choose which they accept
    weights: FormatName = "float32"
    # the training run whose replica it is (peer/replica.py): it serves that run's micro-batches
    # only, so inference routing and balancing never count it; None: a serving peer
    train_run: RunName | None = None
    # round trips to the peers of the stages next to its own, as it measured them (peer/upkeep.py)
    links: Annotated[list[PeerLink], Length(MAX_PEER_LINKS)] = field(default_factory=list)

    def check(self) -> None:
        if self.compute_rate <= 0:
            raise WireError("field 'compute_rate' must be positive")
        if self.cache_used > self.cache_total:
            raise WireError("field 'cache_used' must not exceed 'cache_total'")
        for start, end in [(self.start, self.end), *([self.moving_to] if self.moving_to is not None else [])]:
            if start >= end:
                raise WireError(f"layer range {start}:{end} is empty")

    @property
    def span(self) -> int:
        return self.end - self.start

    def round_trip_with(self, other: PeerRecord) -> float | None:
        """The round trip between this peer and `other` as their records claim it: the larger of
        the two words (one lying low cannot draw traffic without the other's); None if neither
        measured it."""
        claims = [link.rtt for link in self.links if link.peer_id == other.peer_id]
        claims += [link.rtt for link in other.links if link.peer_id == self.peer_id]
        return max(claims, default=None)

    @property
    def throughput(self) -> float:
        return span_throughput(self.compute_rate, self.network_rate, self.span)

    @property
    def serving(self) -> bool:
        """Counted as capacity: online, or about to be (joining peers are loading their layers)."""
        return self.state in (PeerState.ONLINE, PeerState.JOINING)

    def to_value(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_value(cls, value: Any) -> PeerRecord | None:
        return _read(cls, value)


@dataclass(frozen=True)
class UnreachableReport:
    """A client's hint that a peer stopped answering. Anyone may write one, so readers verify it.
    Its reason is cut to MAX_REASON characters, whoever wrote it."""

    peer_id: PeerId
    reason: str = ""

    def __post_init__(self):
        if len(self.reason) > MAX_REASON:
            object.__setattr__(self, "reason", self.reason[:MAX_REASON])

    def to_value(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_value(cls, value: Any) -> UnreachableReport | None:
        return _read(cls, value)


@dataclass(frozen=True)
class FaultReport:
    """Evidence that a peer computed wrong: its own signed receipt of a canary's step, which the
    canary's recomputation contradicts by a relative `error` (net/receipts.py, `Evidence`). Any
    client can recompute it; one that holds convicts the accused. Who reported it is the signer,
    never a field."""

    peer_id: PeerId  # the accused
    start: Layer
    end: Layer
    error: Rate
    evidence: Evidence
    time: Rate

    def check(self) -> None:
        receipt = self.evidence.receipt
        if self.start >= self.end:
            raise WireError(f"layer range {self.start}:{self.end} is empty")
        if (receipt.peer_id, receipt.start, receipt.end) != (self.peer_id, self.start, self.end):
            raise WireError("the evidence is a receipt of another peer or other layers")

    def to_value(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_value(cls, value: Any) -> FaultReport | None:
        return _read(cls, value)


MAX_REPLICAS = 256  # replicas one run's charter lists


@dataclass(frozen=True)
class RunCharter:
    """A training run as its driver created it, signed by the driver (the writer is `driver`):
    only the driver steers the run's replicas, within the bounds written here, and only the
    replicas listed here average together and read the run's state. Of two charters of one run
    name, the older is the run's (a replica may also be told its driver: `run-peer --run-driver`)."""

    model: ModelKey
    run: RunName
    driver: PeerId
    replicas: Annotated[list[PeerId], Length(MAX_REPLICAS)]
    open: bool  # the driver admits every replica that announces the run; False: only those it was told
    max_lr: Rate  # the largest inner learning rate an ApplyStep may carry
    max_outer_lr: Rate
    sync_every: Annotated[int, Bound(1, MAX_COUNT)]
    created: Rate  # unix seconds

    def to_value(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_value(cls, value: Any) -> RunCharter | None:
        return _read(cls, value)


@dataclass(frozen=True)
class ModelEntry:
    """A model listed under MODELS_KEY: its swarm key (see models/fingerprint.py), the name its
    announcing peer knows it by, and what a client needs to probe its peers without the weights."""

    key: ModelKey
    name: Annotated[str, Length(MAX_NAME_LENGTH, 1), Check(str.isprintable, "printable")]  # names reach terminals
    num_layers: Annotated[int, Bound(1, MAX_LAYERS)]
    hidden_size: Annotated[int, Bound(1, MAX_HIDDEN)]

    def to_value(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_value(cls, subkey: Any, value: Any) -> ModelEntry | None:
        """A DHT value listed under `subkey` (less its owner marker); None unless it is an entry for
        exactly that key."""
        entry = _read(cls, value)
        return entry if entry is not None and entry.key == subkey else None


def model_key(model: str) -> str:
    """The DHT key of a model's peer records; `model` is its swarm key, never a file name."""
    return f"p2pfusion.model.{model}"


def unreachable_key(model: str) -> str:
    return f"p2pfusion.unreachable.{model}"


def run_key(model: str, run: str) -> str:
    """The DHT key of a training run's charter (a subkey per writer: the run's is its driver's)."""
    return f"p2pfusion.run.{model}.{run}"


def fault_key(model: str, peer_id: str) -> str:
    """The DHT key of the fault reports against one peer of a model (a subkey per reporter): a
    flood of reports against other peers, made up or not, never fills it."""
    return f"p2pfusion.faults.{model}.{peer_id}"


MODELS_KEY = "p2pfusion.models"  # one ModelEntry per model, under the model's swarm key as subkey
