"""Join the swarm: a libp2p node plus a Kademlia DHT node, inside the caller's asyncio loop."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.storage import DHTLocalStorage
from hivemind.p2p import P2P, PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from p2pfusion.dht.patience import Patience, reading
from p2pfusion.dht.private import SecretAuthorizer
from p2pfusion.dht.records import (
    MAX_DATA_ADDRS,
    MODELS_KEY,
    FaultReport,
    ModelEntry,
    PeerRecord,
    PeerState,
    RunCharter,
    UnreachableReport,
    fault_key,
    model_key,
    run_key,
    unreachable_key,
)
from p2pfusion.dht.storage import MAX_SUBKEYS, CappedStorage
from p2pfusion.dht.validation import FAULT_TTL, MAX_MADDRS, RECORD_TTL, RUN_TTL, SwarmValidator, owner_of
from p2pfusion.errors import ConfigError, RouteError
from p2pfusion.net.secret import SwarmSecret
from p2pfusion.net.transport import LIBP2P_ERRORS, Transport

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT = 5.0  # seconds a DHT read may take before its caller goes on without it
# values kept from one read: a search merges what several nodes hold, each node at most MAX_SUBKEYS
# per key. Well above that, so that a full key's junk (which may expire last) crowds nothing out
MAX_FOUND = 4 * MAX_SUBKEYS
HEAL_PINGS = 8  # peers pinged per heal
HEAL_DIAL_WAIT = 1.0  # seconds a heal waits for its dials to initial peers
# seconds a join waits for its DHT neighbours to answer, its own search for more included; the search
# goes on after it. hivemind's default is its whole request timeout (3 s), spent in full whenever
# one neighbour is silent
BOOTSTRAP_WAIT = 0.25
# seconds a DHT request waits for its answer at most. Our traversals give up on a silent node as
# soon as others answer (dht/patience.py), so this bounds a request that nobody else answers either:
# a joiner's ping of its initial peer, which on a busy machine (59 nodes joining one peer at once)
# took over hivemind's default of 3 s
REQUEST_TIMEOUT = 6.0
REMEMBERED = 600.0  # seconds a peer seen in a lookup stays a candidate for healing
MAX_REMEMBERED = 1024


@dataclass
class SwarmNode:
    transport: Transport
    dht: DHTNode
    validator: SwarmValidator
    patience: Patience  # the DHT's answer times, shared by its requests that give up on silent nodes
    seen: dict[str, float] = field(default_factory=dict)  # peer id -> when a lookup last listed it
    # model key -> when a lookup last found its records, and those records
    found: dict[str, tuple[float, list[PeerRecord]]] = field(default_factory=dict)

    @property
    def p2p(self) -> P2P:
        return self.transport.p2p

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    @property
    def writer_id(self) -> str:
        """Who this node's DHT values are from: the peer id of the key that signs them (a peer's own
        id; a client's throwaway key otherwise)."""
        return self.validator.writer_id

    async def maddrs(self) -> list[str]:
        return [str(m) for m in await self.p2p.get_visible_maddrs()]

    async def _store(self, key: str, subject: str, value: dict[str, Any], ttl: float) -> bool:
        """Store under our own subkey for `subject`: signed, and only ours to overwrite."""
        subkey = subject.encode() + self.validator.local_public_key
        return await self.dht.store(key, subkey=subkey, value=value, expiration_time=get_dht_time() + ttl)

    async def _read(self, key: str) -> list[tuple[str, str, Any]]:
        """(subject, writer, value) of the key's subkeys (`_entries`), bounded in time."""
        found = await self._get(key)
        if not _entries(found) and await self.heal():
            # a long-lived node (a client between generations) may have lost every neighbour to
            # unanswered requests on a busy machine: one read after they are back
            found = await self._get(key)
        return _entries(found)

    async def _get(self, key: str):
        try:
            with reading():
                return await asyncio.wait_for(self.dht.get(key, latest=True), LOOKUP_TIMEOUT)
        except asyncio.TimeoutError:
            log.warning("DHT read of %s took over %.0f s; going on without it", key, LOOKUP_TIMEOUT)
            return None

    async def _get_many(self, keys: list[str]) -> list:
        """The latest values of `keys` found within LOOKUP_TIMEOUT, read in one traversal of the
        DHT (each request asks a node for several keys; one read per key cost a traversal each,
        and on a DHT slowed by silent nodes each waited out the timeout on its own). The searches
        of keys not found by then are given up."""
        if not keys:
            return []
        with reading():
            futures = await self.dht.get_many(keys, sufficient_expiration_time=math.inf, return_futures=True)
            try:
                done, pending = await asyncio.wait(futures.values(), timeout=LOOKUP_TIMEOUT)
            finally:  # the caller's own timeout, too: searches nobody waits for stop
                for future in futures.values():
                    future.cancel()
        if pending:
            log.warning(
                "DHT reads of %d of %d keys took over %.0f s; going on without them", len(pending), len(keys), LOOKUP_TIMEOUT
            )
        return [f.result() for f in done if not f.cancelled() and f.exception() is None]

    async def announce(self, record: PeerRecord, ttl: float = RECORD_TTL) -> bool:
        # a host listening on every interface may have more addresses than a record may carry
        value = record.to_value()
        value["maddrs"], value["data_addrs"] = value["maddrs"][:MAX_MADDRS], value["data_addrs"][:MAX_DATA_ADDRS]
        return await self._store(model_key(record.model), record.peer_id, value, ttl)

    async def announce_model(self, entry: ModelEntry, ttl: float = RECORD_TTL) -> bool:
        """List the model under a shared key, so `p2pfusion swarm` can show every model served and
        a client asking for an absent one can be told what the swarm has."""
        return await self._store(MODELS_KEY, entry.key, {**entry.to_value(), "peer_id": self.writer_id}, ttl)

    async def models(self) -> list[ModelEntry]:
        """Every model listed in the last TTL, by display name then key."""
        entries = {}
        for subject, _, value in await self._read(MODELS_KEY):
            entry = ModelEntry.from_value(subject, value)
            if entry is not None:
                entries.setdefault(entry.key, entry)
        return sorted(entries.values(), key=lambda e: (e.name, e.key))

    async def report_unreachable(self, model: str, peer_id: str, reason: str, ttl: float = RECORD_TTL) -> bool:
        value = {**UnreachableReport(peer_id, reason).to_value(), "model": model, "reporter": self.writer_id}
        return await self._store(unreachable_key(model), peer_id, value, ttl)

    async def unreachable_reports(self, model: str) -> list[UnreachableReport]:
        reports = [UnreachableReport.from_value(value) for _, _, value in await self._read(unreachable_key(model))]
        return [r for r in reports if r is not None]

    async def report_faulty(self, model: str, report: FaultReport, ttl: float = FAULT_TTL) -> bool:
        """Tell other clients that `report.peer_id` computed wrong, signed as this node's."""
        value = {**report.to_value(), "model": model, "reporter": self.writer_id}
        return await self._store(fault_key(model, report.peer_id), report.peer_id, value, ttl)

    async def fault_reports(self, model: str, peers: Iterable[str]) -> list[tuple[str, FaultReport]]:
        """(reporter, report) pairs against `peers`, read at once; the reporter is the report's
        signer, whatever its value says."""
        found = await self._get_many([fault_key(model, peer) for peer in dict.fromkeys(peers)])
        pairs = [(writer, FaultReport.from_value(value)) for value in found for _, writer, value in _entries(value)]
        return [(writer, report) for writer, report in pairs if report is not None]

    async def publish_charter(self, charter: RunCharter, ttl: float = RUN_TTL) -> bool:
        """Write a run's charter, as its driver (this node's signer must be `charter.driver`)."""
        return await self._store(run_key(charter.model, charter.run), charter.driver, charter.to_value(), ttl)

    async def charters(self, model: str, run: str) -> list[RunCharter]:
        """The charters written for run `run` of `model`, each by the driver it names, oldest first."""
        found = []
        for _, writer, value in await self._read(run_key(model, run)):
            charter = RunCharter.from_value(value)
            if charter is not None and charter.driver == writer and (charter.model, charter.run) == (model, run):
                found.append(charter)
        return sorted(found, key=lambda c: (c.created, c.driver))

    async def lookup(self, model: str, run: str | None = None) -> list[PeerRecord]:
        """Every valid, unexpired record of the model's peers, in all states: its serving peers, or
        the replicas of training run `run`."""
        records = []
        for _, writer, value in await self._read(model_key(model)):
            record = PeerRecord.from_value(value)
            # a record whose signer is not the peer it names would let anyone announce layers in
            # another peer's name: the validator refuses it, and readers do not rely on that alone
            if record is not None and record.model == model and writer == record.peer_id and record.train_run == run:
                records.append(record)
                self.transport.circuit_book.learn(record.peer_id, record.maddrs)
        self._remember(records)
        if records and run is None:
            self.found[model] = (time.monotonic(), records)
        return records

    def found_lately(self, model: str) -> bool:
        """Whether a lookup of this node found the model's records in the last REMEMBERED seconds."""
        return time.monotonic() - self.found.get(model, (-REMEMBERED, []))[0] < REMEMBERED

    def recent(self, model: str, max_age: float) -> list[PeerRecord]:
        """The records of the model's last lookup that found any, if it ran within `max_age` seconds."""
        when, records = self.found.get(model, (-max_age, []))
        return list(records) if time.monotonic() - when < max_age else []

    def _remember(self, records: list[PeerRecord]) -> None:
        now = time.monotonic()
        for record in records:
            if record.state == PeerState.OFFLINE:
                self.seen.pop(record.peer_id, None)
            elif record.peer_id != self.peer_id:
                self.seen[record.peer_id] = now
        if len(self.seen) > MAX_REMEMBERED:
            recent = sorted(self.seen.items(), key=lambda item: -item[1])[:MAX_REMEMBERED]
            self.seen = dict(recent)

    async def heal(self) -> int:
        """Ping the initial peers and the peers lookups listed lately that the DHT's routing table
        lost or blacklisted, so that they come back into it; returns how many answered. hivemind
        drops a peer from the table when one request to it goes unanswered, and only a later
        request between the two puts it back: once a node's table is empty it asks nobody, and
        nobody may ask it (see docs/architecture.md, DHT records). A table of a bucket's size or
        more is left alone."""
        table = self.dht.protocol.routing_table
        if len(table.uid_to_peer_id) >= self.dht.protocol.bucket_size:
            return 0
        now = time.monotonic()
        recent = sorted((p for p, when in self.seen.items() if now - when < REMEMBERED), key=lambda p: -self.seen[p])
        candidates = [m.rsplit("/p2p/", 1)[-1] for m in self.transport.initial_peers] + recent
        # a peer still in the table may be in hivemind's blacklist, whose back-off doubles with each
        # unanswered request (on a busy machine, for minutes): a read then skips it as if it were gone
        lost = [p for p in dict.fromkeys(_peer_ids(candidates)) if p not in table or p in self.dht.blacklist]
        missing = lost[:HEAL_PINGS]
        if not missing:
            return 0
        # the daemon may have forgotten an initial peer's address, which it knew from the dial only
        await self.transport.redial([p.to_base58() for p in missing], HEAL_DIAL_WAIT)
        ping = self.patience.wrap(self.dht.protocol.call_ping)
        # a peer still in the table is pinged beside them: a silent one is then given up once it
        # answers (patience.py), where it alone would wait out REQUEST_TIMEOUT
        beside = [p for p in table.uid_to_peer_id.values() if p not in missing and p not in self.dht.blacklist][:1]
        with reading():
            answers = await asyncio.gather(*(ping(p) for p in [*missing, *beside]))
        back = [p for p, node_id in zip(missing, answers) if node_id is not None]
        for peer in back:
            self.dht.blacklist.register_success(peer)
        if back:
            log.info("the DHT's routing table had lost %d known peers; %d answered again", len(missing), len(back))
        return len(back)

    async def shutdown(self) -> None:
        await self.dht.shutdown()
        await self.transport.shutdown()


