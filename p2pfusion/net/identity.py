"""A peer's libp2p identity, held in Python, and TLS certificates that prove it.

The direct data plane speaks plain TLS 1.3, so it needs what libp2p's own TLS handshake gives:
proof that the server holds the private key behind the peer id a client dialled. We follow the
libp2p TLS spec: the server's certificate is self-signed with a fresh key, and carries an
extension holding the libp2p public key and that key's signature over the certificate's key.
A client accepts the connection only if the signature holds and the public key hashes to the
peer id it meant to reach. Clients stay anonymous, as they are on the libp2p path.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from google.protobuf.message import DecodeError
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

from p2pfusion.errors import ConfigError, ProofError
from p2pfusion.net.wire import MAX_PEER_KEY_BYTES, MAX_PEER_SIG_BYTES, Length

SIGNED_KEY_OID = x509.ObjectIdentifier("1.3.6.1.4.1.53594.1.1")  # libp2p's, from its TLS spec
SIGNATURE_PREFIX = b"libp2p-tls-handshake:"
SHA2_256 = 0x12


KEY_MODE = 0o600  # key files are readable by their owner only
CERT_MIN_LIFE = datetime.timedelta(days=7)  # a kept certificate closer to expiry than this is made anew


@dataclass(frozen=True)
class Identity:
    private_key: rsa.RSAPrivateKey
    path: Path | None = None  # where the key lives; the TLS certificate is kept beside it

    @classmethod
    def create(cls, path: str | os.PathLike | None = None) -> Identity:
        """A new RSA identity, saved in libp2p's format (hivemind's too) when `path` is given."""
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        identity = cls(key, None if path is None else Path(path))
        if path is not None:
            der = key.private_bytes(
                serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
            )
            _write_private(Path(path), crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString())
        return identity

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> Identity:
        """Read a libp2p identity file, creating it first if missing."""
        path = Path(path)
        if not path.is_file():
            return cls.create(path)
        try:
            raw = crypto_pb2.PrivateKey.FromString(path.read_bytes())
            if raw.key_type != crypto_pb2.KeyType.RSA:
                raise ConfigError(f"{path}: only RSA identities are supported")
            key = serialization.load_der_private_key(raw.data, password=None)
        except (OSError, ValueError, DecodeError) as exc:
            raise ConfigError(f"{path} is not a readable libp2p identity file: {exc}") from exc
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ConfigError(f"{path}: only RSA identities are supported")
        _restrict(path)
        return cls(key, path)

    @property
    def public_key_proto(self) -> bytes:
        return _public_key_proto(self.private_key.public_key())

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.public_key_proto)

    def certificate(self, tls_key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
        """A self-signed certificate for `tls_key`, carrying this identity's signature over that key."""
        spki = tls_key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        signature = self.private_key.sign(SIGNATURE_PREFIX + spki, padding.PKCS1v15(), hashes.SHA256())
        return _self_signed(tls_key, self.peer_id, _der_signed_key(self.public_key_proto, signature))

    def tls_credentials(self) -> bytes:
        """PEM of the TLS key and certificate: kept in `<identity>.tls` for a saved identity, so a
        restarted peer presents the same certificate; made anew when missing, expiring or not ours."""
        kept = None if self.path is None else self.path.with_name(self.path.name + ".tls")
        if kept is not None and kept.is_file():
            pem = kept.read_bytes()
            if self._still_ours(pem):
                _restrict(kept)
                return pem
        tls_key = ec.generate_private_key(ec.SECP256R1())
        pem = tls_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ) + self.certificate(tls_key).public_bytes(serialization.Encoding.PEM)
        if kept is not None:
            _write_private(kept, pem)
        return pem

    def _still_ours(self, pem: bytes) -> bool:
        try:
            cert = x509.load_pem_x509_certificate(pem)
            verify_peer(cert.public_bytes(serialization.Encoding.DER), self.peer_id)
        except (ValueError, ProofError):
            return False
        now = datetime.datetime.now(datetime.timezone.utc)
        return cert.not_valid_after_utc - now > CERT_MIN_LIFE

    def server_context(self) -> ssl.SSLContext:
        """A TLS 1.3 server context whose certificate is bound to this identity."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        # ssl loads certificates only from files: write them where only we can read, then remove them
        with tempfile.TemporaryDirectory(prefix="p2pfusion-tls-") as folder:
            path = Path(folder, "credentials.pem")
            path.write_bytes(self.tls_credentials())
            context.load_cert_chain(path)
        return context


def _write_private(path: Path, data: bytes) -> None:
    """Write a key file readable by its owner only, atomically (a crash leaves no half-written key)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, KEY_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        tmp.replace(path)
    except OSError as exc:
        raise ConfigError(f"cannot write the key file {path}: {exc.strerror or exc}") from exc


def _restrict(path: Path) -> None:
    """Keys written by older versions or other tools may be readable by others: tighten them."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        try:
            path.chmod(mode & 0o700)
        except OSError as exc:
            raise ConfigError(f"{path} is readable by other users and cannot be restricted: {exc.strerror}") from exc


def _self_signed(tls_key: ec.EllipticCurvePrivateKey, subject: str, signed_key: bytes) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(x509.NameOID.SERIAL_NUMBER, subject)])
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(tls_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.UnrecognizedExtension(SIGNED_KEY_OID, signed_key), critical=False)
        .sign(tls_key, hashes.SHA256())
    )


def client_context() -> ssl.SSLContext:
    """Certificates are self-signed, so no CA checks them: `verify_peer` checks the identity instead."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _public_key_proto(key: rsa.RSAPublicKey) -> bytes:
    spki = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=spki).SerializeToString()


def peer_id_of_key(key: rsa.RSAPublicKey) -> str:
    return peer_id_of(_public_key_proto(key))


