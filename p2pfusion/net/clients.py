"""Who sent a stream: the address it counts against, and the client behind it.

A direct connection's address (an IPv4 address, or an IPv6 /64) bounds what its sender may hold,
because addresses are scarce. Several clients may share one address (a host, a NAT, a loopback
test), so each client also signs its connections' hello with a key of its own for the run, bound
to the peer it dials; the peer schedules compute fairly per client. Keys cost nothing to make, so
they never raise what an address may hold.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from p2pfusion.errors import RouteError

HELLO_PREFIX = b"p2pfusion client hello for "
MAX_KEY_BYTES = 128  # a P-256 public key in DER is 91
MAX_SIG_BYTES = 80  # an ECDSA P-256 signature in DER is at most 72


@dataclass(frozen=True)
class Source:
    address: str  # "ip:<address>" for direct connections, "peer:<id>" for libp2p streams: the unit of caps
    client: str | None = None  # "key:<digest>" when the client proved a key: the unit of fair scheduling

    @property
    def fairness(self) -> str:
        """Whose share of compute a stream's work counts against."""
        return self.address if self.client is None else f"{self.address}/{self.client}"

    def __str__(self) -> str:
        return self.fairness


class ClientKey:
    """A client's key for this run; it signs the hello of each direct connection."""

    def __init__(self):
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._public = self._key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self._proofs: dict[str, bytes] = {}

    def proof(self, peer_id: str) -> dict:
        """The hello's `client` entry for a connection to `peer_id` (a proof for one peer is worth
        nothing at another)."""
        if peer_id not in self._proofs:
            if len(self._proofs) > 4096:
                self._proofs.clear()
            self._proofs[peer_id] = self._key.sign(HELLO_PREFIX + peer_id.encode(), ec.ECDSA(hashes.SHA256()))
        return {"key": self._public, "sig": self._proofs[peer_id]}


def client_of(entry: object, peer_id: str) -> str | None:
    """The client a hello's `client` entry proves, for a connection to `peer_id`; None without one.
    Raises RouteError for a malformed or false proof."""
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("key"), bytes) or not isinstance(entry.get("sig"), bytes):
        raise RouteError("hello: `client` must hold a key and a signature")
    key, sig = entry["key"], entry["sig"]
    if len(key) > MAX_KEY_BYTES or len(sig) > MAX_SIG_BYTES:
        raise RouteError("hello: the client's key or signature is too long")
    try:
        public = serialization.load_der_public_key(key)
        if not isinstance(public, ec.EllipticCurvePublicKey):
            raise RouteError("hello: the client's key is not an elliptic-curve key")
        public.verify(sig, HELLO_PREFIX + peer_id.encode(), ec.ECDSA(hashes.SHA256()))
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise RouteError(f"hello: the client's proof does not hold: {exc!r}") from None
    return "key:" + hashlib.sha256(key).hexdigest()[:20]
