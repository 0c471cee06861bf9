"""Attacks on the DHT against real peers on 127.0.0.1: each write an attacker tries is refused by
the peers that would store it, and a legitimate client is still served the exact tokens.

The attacker is a client-mode node that runs plain hivemind (its own validator, if any, checks
nothing of ours) and never stores locally, so what a store returns is what the peers decided."""

import time

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.records import PeerRecord, PeerState, fault_key, model_key
from p2pfusion.dht.swarm import SwarmNode, join_swarm
from p2pfusion.dht.validation import SwarmValidator
from tests.receipts import fault as signed_fault
from tests.test_churn import _reference
from tests.swarm import peers_in_background

IDS = [3, 17, 42, 99]
TOKENS = 6


class _Key(RSAPrivateKey):
    def __init__(self):
        self._private_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def swarm(tiny_models):
    source = tiny_models["llama"]
    with peers_in_background(source, [(0, 2), (2, 4)]) as (peers, maddrs, loop):
        yield source, peers, maddrs, loop, _reference(source, IDS, TOKENS)


def _served(swarm) -> None:
    """A fresh client gets exactly transformers' tokens."""
    source, _, maddrs, loop, expected = swarm

    async def generate():
        client = await join_swarm(maddrs, client_mode=True)
        try:
            model = RemoteCausalLM.build(source, client)
            return (await model.generate(IDS, TOKENS, stop_at_eos=False, decode=False)).token_ids
        finally:
            await client.shutdown()

    assert loop.run(generate()) == expected


async def _attacker(maddrs, signer: RSASignatureValidator | None) -> SwarmNode:
    node = await join_swarm(maddrs, client_mode=True)
    node.dht.protocol.record_validator = signer
    return node


async def _store(node: SwarmNode, key: str, subkey, value, ttl: float) -> bool:
    return await node.dht.store(key, value, get_dht_time() + ttl, subkey=subkey, exclude_self=True)


def _held(peers, model: str) -> list[set]:
    """The subkeys each peer's storage holds under the model's key."""
    held = []
    for peer in peers:
        item = peer.swarm.dht.protocol.storage.get(DHTID.generate(source=model_key(model)))
        held.append(set() if item is None else set(item.value.data))
    return held


def _fake(model: str, peer_id: str, **fields) -> PeerRecord:
    record = PeerRecord(model, peer_id, ["/ip4/127.0.0.1/tcp/9"], 0, 4, PeerState.ONLINE, 1e6, None, "cpu")
    return PeerRecord(**{**record.__dict__, **fields})


def test_a_plain_value_does_not_wipe_the_model_key(swarm):
    """The wipe: one unsigned value with no subkey and a later expiration hid every peer record."""
    source, peers, maddrs, loop, _ = swarm

    async def wipe():
        attacker = await _attacker(maddrs, None)
        try:
            return await _store(attacker, model_key(source.key), None, "gone", ttl=120)
        finally:
            await attacker.shutdown()

    before = _held(peers, source.key)
    assert loop.run(wipe()) is False
    assert _held(peers, source.key) == before
    _served(swarm)


def test_a_record_in_another_peers_name_is_refused(swarm):
    """Impersonation: signed by the attacker's own key, the record names the first peer and claims
    every layer; it used to be stored (and dropped only by readers)."""
    source, peers, maddrs, loop, _ = swarm
    victim = peers[0].swarm.peer_id

    async def impersonate():
        signer = RSASignatureValidator(_Key())
        attacker = await _attacker(maddrs, signer)
        try:
            forged = _fake(source.key, victim).to_value()
            subkey = victim.encode() + signer.local_public_key
            as_victim = await _store(attacker, model_key(source.key), subkey, forged, 30)
            return as_victim, await attacker.lookup(source.key)
        finally:
            await attacker.shutdown()

    stored, seen = loop.run(impersonate())
    assert stored is False
    assert sorted((r.start, r.end) for r in seen) == [(0, 2), (2, 4)]
    assert all(len(held) == 2 for held in _held(peers, source.key))
    _served(swarm)


def test_expirations_beyond_the_cap_and_oversize_values_are_refused(swarm):
    """The attacker's own records, correctly signed, but kept for 15 minutes, or with a 5 KB value,
    or 40 data addresses (each a port the victims' clients would dial)."""
    source, peers, maddrs, loop, _ = swarm
    validator = SwarmValidator(RSASignatureValidator(_Key()))
    mine = validator.writer_id
    subkey = mine.encode() + validator.local_public_key
    offline = dict(state=PeerState.OFFLINE)  # were one stored, clients would not route to it
    attempts = [
        (_fake(source.key, mine, **offline), 900),
        (_fake(source.key, mine, device="x" * 5000, **offline), 30),
        (_fake(source.key, mine, data_addrs=[f"127.0.0.1:{p}" for p in range(1000, 1040)], **offline), 30),
    ]

    async def attack():
        attacker = await _attacker(maddrs, validator.signer)
        try:
            return [await _store(attacker, model_key(source.key), subkey, r.to_value(), ttl) for r, ttl in attempts]
        finally:
            await attacker.shutdown()

    assert loop.run(attack()) == [False, False, False]
    assert all(len(held) == 2 for held in _held(peers, source.key))
    _served(swarm)


