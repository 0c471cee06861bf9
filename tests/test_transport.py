"""The direct data plane: TLS bound to libp2p identities, with libp2p streams as the fallback."""

import asyncio

import pytest
import torch
import uvloop
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding

from p2pfusion.errors import PeerFailed, PeerUnreachable, ProofError
from p2pfusion.net import identity as ident
from p2pfusion.net import probe
from p2pfusion.net.framing import read_frame, write_frame
from p2pfusion.net.transport import Transport


def _der(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def test_certificate_proves_exactly_its_identity(tmp_path):
    alice = ident.Identity.load_or_create(tmp_path / "alice")
    bob = ident.Identity.load_or_create(tmp_path / "bob")
    assert ident.Identity.load_or_create(tmp_path / "alice").peer_id == alice.peer_id  # read back, not regenerated
    tls_key = ec.generate_private_key(ec.SECP256R1())
    cert = alice.certificate(tls_key)
    ident.verify_peer(_der(cert), alice.peer_id)
    with pytest.raises(ProofError, match="not"):
        ident.verify_peer(_der(cert), bob.peer_id)
    # Alice's public key in the extension, but signed by Bob: a forgery
    spki = tls_key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    forged_signature = bob.private_key.sign(ident.SIGNATURE_PREFIX + spki, padding.PKCS1v15(), hashes.SHA256())
    forged = ident._self_signed(tls_key, alice.peer_id, ident._der_signed_key(alice.public_key_proto, forged_signature))
    with pytest.raises(ProofError, match="not signed"):
        ident.verify_peer(_der(forged), alice.peer_id)
    garbled = ident._self_signed(tls_key, alice.peer_id, b"\x30\x05\x04\x09abc")
    with pytest.raises(ProofError, match="valid libp2p key"):
        ident.verify_peer(_der(garbled), alice.peer_id)
    with pytest.raises(ProofError):
        ident.verify_peer(None, alice.peer_id)


async def _echo(reader, writer, tensor):
    await write_frame(writer, {"probe": 1}, tensor)
    return await read_frame(reader)


async def _scenario():
    server = await Transport.start([], "127.0.0.1", 0, None, client_mode=False)
    other = await Transport.start([], "127.0.0.1", 0, None, client_mode=False)
    maddrs = [str(m) for m in await server.p2p.get_visible_maddrs()] + [str(m) for m in await other.p2p.get_visible_maddrs()]
    client = await Transport.start(maddrs, "127.0.0.1", 0, None, client_mode=True)
    seen = {}
    try:
        for t in (server, other):
            await t.listen("127.0.0.1", 0)
            await probe.serve_probes(t)
        tensor = torch.randn(1, 128, 576)

        reader, writer = await client.open(server.peer_id, server.data_addrs, probe.PROTOCOL)
        seen["direct_tls"] = writer.get_extra_info("ssl_object") is not None
        _, echoed = await _echo(reader, writer, tensor)
        seen["direct_exact"] = torch.equal(echoed, tensor)
        writer.close()

        # Garbage on the data port, in the clear and inside TLS, costs the sender its connection only.
        raw_reader, raw_writer = await asyncio.open_connection(*server.data_addrs[0].split(":"))
        raw_writer.write(b"GET / HTTP/1.1\r\n\r\n")
        seen["cleartext_closed"] = await asyncio.wait_for(raw_reader.read(), 5) == b""
        tls_reader, tls_writer = await asyncio.open_connection(*server.data_addrs[0].split(":"), ssl=ident.client_context())
        tls_writer.write(b"\x00" * 64)
        seen["garbage_closed"] = await asyncio.wait_for(tls_reader.read(), 5) == b""
        unknown_reader, unknown_writer = await asyncio.open_connection(
            *server.data_addrs[0].split(":"), ssl=ident.client_context()
        )
        await write_frame(unknown_writer, {"protocol": "no.such.protocol"})
        reply, _ = await asyncio.wait_for(read_frame(unknown_reader), 5)
        seen["unknown_protocol_refused"] = "no handler" in reply["message"]
        seen["unknown_protocol_closed"] = await asyncio.wait_for(unknown_reader.read(), 5) == b""

        # `other`'s address does not prove `server`'s identity: the stream goes through libp2p instead.
        reader, writer = await client.open(server.peer_id, other.data_addrs, probe.PROTOCOL)
        seen["impostor_refused"] = writer.get_extra_info("ssl_object") is None
        _, echoed = await _echo(reader, writer, tensor)
        seen["fallback_exact"] = torch.equal(echoed, tensor)
        writer.close()
        seen["still_serving"] = await probe.reachable(client, other.peer_id, other.data_addrs)
    finally:
        for t in (client, server, other):
            await t.shutdown()
    return seen


def test_direct_tls_with_libp2p_fallback():
    seen = uvloop.run(_scenario())
    assert seen == {key: True for key in seen} and len(seen) == 9, seen


async def _unreachable() -> list[BaseException]:
    """What opening a stream raises toward a peer that is not there, by every way there is to fail."""
    client = await Transport.start([], "127.0.0.1", 0, None, client_mode=True)
    gone = ident.Identity.create().peer_id  # a well-formed id no daemon serves
    raised = []
    try:
        for peer_id, addrs in ((gone, []), (gone, ["127.0.0.1:1"]), ("not-base58-0OIl", [])):
            try:
                await client.open(peer_id, addrs, probe.PROTOCOL, timeout=2.0)
            except PeerUnreachable as exc:
                raised.append(exc)
    finally:
        await client.shutdown()
    return raised


def test_every_failed_open_is_one_peer_unreachable_naming_the_peer():
    """libp2p's assorted errors (a daemon's control failure, a malformed id, a timeout) and a refused
    direct dial all reach callers as PeerUnreachable, a PeerFailed naming the peer: nothing else
    escapes `Transport.open`, so callers catch no more than that."""
    raised = uvloop.run(_unreachable())
    assert len(raised) == 3
    assert all(isinstance(exc, PeerFailed) and exc.peer_id and exc.peer_id in str(exc) for exc in raised)