def _entries(found) -> list[tuple[str, str, Any]]:
    """(subject, writer, value) of a read's subkeys, the latest first, at most MAX_FOUND. The
    subject is the subkey less its owner marker, the writer the subkey's signer (the validator has
    checked the signature)."""
    if found is None or not isinstance(found.value, dict):
        return []
    entries = sorted(found.value.items(), key=lambda item: -getattr(item[1], "expiration_time", 0.0))
    kept = [(_subject(subkey), owner_of(subkey), getattr(e, "value", None)) for subkey, e in entries[:MAX_FOUND]]
    return [(subject, writer, value) for subject, writer, value in kept if writer is not None]


def _subject(subkey: object) -> str:
    """A subkey less its owner marker: what it is about (a peer, a model)."""
    text = subkey if isinstance(subkey, bytes) else b""
    return text.split(b"[owner:", 1)[0].decode(errors="replace")


def _peer_ids(texts: Iterable[str]) -> Iterator[PeerID]:
    for text in texts:
        try:
            yield PeerID.from_base58(text)
        except ValueError:  # not base58: a record's id is only checked to be alphanumeric
            continue


def _capped(storage: DHTLocalStorage) -> CappedStorage:
    """A capped storage holding what `storage` got while the node bootstrapped."""
    capped = CappedStorage()
    for key, item in storage.items():
        capped.store(key, item.value, item.expiration_time)
    return capped


