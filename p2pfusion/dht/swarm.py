"""Join the swarm: a libp2p node plus a Kademlia DHT node, inside the caller's asyncio loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from p2pfusion.dht.records import (
    MODELS_KEY,
    PeerRecord,
    UnreachableReport,
    model_key,
    unreachable_key,
)
from p2pfusion.errors import RouteError
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

    async def announce_model(self, model: str, ttl: float = RECORD_TTL) -> bool:
        """List the model under a shared key, so `p2pfusion swarm` can show every model served."""
        return await self.dht.store(MODELS_KEY, subkey=model, value=model, expiration_time=get_dht_time() + ttl)

    async def models(self) -> list[str]:
        found = await self.dht.get(MODELS_KEY, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        return sorted({e.value for e in found.value.values() if isinstance(getattr(e, "value", None), str)})

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
        for entry in found.value.values():
            record = PeerRecord.from_value(getattr(entry, "value", None))
            if record is not None and record.model == model:
                records.append(record)
        return records

    async def shutdown(self) -> None:
        await self.dht.shutdown()
        await self.transport.shutdown()


def _load_identity(identity_path: str | None) -> RSAPrivateKey | None:
    """The RSA key that signs DHT records; kept beside the libp2p identity so a peer keeps both."""
    if identity_path is None:
        return None
    path = identity_path + ".rsa"
    try:
        with open(path, "rb") as f:
            return RSAPrivateKey.from_bytes(f.read())
    except FileNotFoundError:
        key = RSAPrivateKey()
        with open(path, "wb") as f:
            f.write(key.to_bytes())
        return key


async def join_swarm(
    initial_peers: list[str],
    host: str = "127.0.0.1",
    port: int = 0,
    identity_path: str | None = None,
    client_mode: bool = False,
    data_port: int = 0,
) -> SwarmNode:
    """Start libp2p and the DHT; a peer (not a client) also takes direct connections on `data_port`.
    An empty `initial_peers` starts a new swarm."""
    transport = await Transport.start(initial_peers, host, port, identity_path, client_mode)
    try:
        if not client_mode:
            try:
                await transport.listen(host, data_port)
            except OSError as exc:
                raise RouteError(f"cannot listen for direct connections on {host}:{data_port}: {exc.strerror or exc}") from exc
        key = _load_identity(identity_path)
        validator = RSASignatureValidator(key) if key is not None else RSASignatureValidator()
        dht = await DHTNode.create(
            p2p=transport.p2p, initial_peers=initial_peers, record_validator=validator, client_mode=client_mode
        )
    except Exception as exc:
        await transport.shutdown()
        if isinstance(exc, RouteError):
            raise
        raise RouteError(f"cannot join the DHT through {initial_peers}: {exc}") from exc
    if initial_peers and not dht.protocol.routing_table.get_nearest_neighbors(dht.node_id, 1, exclude=None):
        await dht.shutdown()
        await transport.shutdown()
        raise RouteError(f"no initial peer answered: {', '.join(initial_peers)}")
    return SwarmNode(transport=transport, dht=dht, validator=validator)
