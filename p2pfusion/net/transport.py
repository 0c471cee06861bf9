"""Streams between peers: a direct TLS connection where one peer can reach the other, a libp2p
stream (through the p2pd daemons, relays included) where it cannot.

libp2p carries discovery, the DHT and control, and is the fallback for data. Hidden states take
the direct path when they can: every libp2p stream crosses Python -> Go -> network -> Go -> Python
and costs milliseconds per message, where a TLS socket costs tens of microseconds. Both paths hand
a protocol handler the same asyncio (reader, writer) pair, so handlers do not know which carried
them. A direct connection starts with one hello frame naming the protocol, as libp2p would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import ssl
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from hivemind.p2p import P2P, PeerID
from hivemind.utils.logging import use_hivemind_log_handler

from p2pfusion.errors import ConfigError, PeerUnreachable, ProofError, RouteError
from p2pfusion.net import wire
from p2pfusion.net.addresses import ANY, announced, free_port, split_addr
from p2pfusion.net import bootstrap
from p2pfusion.net.circuits import CALL_BACK, LIBP2P_ERRORS, CallBacks, CircuitBook, Stream, call_back
from p2pfusion.net.clients import ClientKey, ClientProof, ConnectionCaps, Source, client_of, source_of, source_of_maddr
from p2pfusion.net.framing import FrameError, FrameLimits, encode, read_frame, write_frame
from p2pfusion.net.identity import Identity, PeerProof, PeerProofs, client_context, peer_of, verify_peer
from p2pfusion.net.secret import SecretProof, SwarmSecret

log = logging.getLogger(__name__)
# hivemind's lines go through the application's own handlers, in its format, rather than a
# handler and format of hivemind's own beside them
use_hivemind_log_handler("nowhere")

# (reader, writer, source): who sent the stream (net.clients.Source)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, Source], Awaitable[None]]

JOIN_TIMEOUT = 20.0
DIRECT_TIMEOUT = 3.0  # a direct dial slower than this is treated as unreachable
DIRECT_RETRY = 60.0  # after a failed direct dial, use libp2p to that peer for this long
MAX_DIALED = 3  # addresses of one peer dialed (at once) before falling back to libp2p
HELLO_TIMEOUT = DIRECT_TIMEOUT  # for the TLS handshake and the hello together, as a dialer allows
HELLO_LIMITS = FrameLimits(header=2 << 10, body=0)  # a peer's hello carries its RSA key and a signature
REFUSAL_LOG_INTERVAL = 10.0
# Large enough that a 128-token hidden state arrives without pausing the socket half-way.
STREAM_LIMIT = 8 << 20
DIRECT_ERRORS = (OSError, TimeoutError, ValueError, ProofError)  # a direct dial: refused, silent, or not the peer
MAX_PROTOCOL = 128


@dataclass(frozen=True)
class Hello:
    """A direct connection's first frame: the protocol it asks for, as libp2p would name it, and the
    dialler's proofs (its client key's, its peer id's, the swarm secret's). On a libp2p stream,
    which names its protocol itself, a private swarm's first frame carries the secret's proof alone."""

    protocol: Annotated[str, wire.Length(MAX_PROTOCOL)] = ""
    client: ClientProof | None = None
    peer: PeerProof | None = None
    secret: SecretProof | None = None


class Transport:
    """This node's libp2p host plus, on peers, a direct TLS listener."""

    def __init__(
        self, p2p: P2P, identity: Identity | None, announce_host: str | None = None, initial_peers: Sequence[str] = (),
        secret: SwarmSecret | None = None, relays: list[str] | None = None,
    ):
        self.p2p = p2p
        # behind a NAT, others reach this node through relays only: those its daemon was told to ask
        self.relays = relays
        self.identity = identity
        self.data_addrs: list[str] = []
        self._handlers: dict[str, Handler] = {}
        self._listener: socket.socket | None = None
        self._server_tls: ssl.SSLContext | None = None
        self._serving: set[asyncio.Task] = set()  # the accept loop and direct connections (tasks are weakly held)
        self._client_tls = client_context()
        self.client_key = ClientKey()  # signs our hellos, so peers tell this node's streams from others' at its address
        self._peer_proofs = None if identity is None else PeerProofs(identity)  # a peer's hellos prove its id too
        # whether a peer id is one the swarm lists: its streams are a relay's, not one client's (set by a peer)
        self.listed: Callable[[str], bool] = lambda peer_id: False
        self._direct_failed: dict[str, float] = {}
        self.caps = ConnectionCaps()
        self._refused = 0  # connections refused since the last log line about them
        self._next_refusal_log = 0.0
        self.announce_host = announce_host
        self.initial_peers = list(initial_peers)  # those it joined through (never itself)
        self.reached: list[str] = []  # those of them that answered its dials while it joined
        self.secret = secret  # a private swarm's: every stream's hello, both ways, proves it
        self.circuit_book = CircuitBook()  # relayed peers' addresses, from their records
        self.call_backs = CallBacks()

    @classmethod
    async def start(
        cls,
        initial_peers: list[str],
        host: str,
        port: int,
        identity_path: str | None,
        client_mode: bool,
        announce_host: str | None = None,
        secret: SwarmSecret | None = None,
        relays: list[str] | None = None,
    ) -> Transport:
        """Start libp2p. A peer always gets an identity held here, so its TLS certificate can prove it.
        `announce_host` is the address others reach this host at, when it listens on 0.0.0.0 behind
        a forwarded port or has several interfaces. `relays`, when given: this host takes no inbound
        connection (a NAT), so its daemon reserves slots at relays, asking these (full addresses)
        at once (net/circuits.py)."""
        # no bootstrap peers for the daemon, which dials them one by one: they are dialled at once below
        kwargs = dict(host_maddrs=[f"/ip4/{host}/tcp/{port}"])
        if relays is not None:
            # AutoNAT would find it out only from peers on public addresses; the caller knows already.
            # Relays named are asked at once; others wait for the daemon's discovery, 15 s or more.
            kwargs.update(use_auto_relay=True, force_reachability="private", trusted_relays=relays or None)
        identity, scratch = None, None
        # a client keeps an identity only when given one: a training run's driver, whom the run's
        # replicas obey by its peer id
        if not client_mode or identity_path is not None:
            if identity_path is None:  # a fresh key, used for this run only
                scratch = tempfile.TemporaryDirectory(prefix="p2pfusion-id-")
                key_file, kept = Path(scratch.name, "identity.key"), False
                identity = dataclasses.replace(Identity.create(key_file), path=None)  # nothing kept beside it
            else:
                kept = Path(identity_path).is_file()
                identity = Identity.load_or_create(identity_path)
                key_file = identity.path
            kwargs["identity_path"] = str(key_file)
            # bootstrap peers can share one list of each other's addresses: each skips its own
            initial_peers = [m for m in initial_peers if not m.endswith(f"/p2p/{identity.peer_id}")]
            # a key made just now is nobody else's; a kept one is checked (two peers must not share it)
            if kept and initial_peers and await bootstrap.identity_taken(identity.peer_id, initial_peers):
                raise ConfigError(f"another running peer already uses the identity in {identity_path}")
        if announce_host is not None:
            port = port or free_port(host)  # libp2p announces explicit ports only
            kwargs["host_maddrs"] = [f"/ip4/{host}/tcp/{port}"]
            kwargs["announce_maddrs"] = [f"/{'ip6' if ':' in announce_host else 'ip4'}/{announce_host}/tcp/{port}"]
        try:
            p2p = await asyncio.wait_for(P2P.create(**kwargs), JOIN_TIMEOUT)
        except TimeoutError as exc:
            raise RouteError(f"the libp2p daemon did not start within {JOIN_TIMEOUT:.0f} s") from exc
        except LIBP2P_ERRORS as exc:
            raise RouteError(f"cannot join the swarm through {initial_peers}: {str(exc).splitlines()[0]}") from exc
        finally:
            if scratch is not None:
                scratch.cleanup()  # the daemon has read the key; this process holds it in memory
        try:
            reached, dialling = await bootstrap.reach(p2p, initial_peers)
        except RouteError:
            await p2p.shutdown()
            raise
        transport = cls(p2p, identity, announce_host, initial_peers, secret, relays)
        transport.reached = reached
        for task in dialling:
            transport._spawn(task)
        if relays is not None:
            await transport.add_handler(CALL_BACK, transport._call_back)
        return transport

    @property
    def relayed(self) -> bool:
        return self.relays is not None

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def listen(self, host: str, port: int = 0) -> list[str]:
        """Accept direct TLS connections on host:port (0: any free port); returns the addresses to announce."""
        if self.identity is None:
            raise RuntimeError("a client-mode node does not accept connections")
        self._server_tls = self.identity.server_context()
        # Connections are accepted here, not by asyncio's server: each is counted against the caps
        # before its TLS handshake starts, and nothing is read from a refused one.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        dualstack = host == "::" and socket.has_dualstack_ipv6()
        self._listener = socket.create_server((host, port), family=family, backlog=1024, dualstack_ipv6=dualstack)
        self._listener.setblocking(False)
        self._spawn(self._accept_loop(self._listener))
        bound = self._listener.getsockname()[1]
        self.data_addrs = await self._announced_addrs(host, bound)
        return self.data_addrs

    async def _announced_addrs(self, host: str, port: int) -> list[str]:
        wide = host in ANY and self.announce_host is None  # the daemon knows this host's addresses
        visible = [str(m) for m in await self.p2p.get_visible_maddrs()] if wide else []
        return announced(host, port, self.announce_host, visible)

    async def add_handler(self, protocol: str, handler: Handler) -> None:
        self._handlers[protocol] = handler

        async def via_libp2p(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = info.peer_id.to_base58()
            # identities cost nothing: a stream counts against the address it came from, as a
            # direct connection from there does, and its peer id only splits that address's share
            source = source_of_maddr(str(info.addr))
            if not self.caps.admit(source):
                writer.close()
                self._log_refusal(source)
                return
            counted = self._counted(source, peer)
            try:
                if self.secret is None or await self._proven(reader, protocol, source):
                    await handler(reader, writer, Source(source, client=f"peer:{peer}", peer=peer))
                else:
                    writer.close()
            finally:
                self.caps.release(counted)

        await self.p2p.add_binary_stream_handler(protocol, via_libp2p)

    async def _proven(self, reader: asyncio.StreamReader, protocol: str, source: str) -> bool:
        """Whether a libp2p stream's first frame proves the swarm secret (a direct connection's
        hello does it in `_hello`)."""
        try:
            header, _ = await asyncio.wait_for(read_frame(reader, HELLO_LIMITS), HELLO_TIMEOUT)
            proof = wire.decode_as(Hello, header).secret
        except (TimeoutError, EOFError, FrameError, OSError, wire.WireError):
            proof = None
        return self.secret.admits(proof, self.peer_id, protocol, source)

    async def remove_handler(self, protocol: str) -> None:
        self._handlers.pop(protocol, None)
        await self.p2p.remove_binary_stream_handler(protocol)

    def _log_refusal(self, source: str) -> None:
        """One log line per interval, however many streams the caps refuse."""
        self._refused += 1
        now = time.monotonic()
        if now >= self._next_refusal_log:
            log.info(
                "refused %d connections over the caps (%d per source, %d in all; latest from %s)",
                self._refused, self.caps.per_source, self.caps.total, source,
            )
            self._refused, self._next_refusal_log = 0, now + REFUSAL_LOG_INTERVAL

    async def redial(self, peer_ids: list[str], wait: float) -> None:
        """Dial those of these peers that are initial peers again, waiting at most `wait` seconds;
        a dial still under way (a silent peer's) goes on in the background."""
        wanted = set(peer_ids)
        dials = [asyncio.ensure_future(bootstrap.dial(self.p2p, m)) for m in self.initial_peers if m.rsplit("/p2p/", 1)[-1] in wanted]
        if dials:
            await asyncio.wait(dials, timeout=wait)
        for task in dials:
            self._spawn(task)

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(listener)
            except OSError as exc:  # out of descriptors (EMFILE), or a connection reset while queued
                log.warning("accepting a direct connection failed: %s", exc)
                await asyncio.sleep(1.0)
                continue
            source = source_of(addr)
            if self.caps.admit(source):
                self._spawn(self._serve_direct(conn, source))
            else:
                conn.close()
                self._log_refusal(source)

    async def _serve_direct(self, conn: socket.socket, source: str) -> None:
        """TLS, the hello, then the protocol's handler, which owns the stream; the connection counts
        against the caps until the handler returns."""
        counted = source
        try:
            stream = await self._hello(conn, source)
            if stream is not None:
                handler, proven, reader, writer = stream
                counted = self._counted(source, proven.peer)
                await handler(reader, writer, proven)
        finally:
            self.caps.release(counted)

    def _counted(self, source: str, peer: str | None) -> str:
        """What an admitted stream counts against: a listed peer's streams relay many clients'
        sessions, so they count against that peer instead of its address's cap."""
        if peer is None or not self.listed(peer):
            return source
        relay = f"relay:{peer}"
        self.caps.transfer(source, relay)
        return relay

    async def _hello(self, conn: socket.socket, source: str) -> tuple[Handler, Source, asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The handshake and hello within HELLO_TIMEOUT, the handler the hello names and the source
        with the client and peer it proves; None (the connection closed) when any of them fails."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=STREAM_LIMIT)
        protocol = asyncio.StreamReaderProtocol(reader)
        writer = None

        async def handshake_and_hello() -> Hello:
            nonlocal writer
            tls, _ = await loop.connect_accepted_socket(
                lambda: protocol, conn, ssl=self._server_tls, ssl_handshake_timeout=HELLO_TIMEOUT
            )  # on failure, closes the socket it took
            writer = asyncio.StreamWriter(tls, protocol, reader, loop)
            header, _ = await read_frame(reader, HELLO_LIMITS)
            return wire.decode_as(Hello, header)

        try:
            hello = await asyncio.wait_for(handshake_and_hello(), HELLO_TIMEOUT)
            # in a private swarm, a stream without the secret learns nothing, not even which protocols exist
            secret = self.secret
            if secret is not None and not secret.admits(hello.secret, self.peer_id, hello.protocol, source):
                raise ProofError("no proof of the swarm secret")
            handler = self._handlers.get(hello.protocol)
            proven = Source(source, client_of(hello.client, self.peer_id), peer_of(hello.peer, self.peer_id))
            if handler is None:
                await write_frame(writer, {"kind": "error", "message": f"no handler for protocol {hello.protocol[:60]!r}"})
        except (TimeoutError, EOFError, FrameError, OSError, ProofError, wire.WireError) as exc:  # OSError: TLS, sockets
            log.debug("dropped a direct connection before its hello: %r", exc)
            handler = None
        if handler is None:
            if writer is not None:
                writer.close()
            return None
        return handler, proven, reader, writer

    async def open(self, peer_id: str, data_addrs: list[str], protocol: str, timeout: float = 15.0) -> Stream:
        """A stream to `protocol` on `peer_id`: direct when one of its first MAX_DIALED addresses
        answers as that peer within DIRECT_TIMEOUT, else through libp2p within `timeout`.
        PeerUnreachable, naming the peer, when neither path opens."""
        missed = ""  # why the direct path failed, said once the libp2p one is known to work
        if data_addrs and self._direct_failed.get(peer_id, 0.0) < time.monotonic():
            addrs = data_addrs[:MAX_DIALED]
            try:
                return await asyncio.wait_for(self._dial(peer_id, addrs, protocol), min(timeout, DIRECT_TIMEOUT))
            except DIRECT_ERRORS as exc:
                missed = f"no direct connection at {', '.join(addrs)} ({exc!r})"
            self._direct_failed = {p: t for p, t in self._direct_failed.items() if t > time.monotonic()}
            self._direct_failed[peer_id] = time.monotonic() + DIRECT_RETRY
        try:
            stream = await asyncio.wait_for(self._open_libp2p(peer_id, protocol), timeout)
        except LIBP2P_ERRORS as exc:
            why = f"{missed}; over libp2p: {exc!r}" if missed else repr(exc)
            raise PeerUnreachable(f"peer {peer_id} unreachable: {why}", peer_id) from exc
        if missed:
            log.info("reached %s over libp2p: %s", peer_id, missed)
        return stream

    async def _open_libp2p(self, peer_id: str, protocol: str) -> Stream:
        circuits = self.circuit_book.get(peer_id)
        if circuits:  # a relayed peer: sessions need its direct call back (net/circuits.py)
            await self.call_backs.reach(self.p2p, peer_id, circuits, lambda: self._libp2p_stream(peer_id, CALL_BACK))
        return await self._libp2p_stream(peer_id, protocol)

    async def _libp2p_stream(self, peer_id: str, protocol: str) -> Stream:
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol)
        if self.secret is not None:  # libp2p names the protocol; the secret needs a frame of its own
            writer.writelines(encode(wire.encode(Hello(secret=self.secret.proof(peer_id, protocol)))))
        return reader, writer

    async def _call_back(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: Source) -> None:
        """A dialler reached this relayed node through a relay and asks for a direct connection."""
        writer.close()
        if source.peer is not None:
            await call_back(self.p2p, source.peer)

    async def _dial(self, peer_id: str, addrs: list[str], protocol: str) -> Stream:
        """The first of `addrs`, dialed at once, to prove itself `peer_id`; the others are closed."""
        dials = [asyncio.ensure_future(self.open_direct(peer_id, addr, protocol)) for addr in addrs]
        winner: Stream | None = None
        try:
            errors: list[Exception] = []
            for dial in asyncio.as_completed(dials):
                try:
                    winner = await dial
                    return winner
                except (OSError, ValueError, ProofError) as exc:
                    errors.append(exc)
            raise errors[-1]
        finally:
            for dial in dials:
                dial.cancel()
            await asyncio.wait(dials)
            for dial in dials:
                if not dial.cancelled() and dial.exception() is None and dial.result() is not winner:
                    dial.result()[1].close()

    async def open_direct(self, peer_id: str, addr: str, protocol: str) -> Stream:
        host, port = split_addr(addr)
        reader, writer = await asyncio.open_connection(host, port, ssl=self._client_tls, limit=STREAM_LIMIT)
        try:
            verify_peer(writer.get_extra_info("ssl_object").getpeercert(binary_form=True), peer_id)
        except BaseException:
            writer.close()
            raise
        hello = Hello(
            protocol, self.client_key.proof(peer_id),
            None if self._peer_proofs is None else self._peer_proofs.proof(peer_id),
            None if self.secret is None else self.secret.proof(peer_id, protocol),
        )
        writer.writelines(encode(wire.encode(hello)))
        return reader, writer

    async def shutdown(self) -> None:
        for task in list(self._serving):
            task.cancel()
        if self._listener is not None:
            self._listener.close()
        await self.p2p.shutdown()