class _SigningKey(RSAPrivateKey):
    """The peer's own libp2p key, in the form hivemind's validator signs with: a record's owner key
    then hashes to the peer id it names, and a restarted peer (same --identity) owns its old subkey."""

    def __init__(self, key: rsa.RSAPrivateKey):
        self._private_key = key  # not super().__init__(), which would generate a new key


async def join_swarm(
    initial_peers: list[str],
    host: str | None = None,
    port: int = 0,
    identity_path: str | None = None,
    client_mode: bool = False,
    data_port: int = 0,
    announce_host: str | None = None,
    secret: SwarmSecret | None = None,
    relays: list[str] | None = None,
) -> SwarmNode:
    """Start libp2p and the DHT; a peer (not a client) also takes direct connections on `data_port`.
    An empty `initial_peers` starts a new swarm. Others reach this node at `announce_host` if given,
    or, given `relays` (behind a NAT), through relays only, those asked first. A client's daemon
    listens on every interface unless `host` says otherwise, so that a peer behind a NAT can call it
    back (net/circuits.py); a peer's on `host`, loopback by default.
    With a `secret`, the swarm is private: only nodes holding it answer this one, and it only them."""
    host = host or ("0.0.0.0" if client_mode else "127.0.0.1")
    transport = await Transport.start(
        initial_peers, host, port, identity_path, client_mode, announce_host, secret, relays
    )
    try:
        if not client_mode:
            try:
                await transport.listen(host, data_port)
            except OSError as exc:
                reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
                raise ConfigError(f"cannot listen for direct connections on {host}:{data_port}: {reason}") from exc
        identity = transport.identity
        validator = SwarmValidator(RSASignatureValidator(_SigningKey(identity.private_key) if identity else None))
        initial_peers = transport.initial_peers
        authorizer = None if secret is None else SecretAuthorizer(secret)
        try:
            # only the initial peers that answered the transport's dials: the others would be waited for
            dht = await DHTNode.create(
                p2p=transport.p2p, initial_peers=transport.reached, record_validator=validator,
                client_mode=client_mode, authorizer=authorizer, bootstrap_timeout=BOOTSTRAP_WAIT,
                wait_timeout=REQUEST_TIMEOUT,
            )
        except (*LIBP2P_ERRORS, RuntimeError) as exc:  # RuntimeError: hivemind's "bootstrap failed"
            if "none of the initial_peers responded" in str(exc):
                raise _unanswered(initial_peers, secret) from exc
            raise RouteError(f"cannot join the DHT through {initial_peers}: {exc}") from exc
        dht.protocol.storage = _capped(dht.protocol.storage)
        dht.protocol.cache = _capped(dht.protocol.cache)
        patience = Patience(dht.blacklist)
        # not call_ping: a node answering a joiner's ping pings it back through it, and a joiner told
        # it was not reached back (on a busy machine, by a ping given up) refuses to join
        for name in ("call_find", "call_store"):
            setattr(dht.protocol, name, patience.wrap(getattr(dht.protocol, name)))
    except BaseException:
        await transport.shutdown()
        raise
    if initial_peers and not dht.protocol.routing_table.get_nearest_neighbors(dht.node_id, 1, exclude=None):
        await dht.shutdown()
        await transport.shutdown()
        raise _unanswered(initial_peers, secret)
    return SwarmNode(transport=transport, dht=dht, validator=validator, patience=patience)


def _unanswered(initial_peers: list[str], secret: SwarmSecret | None) -> RouteError:
    """Reachable initial peers that do not answer the DHT: most likely, one side of a private swarm
    lacks its secret (the other side's nodes answer nothing to a node without it, or with another)."""
    mine = "" if secret is None else f" (this node's, from {secret.source}, may not be theirs)"
    return RouteError(
        f"no initial peer answered: {', '.join(initial_peers)}; "
        f"if the swarm is private, --swarm-secret must name its secret file{mine}"
    )
