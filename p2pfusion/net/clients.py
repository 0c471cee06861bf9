"""Who sent a stream: the address it counts against, and the client behind it.

A direct connection's address (an IPv4 address, or an IPv6 /64) bounds what its sender may hold,
because addresses are scarce. Several clients may share one address (a host, a NAT, a loopback
test), so each client also signs its connections' hello with a key of its own for the run, bound
to the peer it dials; the peer schedules compute fairly per client. Keys cost nothing to make, so
they never raise what an address may hold.

A peer that relays sessions to the next hop dials from one address for all the clients it serves.
It proves its peer id in the hello (net.identity); where the swarm lists that peer, its streams
count against it, not against its address, and each session it relays against the client it names
(peer.admission), so one client's sessions at the first hop do not shut the others out further on.
"""

from __future__ import annotations

import hashlib
import ipaddress
import resource
from dataclasses import dataclass
from typing import Annotated

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from p2pfusion.errors import ProofError
from p2pfusion.net.wire import Length

# streams one source holds open at once: a client's 64 sessions (the peer's default share per
# client) hold up to two each (the session's, and at its last hop its results), plus pings
MAX_PER_SOURCE = 160
# streams from all the clients behind one relay: a relay costs nothing to run, and a client that
# can be reached only through one is rare (a NAT that hole punching did not open)
MAX_PER_RELAY = 32
MAX_CONNECTIONS = 4096  # streams held open at once in all, unless the fd limit calls for fewer
FD_RESERVE = 256  # descriptors kept for everything else: model files, the DHT, the daemon's socket


def connection_budget(fd_limit: int) -> int:
    """How many incoming streams a node holds at once, given its file descriptor limit: each may
    cost two descriptors (a hop opens the next hop for each session it serves)."""
    return max(1, min(MAX_CONNECTIONS, (fd_limit - FD_RESERVE) // 2))


def _fd_limit() -> int:
    """The process's descriptor limit, first raised to the hard limit where the soft one is lower
    (often 1,024, which would leave a peer room for a few hundred streams)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        wanted = 1 << 16 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)
        if wanted > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
                soft = wanted
            except (ValueError, OSError):  # a container may forbid it: the caps follow the lower limit
                pass
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


class ConnectionCaps:
    """Which incoming streams to admit: at most `per_source` open from one source (`per_relay` from
    all the clients behind one libp2p relay), and `total` in all."""

    def __init__(self, per_source: int = MAX_PER_SOURCE, total: int | None = None, per_relay: int = MAX_PER_RELAY):
        self.per_source = per_source
        self.per_relay = per_relay
        self.total = connection_budget(_fd_limit()) if total is None else total
        self.open: dict[str, int] = {}
        self.open_total = 0

    def admit(self, source: str) -> bool:
        cap = self.per_relay if source.startswith("circuit:") else self.per_source
        if self.open_total >= self.total or self.open.get(source, 0) >= cap:
            return False
        self.open[source] = self.open.get(source, 0) + 1
        self.open_total += 1
        return True

    def transfer(self, source: str, relay: str) -> None:
        """An admitted stream from `source` counts against `relay` from now on, with no cap of its
        own below the total: a listed peer relays the sessions of many clients, not only its own."""
        self.release(source)
        self.open[relay] = self.open.get(relay, 0) + 1
        self.open_total += 1

    def release(self, source: str) -> None:
        left = self.open[source] - 1
        if left:
            self.open[source] = left
        else:
            del self.open[source]
        self.open_total -= 1


def source_of_maddr(maddr: str) -> str:
    """The source a libp2p stream counts against, from the address it arrived from: its IP, as a
    direct connection from there would count; or, relayed ("/p2p/RELAY/p2p-circuit"), the relay's
    bucket, which every client behind that relay shares."""
    parts = maddr.split("/")
    if "p2p-circuit" in parts:
        relay = parts[parts.index("p2p-circuit") - 1]
        return f"circuit:{relay}"
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        return source_of((parts[2],))
    return "ip:unknown"


def source_of(peername: object) -> str:
    """The source a direct connection counts against: its IPv4 address, or its IPv6 /64 (one host's
    usual allocation, so rotating addresses within it gains nothing)."""
    try:
        ip = ipaddress.ip_address(str(peername[0]).split("%")[0])  # type: ignore[index]
    except (TypeError, IndexError, ValueError):
        return "ip:unknown"
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.version == 6:
        return f"ip:{ipaddress.ip_network((ip, 64), strict=False)}"
    return f"ip:{ip}"


HELLO_PREFIX = b"p2pfusion client hello for "
MAX_KEY_BYTES = 128  # a P-256 public key in DER is 91
MAX_SIG_BYTES = 80  # an ECDSA P-256 signature in DER is at most 72


@dataclass(frozen=True)
class ClientProof:
    """A hello's `client` entry: the client's key for this run, and its signature over the id of
    the peer it dials."""

    key: Annotated[bytes, Length(MAX_KEY_BYTES)]
    sig: Annotated[bytes, Length(MAX_SIG_BYTES)]


@dataclass(frozen=True)
class Source:
    address: str  # "ip:<address>", or "circuit:<relay id>" for a relayed libp2p stream: the unit of caps
    # "key:<digest>" when a direct connection's client proved a key, "peer:<id>" on libp2p: the unit of fair scheduling
    client: str | None = None
    peer: str | None = None  # the peer id the stream proved (libp2p's own, or a direct hello's proof)

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

    def proof(self, peer_id: str) -> ClientProof:
        """The hello's `client` entry for a connection to `peer_id` (a proof for one peer is worth
        nothing at another)."""
        if peer_id not in self._proofs:
            if len(self._proofs) > 4096:
                self._proofs.clear()
            self._proofs[peer_id] = self._key.sign(HELLO_PREFIX + peer_id.encode(), ec.ECDSA(hashes.SHA256()))
        return ClientProof(self._public, self._proofs[peer_id])


def client_of(proof: ClientProof | None, peer_id: str) -> str | None:
    """The client a hello's `client` entry proves, for a connection to `peer_id`; None without one.
    Raises ProofError for a false proof."""
    if proof is None:
        return None
    key, sig = proof.key, proof.sig
    try:
        public = serialization.load_der_public_key(key)
        if not isinstance(public, ec.EllipticCurvePublicKey):
            raise ProofError("hello: the client's key is not an elliptic-curve key")
        public.verify(sig, HELLO_PREFIX + peer_id.encode(), ec.ECDSA(hashes.SHA256()))
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise ProofError(f"hello: the client's proof does not hold: {exc!r}") from None
    return "key:" + hashlib.sha256(key).hexdigest()[:20]
