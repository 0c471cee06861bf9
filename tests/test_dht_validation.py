"""The DHT's record rules, without a network: what the validator lets a node store or a search bring
back, and the caps of a node's storage."""

import dataclasses

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from p2pfusion.dht.records import (
    MODELS_KEY,
    FaultReport,
    ModelEntry,
    PeerRecord,
    PeerState,
    RunCharter,
    fault_key,
    model_key,
    run_key,
    unreachable_key,
)
from p2pfusion.dht.storage import CappedStorage
from p2pfusion.dht.validation import SwarmValidator, key_id
from p2pfusion.net.identity import Identity
from tests.receipts import fault as signed_fault


class _Key(RSAPrivateKey):
    def __init__(self, bits: int = 2048):
        self._private_key = rsa.generate_private_key(public_exponent=65537, key_size=bits)


@pytest.fixture(scope="module")
def keys() -> dict[str, SwarmValidator]:
    """A node's validator (it checks) and two writers' (they sign)."""
    return {name: SwarmValidator(RSASignatureValidator(_Key())) for name in ("node", "alice", "mallory")}


@pytest.fixture(scope="module")
def accused() -> FaultReport:
    """A report against a real peer: its receipt signed by the key that peer's identity certified."""
    return signed_fault(identity=Identity.create())


def _fault_value(report: FaultReport, reporter: str) -> dict:
    return {**report.to_value(), "model": "m", "reporter": reporter}


def _record(writer: SwarmValidator, key: str, subject, value, ttl: float = 30.0, sign=True) -> DHTRecord:
    """A record as hivemind's `DHTNode.store` makes it: serialized, then signed by the writer."""
    subkey = None if subject is None else (subject.encode() + writer.local_public_key if sign else subject.encode())
    record = DHTRecord(
        key_id(key), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), get_dht_time() + ttl
    )
    return DHTRecord(record.key, record.subkey, writer.sign_value(record), record.expiration_time)


def _peer_value(peer_id: str, model: str = "m", **fields) -> dict:
    record = PeerRecord(model, peer_id, ["/ip4/127.0.0.1/tcp/1"], 0, 4, PeerState.ONLINE, 10.0, None, "cpu")
    return {**record.to_value(), **fields}


def test_each_kind_of_record_is_accepted_from_its_writer(keys, accused):
    node, alice, mallory = keys["node"], keys["alice"], keys["mallory"]
    me = alice.writer_id
    assert node.validate(_record(alice, model_key("m"), me, _peer_value(me)))
    entry = {**ModelEntry("m", "tiny", 4, 16).to_value(), "peer_id": me}
    assert node.validate(_record(alice, MODELS_KEY, "m", entry))
    report = {"peer_id": mallory.writer_id, "reason": "gone", "model": "m", "reporter": me}
    assert node.validate(_record(alice, unreachable_key("m"), mallory.writer_id, report))
    target = accused.peer_id
    assert node.validate(_record(alice, fault_key("m", target), target, _fault_value(accused, me), ttl=600))


def test_a_fault_report_needs_its_accused_signature_and_its_own_key(keys, accused):
    """Reports against made-up peers, or with a receipt the accused did not sign, are refused: junk
    cannot fill a real peer's report key, and a report against one peer sits under that peer's key."""
    node, alice = keys["node"], keys["alice"]
    me, target = alice.writer_id, accused.peer_id
    made_up = signed_fault("QmAccused")
    assert not node.validate(_record(alice, fault_key("m", "QmAccused"), "QmAccused", _fault_value(made_up, me), ttl=600))
    receipt = accused.evidence.receipt
    forged = dataclasses.replace(accused, evidence=dataclasses.replace(
        accused.evidence, receipt=dataclasses.replace(receipt, output=bytes(len(receipt.output)))))
    assert not node.validate(_record(alice, fault_key("m", target), target, _fault_value(forged, me), ttl=600))
    other = keys["mallory"].writer_id
    assert not node.validate(_record(alice, fault_key("m", other), target, _fault_value(accused, me), ttl=600))


def test_a_plain_value_cannot_wipe_a_key(keys):
    """The wipe: a value with no subkey, under a model's key, would have hidden every peer record."""
    assert not keys["node"].validate(_record(keys["mallory"], model_key("m"), None, "gone", ttl=120))
    unsigned = _record(keys["mallory"], model_key("m"), "x", _peer_value("x"), sign=False)
    assert not keys["node"].validate(unsigned)


def test_a_record_must_name_its_signer(keys):
    node, alice, mallory = keys["node"], keys["alice"], keys["mallory"]
    victim = alice.writer_id
    # mallory's key, alice's id: under either subkey, the value does not name its signer
    assert not node.validate(_record(mallory, model_key("m"), victim, _peer_value(victim)))
    assert not node.validate(_record(mallory, model_key("m"), mallory.writer_id, _peer_value(victim)))
    # a report must be filed under its subject, and a model entry under its own key
    report = {"peer_id": victim, "reason": "x", "model": "m", "reporter": victim}
    assert not node.validate(_record(mallory, unreachable_key("m"), victim, report))
    entry = {**ModelEntry("m", "tiny", 4, 16).to_value(), "peer_id": mallory.writer_id}
    assert not node.validate(_record(mallory, MODELS_KEY, "other", entry))


