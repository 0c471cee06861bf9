"""Join the swarm: a libp2p node plus a Kademlia DHT node, inside the caller's asyncio loop."""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from p2pfusion.dht.records import (
    MODELS_KEY,
    ModelEntry,
    PeerRecord,
    UnreachableReport,
    model_key,
    unreachable_key,
)
from p2pfusion.errors import RouteError
from p2pfusion.net.identity import peer_id_of_key
from p2pfusion.net.transport import Transport

log = logging.getLogger(__name__)

RECORD_TTL = 30.0


@dataclass
class SwarmNode:
    transport: Transport
    dht: DHTNode
    validator: RSASignatureValidator

    @property
    def p2p(self) -> P2P:
        return self.transport.p2p

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    async def maddrs(self) -> list[str]:
        return [str(m) for m in await self.p2p.get_visible_maddrs()]

    async def announce(self, record: PeerRecord, ttl: float = RECORD_TTL) -> bool:
        subkey = record.peer_id.encode() + self.validator.local_public_key
        return await self.dht.store(
            model_key(record.model), subkey=subkey, value=record.to_value(), expiration_time=get_dht_time() + ttl
        )

    async def announce_model(self, entry: ModelEntry, ttl: float = RECORD_TTL) -> bool:
        """List the model under a shared key, so `p2pfusion swarm` can show every model served and
        a client asking for an absent one can be told what the swarm has."""
        return await self.dht.store(
            MODELS_KEY, subkey=entry.key, value=entry.to_value(), expiration_time=get_dht_time() + ttl
        )

    async def models(self) -> list[ModelEntry]:
        """Every model listed in the last TTL, by display name then key."""
        found = await self.dht.get(MODELS_KEY, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        entries = [ModelEntry.from_value(subkey, getattr(e, "value", None)) for subkey, e in found.value.items()]
        return sorted((e for e in entries if e is not None), key=lambda e: (e.name, e.key))

    async def report_unreachable(self, model: str, peer_id: str, reason: str, ttl: float = RECORD_TTL) -> bool:
        value = {"peer_id": peer_id, "reason": reason[:200]}
        return await self.dht.store(
            unreachable_key(model), subkey=peer_id, value=value, expiration_time=get_dht_time() + ttl
        )

    async def unreachable_reports(self, model: str) -> list[UnreachableReport]:
        found = await self.dht.get(unreachable_key(model), latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        reports = [UnreachableReport.from_value(getattr(e, "value", None)) for e in found.value.values()]
        return [r for r in reports if r is not None]

    async def lookup(self, model: str) -> list[PeerRecord]:
        """Every valid, unexpired record of the model's peers, in all states."""
        found = await self.dht.get(model_key(model), latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        records = []
        for subkey, entry in found.value.items():
            record = PeerRecord.from_value(getattr(entry, "value", None))
            # the validator checked the value is signed by the subkey's owner; that owner must also
            # be the peer the record names, or anyone could announce layers in another peer's name
            if record is not None and record.model == model and _owner(subkey) == record.peer_id:
                records.append(record)
        return records

    async def shutdown(self) -> None:
        await self.dht.shutdown()
        await self.transport.shutdown()


_OWNER = re.compile(rb"\[owner:(.+?)\]")


@functools.lru_cache(maxsize=4096)
def _owner(subkey: object) -> str | None:
    """The peer id of the RSA key in a subkey's `[owner:...]` marker (None if it has none)."""
    match = _OWNER.search(subkey) if isinstance(subkey, bytes) else None
    if match is None:
        return None
    try:
        key = serialization.load_ssh_public_key(match.group(1))
    except (ValueError, UnsupportedAlgorithm):
        return None
    return peer_id_of_key(key) if isinstance(key, rsa.RSAPublicKey) else None


class _SigningKey(RSAPrivateKey):
    """The peer's own libp2p key, in the form hivemind's validator signs with: a record's owner key
    then hashes to the peer id it names, and a restarted peer (same --identity) owns its old subkey."""

    def __init__(self, key: rsa.RSAPrivateKey):
        self._private_key = key  # not super().__init__(), which would generate a new key


async def join_swarm(
    initial_peers: list[str],
    host: str = "127.0.0.1",
    port: int = 0,
    identity_path: str | None = None,
    client_mode: bool = False,
    data_port: int = 0,
    announce_host: str | None = None,
) -> SwarmNode:
    """Start libp2p and the DHT; a peer (not a client) also takes direct connections on `data_port`.
    An empty `initial_peers` starts a new swarm. Others reach this node at `announce_host` if given."""
    transport = await Transport.start(initial_peers, host, port, identity_path, client_mode, announce_host)
    try:
        if not client_mode:
            try:
                await transport.listen(host, data_port)
            except OSError as exc:
                raise RouteError(f"cannot listen for direct connections on {host}:{data_port}: {exc.strerror or exc}") from exc
        identity = transport.identity
        validator = RSASignatureValidator(_SigningKey(identity.private_key) if identity else None)
        initial_peers = transport.initial_peers
        dht = await DHTNode.create(
            p2p=transport.p2p, initial_peers=initial_peers, record_validator=validator, client_mode=client_mode
        )
    except Exception as exc:  # hivemind reports DHT bootstrap failures as assorted types; all end the join
        await transport.shutdown()
        if isinstance(exc, RouteError):
            raise
        raise RouteError(f"cannot join the DHT through {initial_peers}: {exc}") from exc
    if initial_peers and not dht.protocol.routing_table.get_nearest_neighbors(dht.node_id, 1, exclude=None):
        await dht.shutdown()
        await transport.shutdown()
        raise RouteError(f"no initial peer answered: {', '.join(initial_peers)}")
    return SwarmNode(transport=transport, dht=dht, validator=validator)
