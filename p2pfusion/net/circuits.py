"""Relayed libp2p addresses: a peer behind a NAT that takes no inbound connection is reached
through another peer's relay (libp2p's circuit relay v2), at `<relay's address>/p2p/<relay>/
p2p-circuit/p2p/<peer>`.

The libp2p daemon reserves a slot at some relays on its own (autorelay) but does not say which, so
a relayed peer starts its daemon naming the swarm's listed peers as relays (it asks them at once
when they are four or more; else it looks for relays itself, first after 15 s, and asks once it
knows four, or after three minutes), connects to several, lets it ask, and announces a circuit
through each relay it is connected to; a dialler's daemon tries them all at once, and those
holding no slot fail at once. (Which hold one cannot be checked from the peer's own host: a dial from there
through a relay opened even where a dialler elsewhere was refused.) hivemind's `Multiaddr` writes a
`/p2p/` id as a CIDv1, which the Go daemon cannot read (it expects the bare multihash), so the
addresses a dialler hands its daemon are encoded here.

A circuit carries introductions, not sessions: every relay resets one after 128 KiB each way (the
daemon starts a second relay service with go-libp2p's default limits beside the one its
`-relayDataLimit` configures, and that one answers). So a dialler that reached a relayed peer
through a relay asks it to call back (CALL_BACK): the relayed peer hangs up and dials the dialler
directly, out through its NAT, and every stream then takes that connection. A dialler nobody can
dial (behind a NAT too) gets no call and cannot use the peer.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Awaitable, Callable

import base58
import varint
from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.multiaddr.codecs import LENGTH_PREFIXED_VAR_SIZE
from hivemind.utils.multiaddr.exceptions import Error as MultiaddrError
from hivemind.utils.multiaddr.transforms import string_iter
from netaddr import AddrFormatError

from p2pfusion.errors import PeerUnreachable

log = logging.getLogger(__name__)

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]

CIRCUIT = "p2p-circuit"
MAX_CIRCUITS = 8  # relays a relayed peer announces (a record lists at most this many addresses)
DIAL_TIMEOUT = 5.0  # seconds a dial to a relay may take
# Seconds a relayed peer leaves its daemon to ask relays for slots. Told of MIN_RELAYS or more at
# its start, it holds two slots 0.3 s later. Else it finds relays itself, first after 15 s: it held
# slots after 14-19 s, and announcing after 20 s, a dialler was still refused now and then.
NAMED_SLOT_WAIT = 10.0
SLOT_WAIT = 45.0
MIN_RELAYS = 4  # relays the daemon knows before it asks any for a slot (earlier: after 3 minutes)
SLOT_POLL = 2.0  # seconds between reads of the swarm's peers to connect to
MAX_RELAYED_PEERS = 1024  # relayed peers whose addresses a node keeps
CALL_BACK = "p2pfusion.call-back.v1"
CALL_BACK_WAIT = 5.0  # seconds a dialler waits for a relayed peer's direct connection
CALL_BACK_POLL = 0.05
# What hivemind's libp2p bindings raise when the daemon cannot reach a peer or start: its own
# errors, socket and stream errors, a malformed peer id or address (ValueError), an answer that is
# no protobuf, a timeout. Caught around those calls only, so no bug of ours passes for a dead peer.
LIBP2P_ERRORS = (P2PDaemonError, P2PHandlerError, OSError, EOFError, TimeoutError, ValueError, DecodeError)


def is_circuit(maddr: str) -> bool:
    """Whether an address (a record's, or a connection's remote end) goes through a relay."""
    return f"/{CIRCUIT}/" in maddr or maddr.endswith(f"/{CIRCUIT}")


def daemon_maddr(text: str) -> Multiaddr:
    """`text` as the Go daemon reads it: each `/p2p/` id as its multihash. ValueError when `text`
    is no multiaddr."""
    parts = []
    try:
        for proto, codec, value in string_iter(text):
            parts.append(varint.encode(proto.code))
            if value is None:
                continue
            raw = base58.b58decode(value) if proto.name == "p2p" else codec.to_bytes(proto, value)
            if codec.SIZE == LENGTH_PREFIXED_VAR_SIZE:
                parts.append(varint.encode(len(raw)))
            parts.append(raw)
    # the library's own errors, an IP netaddr cannot read, a port out of range, bad base58
    except (MultiaddrError, AddrFormatError, struct.error, ValueError, KeyError) as exc:
        raise ValueError(f"not a multiaddr: {text[:80]!r}") from exc
    return Multiaddr(b"".join(parts))


class CircuitBook:
    """The relayed addresses of the peers whose records list some: a dialler's daemon knows no way
    to them else."""

    def __init__(self):
        self._circuits: dict[str, list[str]] = {}

    def learn(self, peer_id: str, maddrs: list[str]) -> None:
        circuits = [a for a in maddrs if is_circuit(a)][:MAX_CIRCUITS]
        if not circuits:
            self._circuits.pop(peer_id, None)
            return
        if peer_id not in self._circuits and len(self._circuits) >= MAX_RELAYED_PEERS:
            self._circuits.pop(next(iter(self._circuits)))  # the one learnt first
        self._circuits[peer_id] = circuits

    def get(self, peer_id: str) -> list[str]:
        return self._circuits.get(peer_id, [])


def slot_wait(named: int) -> float:
    """Seconds to leave a relayed peer's daemon to reserve slots, told of `named` relays at its start."""
    return NAMED_SLOT_WAIT if named >= MIN_RELAYS else SLOT_WAIT