def test_a_record_fits_only_its_own_key_and_subkey(keys):
    node, alice = keys["node"], keys["alice"]
    me = alice.writer_id
    assert not node.validate(_record(alice, model_key("other"), me, _peer_value(me)))
    assert not node.validate(_record(alice, unreachable_key("m"), me, _peer_value(me)))
    assert not node.validate(_record(alice, "some.other.key", me, _peer_value(me)))
    # one subkey per writer: nothing may follow its owner marker
    record = _record(alice, model_key("m"), me, _peer_value(me))
    subkey = MSGPackSerializer.dumps(me.encode() + alice.local_public_key + b"2]")
    assert not node.validate(DHTRecord(record.key, subkey, record.value, record.expiration_time))


def test_expiration_is_capped_per_kind(keys, accused):
    node, alice = keys["node"], keys["alice"]
    me, target = alice.writer_id, accused.peer_id
    assert node.validate(_record(alice, model_key("m"), me, _peer_value(me), ttl=50))
    assert not node.validate(_record(alice, model_key("m"), me, _peer_value(me), ttl=900))
    fault = _fault_value(accused, me)
    assert node.validate(_record(alice, fault_key("m", target), target, fault, ttl=600))
    assert not node.validate(_record(alice, fault_key("m", target), target, fault, ttl=900))


def test_sizes_are_capped(keys, accused):
    node, alice = keys["node"], keys["alice"]
    me, target = alice.writer_id, accused.peer_id
    fault_value = _fault_value(accused, me)
    assert node.validate(_record(alice, fault_key("m", target), target, fault_value, ttl=600))
    padded = {**fault_value, "evidence": {**fault_value["evidence"], "earlier": [[1, b"\0" * 32]] * 400}}
    assert not node.validate(_record(alice, fault_key("m", target), target, padded, ttl=600))
    assert not node.validate(_record(alice, model_key("m"), me, _peer_value(me, device="x" * 5000)))
    addrs = [f"10.0.0.{i}:443" for i in range(9)]
    assert not node.validate(_record(alice, model_key("m"), me, _peer_value(me, data_addrs=addrs)))
    maddrs = [f"/ip4/10.0.0.{i}/tcp/1" for i in range(9)]
    assert not node.validate(_record(alice, model_key("m"), me, _peer_value(me, maddrs=maddrs)))


def test_forged_or_weak_signatures_and_odd_encodings_are_refused(keys):
    node, alice = keys["node"], keys["alice"]
    me = alice.writer_id
    record = _record(alice, model_key("m"), me, _peer_value(me))
    tampered = record.value.replace(b"\x04", b"\x1e", 1)  # end 4 -> 30
    assert tampered != record.value
    assert not node.validate(DHTRecord(record.key, record.subkey, tampered, record.expiration_time))
    weak = SwarmValidator(RSASignatureValidator(_Key(1024)))
    assert weak.writer_id is None
    extension = msgpack.packb({"model": msgpack.ExtType(0x50, b"\x93")}, use_bin_type=True)
    odd = DHTRecord(record.key, record.subkey, extension, record.expiration_time)
    assert not node.validate(DHTRecord(odd.key, odd.subkey, alice.sign_value(odd), odd.expiration_time))
    assert not node.validate(DHTRecord(record.key, b"\xc1", record.value, record.expiration_time))


def test_fault_reports_parse_strictly():
    report = signed_fault("QmAccused")
    assert FaultReport.from_value(report.to_value()) == report
    evidence = report.to_value()["evidence"]
    receipt = evidence["receipt"]
    for bad in ({"error": float("nan")}, {"start": 3, "end": 3}, {"peer_id": "../etc"}, {"peer_id": "QmOther"},
                {"start": 0}, {"evidence": {**evidence, "tokens": []}},
                {"evidence": {**evidence, "receipt": {**receipt, "output": b"\0" * 7}}},
                {"evidence": {**evidence, "receipt": {**receipt, "history": b"short"}}}):
        assert FaultReport.from_value({**report.to_value(), **bad}) is None


def test_storage_caps_subkeys_per_key_and_entries_in_all():
    storage = CappedStorage(per_key=3, total=5)
    first, second = DHTID.generate("a"), DHTID.generate("b")
    later = get_dht_time() + 30
    assert all(storage.store(first, b"v", later, subkey=s) for s in "xyz")
    assert not storage.store(first, b"v", later, subkey="w")  # key full
    assert storage.store(first, b"v2", later + 1, subkey="x")  # an update always passes
    assert storage.store(second, b"v", later, subkey="x") and storage.store(second, b"v", later, subkey="y")
    assert not storage.store(second, b"v", later, subkey="z")  # node full
    assert not storage.store(second, b"plain", later)  # plain values are never ours
    whole = DictionaryDHTValue()
    for s in "pqrs":
        whole.store(s, b"v", later)
    assert storage.store(DHTID.generate("c"), whole, later) is False  # nothing left for a new key


def test_a_run_charter_is_its_drivers_alone(keys):
    node, alice, mallory = keys["node"], keys["alice"], keys["mallory"]
    driver = alice.writer_id
    charter = RunCharter("m", "run-1", driver, [mallory.writer_id], True, 1e-3, 0.7, 20, 1.0)
    assert node.validate(_record(alice, run_key("m", "run-1"), driver, charter.to_value(), ttl=600))
    # mallory cannot write it in the driver's name, nor file it under another run's key
    assert not node.validate(_record(mallory, run_key("m", "run-1"), driver, charter.to_value(), ttl=600))
    assert not node.validate(_record(alice, run_key("m", "run-2"), driver, charter.to_value(), ttl=600))
    assert not node.validate(_record(alice, run_key("m", "run-1"), driver, charter.to_value(), ttl=900))
