"""A client's key in the hello of its direct connections: the unit of fair scheduling on a peer,
so clients behind one address (a NAT, a host, this test's loopback) get a share each."""

import asyncio

import pytest
import uvloop

from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import ProofError
from p2pfusion.net import wire
from p2pfusion.net.clients import ClientKey, ClientProof, Source, client_of
from p2pfusion.net.framing import encode
from p2pfusion.net.identity import Identity, PeerProof, PeerProofs, peer_of
from p2pfusion.net.transport import Hello
from p2pfusion.net.wire import WireError, decode_as

PEER = "QmPeerA"


def test_a_proof_names_its_client_and_holds_only_for_its_peer():
    key, other = ClientKey(), ClientKey()
    client = client_of(key.proof(PEER), PEER)
    assert client is not None and client.startswith("key:")
    assert client_of(key.proof(PEER), PEER) == client  # one client, one name
    assert client_of(other.proof(PEER), PEER) != client
    assert client_of(None, PEER) is None  # no proof: the address alone
    with pytest.raises(ProofError, match="does not hold"):
        client_of(key.proof(PEER), "QmPeerB")  # a proof made for another peer
    forged = ClientProof(other.proof(PEER).key, key.proof(PEER).sig)
    with pytest.raises(ProofError, match="does not hold"):
        client_of(forged, PEER)
    with pytest.raises(ProofError):
        client_of(ClientProof(b"not der", b"s"), PEER)
    for bad in ("x", {"key": b"k"}, {"key": b"k" * 500, "sig": b"s"}, {"key": "text", "sig": b"s"}):
        with pytest.raises(WireError):  # malformed: refused before any signature is checked
            decode_as(ClientProof, bad)
    assert Source("ip:10.0.0.1", client).fairness == f"ip:10.0.0.1/{client}"
    assert Source("peer:Qm").fairness == "peer:Qm"


def test_a_peer_proof_names_its_peer_id_and_holds_only_for_the_peer_dialled():
    identity, other = Identity.create(), Identity.create()
    proofs = PeerProofs(identity)
    assert peer_of(proofs.proof(PEER), PEER) == identity.peer_id
    assert peer_of(None, PEER) is None
    with pytest.raises(ProofError, match="does not hold"):
        peer_of(proofs.proof(PEER), "QmPeerB")
    forged = PeerProof(other.public_key_proto, proofs.proof(PEER).sig)
    with pytest.raises(ProofError, match="does not hold"):
        peer_of(forged, PEER)
    with pytest.raises(ProofError):
        peer_of(PeerProof(b"\xff\xff", b"s"), PEER)
    for bad in ("x", {"key": b"k"}, {"key": b"k" * 900, "sig": b"s"}):
        with pytest.raises(WireError):
            decode_as(PeerProof, bad)


async def _hellos():
    """The source a peer's handler saw for each of five direct connections (None: no handler ran):
    the client's own, another peer's, one with a client proof made for another peer, one with a
    peer proof made for another peer, one with no proof."""
    peer = await join_swarm([])
    client = await join_swarm(await peer.maddrs(), client_mode=True)
    other = await join_swarm(await peer.maddrs())
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
        await other.transport.open(peer.peer_id, [addr], "/test/hello")
        sources.append(await asyncio.wait_for(seen.get(), 5))
        assert sources[-1].peer == other.peer_id
        for hello, wait in (
            (Hello("/test/hello", client=ClientKey().proof("QmSomeoneElse")), 1.0),
            (Hello("/test/hello", peer=PeerProofs(other.transport.identity).proof("QmSomeoneElse")), 1.0),
            (Hello("/test/hello"), 5.0),
        ):
            _, writer = await asyncio.open_connection(host, int(port), ssl=client.transport._client_tls)
            writer.writelines(encode(wire.encode(hello)))
            await writer.drain()
            try:
                sources.append(await asyncio.wait_for(seen.get(), wait))
            except TimeoutError:
                sources.append(None)
            writer.close()
        return sources
    finally:
        await client.shutdown()
        await other.shutdown()
        await peer.shutdown()


def test_peers_see_each_clients_key_and_drop_false_proofs():
    signed, relay, forged, forged_peer, anonymous = uvloop.run(_hellos())
    assert signed.address == "ip:127.0.0.1" and signed.client is not None and signed.peer is None
    assert relay.client is not None  # a peer proves its id (checked above) and a client key
    assert forged is None and forged_peer is None  # proofs for another peer: closed before any handler
    assert anonymous == Source("ip:127.0.0.1")  # old clients: the address is their share
