"""Which DHT records this swarm stores: only its own kinds, each signed by the peer it names.

Every record is a subkey under one of the swarm's keys, and the subkey ends with hivemind's
`[owner:<RSA public key>]` marker, so `RSASignatureValidator` checks the value's signature. On top
of that, `SwarmValidator` refuses:
- plain values (no subkey): one of them, stored with a later expiration than the key's
  dictionary, would hide every record under the key;
- values whose writer (a peer record's peer id, a report's reporter) is not the signer, or whose
  subkey is not the one their kind puts them under: one key, one subkey per writer and subject;
- values that do not parse as their kind, or sit under another kind's or model's key;
- fault reports whose receipt its accused's certified key did not sign (net/receipts.py);
- a training run's charter written by another than the driver it names;
- expirations further out than the kind's cap, values over MAX_VALUE_BYTES (MAX_FAULT_BYTES for
  a fault report or a run's charter), subkeys over MAX_SUBKEY_BYTES, RSA keys shorter than 2048 bits (cheap to mint
  in bulk) or over 4096.
It runs where hivemind validates: on every store a node receives and on every value a search
brings back. `claim_of` (pure) says what a value claims to be; the class adds the signature.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.timed_storage import get_dht_time

from p2pfusion.dht.records import (
    MAX_DATA_ADDRS,
    MAX_KEY_LENGTH,
    MODELS_KEY,
    FaultReport,
    ModelEntry,
    PeerRecord,
    RunCharter,
    UnreachableReport,
    fault_key,
    is_peer_id,
    model_key,
    run_key,
    unreachable_key,
)
from p2pfusion.errors import ProofError
from p2pfusion.net.identity import peer_id_of_key

RECORD_TTL = 30.0  # peer records, model entries, unreachable reports: refreshed every 10 s
FAULT_TTL = 600.0  # fault reports are evidence; clients weigh them for a while
RUN_TTL = 600.0  # a run's charter: its driver writes it again every few minutes while it drives
CLOCK_SLACK = 30.0  # how far a writer's clock may run ahead of ours
MAX_VALUE_BYTES = 4096  # a real peer record with 8 data addresses and its signature is about 1.5 KB
MAX_FAULT_BYTES = 16384  # a fault report carries a canary's tokens, a receipt and rows: up to about 12 KB
MAX_SUBKEY_BYTES = 1024
MAX_MADDRS = 8
RSA_BITS = (2048, 4096)


class Kind(str, Enum):
    PEER = "peer"
    MODEL = "model"
    UNREACHABLE = "unreachable"
    FAULT = "fault"
    RUN = "run"


MAX_TTL = {
    Kind.PEER: RECORD_TTL, Kind.MODEL: RECORD_TTL, Kind.UNREACHABLE: RECORD_TTL, Kind.FAULT: FAULT_TTL, Kind.RUN: RUN_TTL,
}
LARGE_KINDS = (Kind.FAULT, Kind.RUN)  # values up to MAX_FAULT_BYTES: evidence, a run's list of replicas


@dataclass(frozen=True)
class Claim:
    """What a value says about itself: its kind, who wrote it, and the subkey (less the owner
    marker) its kind files it under."""

    kind: Kind
    writer: str
    subkey: bytes


@functools.lru_cache(maxsize=1024)
def key_id(key: str) -> bytes:
    """The DHT's id of a key, as validators see it (hivemind hashes keys before they travel)."""
    return DHTID.generate(source=key).to_bytes()


def claim_of(key: bytes, value: Any) -> Claim | None:
    """The claim of `value` stored under the key with id `key`; None unless it parses as the kind
    of record that key holds, for the model it names."""
    if not isinstance(value, dict):
        return None
    if key == key_id(MODELS_KEY):
        entry = ModelEntry.from_value(value.get("key"), value)
        writer = value.get("peer_id")
        return Claim(Kind.MODEL, writer, entry.key.encode()) if entry is not None and is_peer_id(writer) else None
    model = value.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_KEY_LENGTH:
        return None
    if "driver" in value:
        charter = RunCharter.from_value(value)
        if charter is None or key != key_id(run_key(model, charter.run)):
            return None
        return Claim(Kind.RUN, charter.driver, charter.driver.encode())
    if key == key_id(model_key(model)):
        record = PeerRecord.from_value(value)
        if record is None or len(value["maddrs"]) > MAX_MADDRS or len(value.get("data_addrs", ())) > MAX_DATA_ADDRS:
            return None
        return Claim(Kind.PEER, record.peer_id, record.peer_id.encode()) if is_peer_id(record.peer_id) else None
    reporter = value.get("reporter")
    if not is_peer_id(reporter):
        return None
    if key == key_id(unreachable_key(model)):
        report = UnreachableReport.from_value(value)
        return None if report is None else Claim(Kind.UNREACHABLE, reporter, report.peer_id.encode())
    fault = FaultReport.from_value(value)
    if fault is not None and key == key_id(fault_key(model, fault.peer_id)) and _signed_by_accused(fault):
        return Claim(Kind.FAULT, reporter, fault.peer_id.encode())
    return None