def relay_addresses(peers: list[tuple[str, list[str]]], me: str) -> list[str]:
    """Full addresses (`.../p2p/<id>`) of up to MAX_CIRCUITS of these peers (id, addresses) that a
    relayed node's daemon can be told to ask for slots at once: one each, neither loopback nor a
    circuit, nor one the daemon could not read (it stops on a bad one)."""
    found = []
    for peer, addrs in peers:
        try:
            PeerID.from_base58(peer)
        except ValueError:
            continue
        for addr in addrs if peer != me else []:
            base = addr.split("/p2p/")[0]
            parts = base.split("/")
            if is_circuit(addr) or len(parts) < 3 or parts[2].startswith("127.") or parts[2] == "::1":
                continue
            try:
                daemon_maddr(f"{base}/p2p/{peer}")
            except ValueError:
                continue
            found.append(f"{base}/p2p/{peer}")
            break
    return found[:MAX_CIRCUITS]


def circuits_through(relays: list[tuple[str, list[str]]], me: str) -> list[str]:
    """Circuit addresses of peer `me` through each relay (peer id, its addresses), loopback left
    out (nobody else reaches a relay there), at most MAX_CIRCUITS."""
    found = []
    for relay, addrs in relays:
        for addr in addrs:
            parts = addr.split("/")
            if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or is_circuit(addr):
                continue
            if parts[2].startswith("127.") or parts[2] == "::1":
                continue
            found.append(f"{'/'.join(parts[:5])}/p2p/{relay}/{CIRCUIT}/p2p/{me}")
            break
    return found[:MAX_CIRCUITS]


async def own_circuits(node: P2P) -> list[str]:
    """`node`'s relayed addresses: a circuit through each peer it is connected to."""
    peers = [(str(info.peer_id), [str(a) for a in info.addrs]) for info in await node.list_peers()]
    return circuits_through(peers, node.peer_id.to_base58())


async def connect_relays(node: P2P, peers: list[tuple[str, list[str]]]) -> None:
    """Connect `node` to up to MAX_CIRCUITS of these peers (id, addresses): the relays its daemon
    may ask for a slot."""
    await asyncio.gather(*(_connect(node, peer, addrs) for peer, addrs in peers[:MAX_CIRCUITS]))