def test_a_full_key_refuses_new_subkeys_but_not_refreshes(swarm):
    """Subkey cap: writers with keys of their own fill the model's key (here capped at 3 to keep the
    test short; 256 in a real swarm); the peers already listed still refresh their records."""
    source, peers, maddrs, loop, _ = swarm
    storages = [p.swarm.dht.protocol.storage for p in peers]
    writers = [SwarmValidator(RSASignatureValidator(_Key())) for _ in range(3)]

    async def fill():
        attacker = await _attacker(maddrs, None)
        accepted = []
        try:
            for writer in writers:
                attacker.dht.protocol.record_validator = writer.signer
                record = _fake(source.key, writer.writer_id, state=PeerState.OFFLINE)
                subkey = writer.writer_id.encode() + writer.local_public_key
                accepted.append(await _store(attacker, model_key(source.key), subkey, record.to_value(), 30))
        finally:
            await attacker.shutdown()
        refreshed = [await peer.announce() for peer in peers]
        return accepted, refreshed

    for storage in storages:
        storage.per_key = 3
    try:
        accepted, refreshed = loop.run(fill())
    finally:
        for storage in storages:
            storage.per_key = 256
    assert accepted == [True, False, False]
    assert all(r is not False for r in refreshed)
    assert all(len(held) == 3 for held in _held(peers, source.key))
    _served(swarm)


def test_junk_fault_reports_do_not_crowd_out_a_real_one(swarm):
    """The report flood: throwaway keys store reports against made-up peers, and against a real
    peer with receipts it never signed. Every one is refused; a report whose receipt the accused
    did sign (here made with its own receipt key, as a canary's evidence would be) is stored under
    that peer's own key, where a fresh client reads it."""
    source, peers, maddrs, loop, _ = swarm
    target = peers[0].swarm.peer_id

    async def flood():
        attacker = await _attacker(maddrs, None)
        refused = []
        try:
            for writer in [SwarmValidator(RSASignatureValidator(_Key())) for _ in range(4)]:
                attacker.dht.protocol.record_validator = writer.signer
                for report in (signed_fault(f"QmMadeUp{writer.writer_id[-8:]}"), signed_fault(target)):
                    value = {**report.to_value(), "model": source.key, "reporter": writer.writer_id}
                    subkey = report.peer_id.encode() + writer.local_public_key
                    refused.append(not await _store(attacker, fault_key(source.key, report.peer_id), subkey, value, 600))
        finally:
            await attacker.shutdown()
        honest = await join_swarm(maddrs, client_mode=True)
        reader = await join_swarm(maddrs, client_mode=True)
        try:
            real = signed_fault(key=peers[0].server.receipt_key)
            stored = await honest.report_faulty(source.key, real)
            return refused, stored, await reader.fault_reports(source.key, [target, "QmMadeUp"]), honest.writer_id
        finally:
            await honest.shutdown()
            await reader.shutdown()

    refused, stored, read, reporter = loop.run(flood())
    assert all(refused) and len(refused) == 8
    assert stored and [(writer, report.peer_id) for writer, report in read] == [(reporter, target)]


def test_the_swarm_heals_after_a_flood(swarm):
    """A flood of junk is refused as it comes, and a node whose routing table emptied meanwhile
    finds the swarm again. (hivemind drops a peer from the table when one request to it goes
    unanswered, as requests did while peers answered 6 MB dictionaries: the tables emptied and the
    swarm stayed split after the flood expired.)"""
    source, peers, maddrs, loop, _ = swarm

    async def flood():
        attacker = await _attacker(maddrs, None)
        try:
            junk = {"model": source.key, "junk": "x" * 3000}
            started = time.monotonic()
            keys = [model_key(source.key)] * 300
            stored = await attacker.dht.store_many(
                keys, [junk] * 300, get_dht_time() + 120, subkeys=[f"junk{i}" for i in range(300)], exclude_self=True
            )
            return any(stored.values()), time.monotonic() - started
        finally:
            await attacker.shutdown()

    async def split_and_heal():
        # where the flood left the swarm once its records expired: empty routing tables, and each
        # peer's refreshes stored only by itself
        for peer in peers:
            table = peer.swarm.dht.protocol.routing_table
            for node_id in list(table.uid_to_peer_id):
                del table[node_id]
            peer.swarm.dht.protocol.storage.clear()
            peer.swarm.dht.protocol.cache.clear()
            await peer.announce()
        alone = [len(await peer.swarm.lookup(source.key)) for peer in peers]
        healed = [await peer.swarm.heal() for peer in peers]
        return alone, healed, [len(await peer.swarm.lookup(source.key)) for peer in peers]

    any_stored, seconds = loop.run(flood())
    assert not any_stored and seconds < 10
    alone, healed, seen = loop.run(split_and_heal())
    assert alone == [1, 1] and sum(healed) >= 1 and seen == [2, 2]
    _served(swarm)