def _signed_by_accused(fault: FaultReport) -> bool:
    """Whether the report's receipt is signed by a key its accused's identity certified: a report
    costs its writer a real session through the peer it accuses (a receipt of it), and none can
    be made against a peer that does not exist. Whether the evidence convicts, readers judge."""
    try:
        fault.evidence.receipt.verify(fault.evidence.cert.verify())
    except ProofError:
        return False
    return True


_OWNER = re.compile(rb"\[owner:(.+?)\]")


@functools.lru_cache(maxsize=4096)
def owner_of(subkey: object) -> str | None:
    """The peer id of the RSA key in a subkey's `[owner:...]` marker (None if it has none, or a key
    of a size we refuse)."""
    match = _OWNER.search(subkey) if isinstance(subkey, bytes) else None
    if match is None:
        return None
    try:
        key = serialization.load_ssh_public_key(match.group(1))
    except (ValueError, UnsupportedAlgorithm):
        return None
    if not isinstance(key, rsa.RSAPublicKey) or not RSA_BITS[0] <= key.key_size <= RSA_BITS[1]:
        return None
    return peer_id_of_key(key)


def _no_extensions(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension {code}")


def _decode(data: bytes) -> Any:
    """msgpack without hivemind's extension types: our values never hold any, and decoding one runs
    hivemind's own parser (a nested DHT dictionary) on bytes from a stranger."""
    return msgpack.unpackb(data, ext_hook=_no_extensions, raw=False)


class SwarmValidator(RecordValidatorBase):
    """hivemind's RSA signatures, plus this swarm's rules on what may be stored (see the module)."""

    def __init__(self, signer: RSASignatureValidator):
        self.signer = signer
        self.writer_id = owner_of(signer.local_public_key)
        # a search meets the same record at several nodes, and a reader meets it at every read
        # until its writer refreshes it: its signature is checked once
        self._signed_kind = functools.lru_cache(maxsize=4096)(self._kind)

    @property
    def local_public_key(self) -> bytes:
        """The owner marker that ends this node's subkeys."""
        return self.signer.local_public_key

    def validate(self, record: DHTRecord) -> bool:
        now = get_dht_time()
        if len(record.value) > MAX_FAULT_BYTES or len(record.subkey) > MAX_SUBKEY_BYTES:
            return False
        if record.expiration_time > now + max(MAX_TTL.values()) + CLOCK_SLACK:
            return False
        kind = self._signed_kind(record)
        if kind is None or (kind not in LARGE_KINDS and len(record.value) > MAX_VALUE_BYTES):
            return False
        return record.expiration_time <= now + MAX_TTL[kind] + CLOCK_SLACK

    def _kind(self, record: DHTRecord) -> Kind | None:
        """The record's kind if it is one of ours, signed by the writer it names; else None."""
        try:
            subkey = _decode(record.subkey)
            value = _decode(self.signer.strip_value(record))
        except (ValueError, TypeError, msgpack.UnpackException):  # what msgpack raises on bad bytes
            return None
        markers = _OWNER.findall(subkey) if isinstance(subkey, bytes) else []
        writer = owner_of(subkey) if len(markers) == 1 else None
        claim = claim_of(record.key, value)
        if writer is None or claim is None or claim.writer != writer:
            return None
        if subkey != claim.subkey + b"[owner:" + markers[0] + b"]":
            return None
        return claim.kind if self.signer.validate(record) else None

    def sign_value(self, record: DHTRecord) -> bytes:
        return self.signer.sign_value(record)

    def strip_value(self, record: DHTRecord) -> bytes:
        return self.signer.strip_value(record)

    @property
    def priority(self) -> int:
        return 10