async def _connect(node: P2P, peer: str, addrs: list[str]) -> None:
    try:
        # the daemon takes the peer's id apart from its addresses
        maddrs = [daemon_maddr(a.split("/p2p/")[0]) for a in addrs if not is_circuit(a)]
        await asyncio.wait_for(node._client.connect(PeerID.from_base58(peer), maddrs), DIAL_TIMEOUT)
    except LIBP2P_ERRORS as exc:
        log.debug("no connection to relay %s: %r", peer, exc)


async def _remote_ends(node: P2P, peer: str) -> list[str]:
    """The remote addresses of `node`'s connections to `peer` (a relayed one's ends in /p2p-circuit)."""
    return [str(a) for info in await node.list_peers() if info.peer_id.to_base58() == peer for a in info.addrs]


async def direct_to(node: P2P, peer: str) -> bool:
    """Whether `node` holds a connection to `peer` that no relay carries."""
    return any(not is_circuit(a) for a in await _remote_ends(node, peer))


async def call_back(node: P2P, peer: str) -> None:
    """On a relayed node, asked by `peer`: close the relayed connections to it (the daemon's connect
    does nothing while one is open) and dial it directly at the addresses it gave when it connected.
    A peer with a direct connection already is left as it is, so a stranger can only cut its own."""
    try:
        ends = await _remote_ends(node, peer)
        if not ends or not all(is_circuit(a) for a in ends):
            return
        peer_id = PeerID.from_base58(peer)
        await node._client.disconnect(peer_id)
        await asyncio.wait_for(node._client.connect(peer_id, []), DIAL_TIMEOUT)
    except LIBP2P_ERRORS as exc:
        log.info("cannot call back %s, which reached this peer through a relay: %r", peer, exc)


class CallBacks:
    """A dialler's direct connections to relayed peers, one request in flight per peer."""

    def __init__(self):
        self._pending: dict[str, asyncio.Future] = {}

    async def reach(self, node: P2P, peer: str, circuits: list[str], ask: Callable[[], Awaitable[Stream]]) -> None:
        """Make sure `node` reaches relayed `peer` directly: connect through its `circuits`, open a
        CALL_BACK stream with `ask`, and wait for its call. PeerUnreachable if none comes."""
        if await direct_to(node, peer):
            return
        pending = self._pending.get(peer)
        if pending is None:
            pending = self._pending[peer] = asyncio.ensure_future(_ask(node, peer, circuits, ask))
            pending.add_done_callback(lambda done: self._settled(peer, done))
        await asyncio.shield(pending)  # a caller cancelled leaves the request to the others waiting

    def _settled(self, peer: str, done: asyncio.Future) -> None:
        del self._pending[peer]
        if not done.cancelled():
            done.exception()  # each caller got it; asyncio need not report it again


async def _ask(node: P2P, peer: str, circuits: list[str], ask: Callable[[], Awaitable[Stream]]) -> None:
    deadline = time.monotonic() + CALL_BACK_WAIT
    try:
        maddrs = [daemon_maddr(a) for a in circuits]
        await asyncio.wait_for(node._client.connect(PeerID.from_base58(peer), maddrs), DIAL_TIMEOUT)
        reader, writer = await ask()
        try:  # the peer hangs up before it calls
            await asyncio.wait_for(reader.read(1), CALL_BACK_WAIT)
        finally:
            writer.close()
    except LIBP2P_ERRORS as exc:
        raise PeerUnreachable(f"peer {peer} unreachable through its relays: {exc!r}", peer) from exc
    while not await direct_to(node, peer):
        if time.monotonic() > deadline:
            raise PeerUnreachable(
                f"peer {peer} is behind a NAT and did not connect back to this node (is this node behind one "
                "too, or listening on loopback only?); its relays carry no sessions", peer,
            )
        await asyncio.sleep(CALL_BACK_POLL)
    log.info("peer %s, behind a NAT, connected back to this node", peer)