def peer_id_of(public_key_proto: bytes) -> str:
    """libp2p's peer id: the multihash of the protobuf-encoded public key (sha2-256 past 42 bytes)."""
    if len(public_key_proto) <= 42:
        digest = bytes([0x00, len(public_key_proto)]) + public_key_proto
    else:
        digest = bytes([SHA2_256, 32]) + hashlib.sha256(public_key_proto).digest()
    return PeerID(digest).to_base58()


def verify_peer(certificate_der: bytes | None, expected_peer_id: str) -> None:
    """Raise ProofError unless the certificate was signed off by `expected_peer_id`'s key."""
    if not certificate_der:
        raise ProofError(f"peer {expected_peer_id} presented no certificate")
    try:
        cert = x509.load_der_x509_certificate(certificate_der)
        extension = cert.extensions.get_extension_for_oid(SIGNED_KEY_OID).value
        public_key_proto, signature = _parse_signed_key(extension.value)
        proto = crypto_pb2.PublicKey.FromString(public_key_proto)
    except (ValueError, x509.ExtensionNotFound, IndexError) as exc:
        raise ProofError(f"peer {expected_peer_id} presented a certificate without a valid libp2p key: {exc}") from exc
    if peer_id_of(public_key_proto) != expected_peer_id:
        raise ProofError(f"the peer at that address is not {expected_peer_id}")
    if proto.key_type != crypto_pb2.KeyType.RSA:
        raise ProofError(f"peer {expected_peer_id} uses a key type this version cannot check")
    identity_key = serialization.load_der_public_key(proto.data)
    now = datetime.datetime.now(datetime.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise ProofError(f"peer {expected_peer_id} presented an expired certificate")
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        identity_key.verify(signature, SIGNATURE_PREFIX + spki, padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature as exc:
        raise ProofError(f"peer {expected_peer_id}'s certificate is not signed by its identity key") from exc


PEER_HELLO_PREFIX = b"p2pfusion peer hello for "


@dataclass(frozen=True)
class PeerProof:
    """A hello's `peer` entry: the peer's libp2p public key, and its signature over the id of the
    peer it dials."""

    key: Annotated[bytes, Length(MAX_PEER_KEY_BYTES)]
    sig: Annotated[bytes, Length(MAX_PEER_SIG_BYTES)]


class PeerProofs:
    """A peer's proofs of its id for the hellos of its direct connections: a signature by its
    identity key over the dialled peer's id (a proof made for one peer is worth nothing at another)."""

    def __init__(self, identity: Identity):
        self._identity = identity
        self._made: dict[str, PeerProof] = {}

    def proof(self, peer_id: str) -> PeerProof:
        if peer_id not in self._made:
            if len(self._made) > 4096:
                self._made.clear()
            self._made[peer_id] = signed(self._identity, PEER_HELLO_PREFIX + peer_id.encode())
        return self._made[peer_id]


def signed(identity: Identity, message: bytes) -> PeerProof:
    """`message` signed by `identity`'s key, beside the key: what `signer` checks."""
    return PeerProof(identity.public_key_proto, identity.private_key.sign(message, padding.PKCS1v15(), hashes.SHA256()))


def signer(proof: PeerProof, message: bytes, what: str) -> str:
    """The peer id whose key signed `message` in `proof`; ProofError naming `what` when it did not."""
    try:
        proto = crypto_pb2.PublicKey.FromString(proof.key)
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise ProofError(f"{what}: the peer's key is not an RSA key")
        public = serialization.load_der_public_key(proto.data)
        if not isinstance(public, rsa.RSAPublicKey):
            raise ProofError(f"{what}: the peer's key is not an RSA key")
        public.verify(proof.sig, message, padding.PKCS1v15(), hashes.SHA256())
    except (ValueError, TypeError, DecodeError, InvalidSignature) as exc:
        raise ProofError(f"{what}: the peer's proof does not hold: {exc!r}") from None
    return peer_id_of(proof.key)


def peer_of(proof: PeerProof | None, peer_id: str) -> str | None:
    """The peer id a hello's `peer` entry proves, for a connection to `peer_id`; None without one.
    Raises ProofError for a false proof."""
    return None if proof is None else signer(proof, PEER_HELLO_PREFIX + peer_id.encode(), "hello")


# The extension's value is DER: SEQUENCE { publicKey OCTET STRING, signature OCTET STRING }.


def _der_length(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(body)]) + body


def _der(tag: int, content: bytes) -> bytes:
    return bytes([tag]) + _der_length(len(content)) + content


def _der_signed_key(public_key: bytes, signature: bytes) -> bytes:
    return _der(0x30, _der(0x04, public_key) + _der(0x04, signature))


def _read_der(data: bytes, offset: int, tag: int) -> tuple[bytes, int]:
    if data[offset] != tag:
        raise ValueError(f"expected DER tag {tag:#x}")
    length, offset = data[offset + 1], offset + 2
    if length & 0x80:
        size = length & 0x7F
        if not 0 < size <= 4:
            raise ValueError("bad DER length")
        length, offset = int.from_bytes(data[offset:offset + size], "big"), offset + size
    if offset + length > len(data):
        raise ValueError("truncated DER value")
    return data[offset:offset + length], offset + length


def _parse_signed_key(data: bytes) -> tuple[bytes, bytes]:
    sequence, end = _read_der(data, 0, 0x30)
    if end != len(data):
        raise ValueError("trailing bytes after the signed key")
    public_key, offset = _read_der(sequence, 0, 0x04)
    signature, offset = _read_der(sequence, offset, 0x04)
    if offset != len(sequence):
        raise ValueError("trailing bytes inside the signed key")
    return public_key, signature
