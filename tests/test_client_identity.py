"""A client's key in the hello of its direct connections: the unit of fair scheduling on a peer,
so clients behind one address (a NAT, a host, this test's loopback) get a share each."""

import asyncio

import pytest
import uvloop

from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import RouteError
from p2pfusion.net.clients import ClientKey, Source, client_of
from p2pfusion.net.framing import encode

PEER = "QmPeerA"


def test_a_proof_names_its_client_and_holds_only_for_its_peer():
    key, other = ClientKey(), ClientKey()
    client = client_of(key.proof(PEER), PEER)
    assert client is not None and client.startswith("key:")
    assert client_of(key.proof(PEER), PEER) == client  # one client, one name
    assert client_of(other.proof(PEER), PEER) != client
    assert client_of(None, PEER) is None  # no proof: the address alone
    with pytest.raises(RouteError, match="does not hold"):
        client_of(key.proof(PEER), "QmPeerB")  # a proof made for another peer
    forged = {"key": other.proof(PEER)["key"], "sig": key.proof(PEER)["sig"]}
    with pytest.raises(RouteError, match="does not hold"):
        client_of(forged, PEER)
    for bad in ("x", {"key": b"k"}, {"key": b"k" * 500, "sig": b"s"}, {"key": b"not der", "sig": b"s"}):
        with pytest.raises(RouteError):
            client_of(bad, PEER)
    assert Source("ip:10.0.0.1", client).fairness == f"ip:10.0.0.1/{client}"
    assert Source("peer:Qm").fairness == "peer:Qm"


async def _hellos():
    """The source a peer's handler saw for each of three direct connections (None: no handler ran):
    the client's own, one with a proof made for another peer, one with no proof."""
    peer = await join_swarm([])
    client = await join_swarm(await peer.maddrs(), client_mode=True)
    seen: asyncio.Queue = asyncio.Queue()

    async def handler(reader, writer, source):
        seen.put_nowait(source)
        writer.close()

    await peer.transport.add_handler("/test/hello", handler)
    [addr] = await peer.transport.listen("127.0.0.1")
    host, port = addr.rsplit(":", 1)
    sources = []
    try:
        await client.transport.open(peer.peer_id, [addr], "/test/hello")
        sources.append(await asyncio.wait_for(seen.get(), 5))
        for hello, wait in (
            ({"protocol": "/test/hello", "client": ClientKey().proof("QmSomeoneElse")}, 1.0),
            ({"protocol": "/test/hello"}, 5.0),
        ):
            _, writer = await asyncio.open_connection(host, int(port), ssl=client.transport._client_tls)
            writer.writelines(encode(hello))
            await writer.drain()
            try:
                sources.append(await asyncio.wait_for(seen.get(), wait))
            except TimeoutError:
                sources.append(None)
            writer.close()
        return sources
    finally:
        await client.shutdown()
        await peer.shutdown()


def test_peers_see_each_clients_key_and_drop_false_proofs():
    signed, forged, anonymous = uvloop.run(_hellos())
    assert signed.address == "ip:127.0.0.1" and signed.client is not None
    assert forged is None  # a proof for another peer: the connection is closed before any handler
    assert anonymous == Source("ip:127.0.0.1")  # old clients: the address is their share
