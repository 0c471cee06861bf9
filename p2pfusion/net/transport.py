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
import ipaddress
import logging
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from hivemind.p2p import P2P, PeerID

from p2pfusion.errors import RouteError
from p2pfusion.net.framing import FrameError, encode, read_frame, write_frame
from p2pfusion.net.identity import Identity, client_context, verify_peer

log = logging.getLogger(__name__)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]

JOIN_TIMEOUT = 20.0
DIRECT_TIMEOUT = 3.0  # a direct dial slower than this is treated as unreachable
DIRECT_RETRY = 60.0  # after a failed direct dial, use libp2p to that peer for this long
# Large enough that a 128-token hidden state arrives without pausing the socket half-way.
STREAM_LIMIT = 8 << 20


class Transport:
    """This node's libp2p host plus, on peers, a direct TLS listener."""

    def __init__(
        self, p2p: P2P, identity: Identity | None, announce_host: str | None = None, initial_peers: Sequence[str] = ()
    ):
        self.p2p = p2p
        self.identity = identity
        self.data_addrs: list[str] = []
        self._handlers: dict[str, Handler] = {}
        self._server: asyncio.Server | None = None
        self._client_tls = client_context()
        self._direct_failed: dict[str, float] = {}
        self.announce_host = announce_host
        self.initial_peers = list(initial_peers)  # those it joined through (never itself)

    @classmethod
    async def start(
        cls,
        initial_peers: list[str],
        host: str,
        port: int,
        identity_path: str | None,
        client_mode: bool,
        announce_host: str | None = None,
    ) -> Transport:
        """Start libp2p. A peer always gets an identity held here, so its TLS certificate can prove it.
        `announce_host` is the address others reach this host at, when it listens on 0.0.0.0 behind
        a forwarded port or has several interfaces."""
        kwargs = dict(host_maddrs=[f"/ip4/{host}/tcp/{port}"], initial_peers=initial_peers)
        identity, scratch = None, None
        if not client_mode:
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
            kwargs["initial_peers"] = initial_peers
            # a key made just now is nobody else's; a kept one is checked (two peers must not share it)
            kwargs["check_if_identity_free"] = kept
        if announce_host is not None:
            port = port or _free_port(host)  # libp2p announces explicit ports only
            kwargs["host_maddrs"] = [f"/ip4/{host}/tcp/{port}"]
            kwargs["announce_maddrs"] = [f"/{'ip6' if ':' in announce_host else 'ip4'}/{announce_host}/tcp/{port}"]
        try:
            p2p = await asyncio.wait_for(P2P.create(**kwargs), JOIN_TIMEOUT)
        except TimeoutError as exc:
            raise RouteError(f"cannot reach any initial peer within {JOIN_TIMEOUT:.0f} s: {initial_peers}") from exc
        except Exception as exc:  # the daemon reports bad addresses and dial failures as assorted errors
            if "already taken" in str(exc):
                raise RouteError(f"another running peer already uses the identity in {identity_path}") from exc
            if "bootstrap" in str(exc):
                raise RouteError(f"no initial peer is reachable: {', '.join(initial_peers)}") from exc
            raise RouteError(f"cannot join the swarm through {initial_peers}: {str(exc).splitlines()[0]}") from exc
        finally:
            if scratch is not None:
                scratch.cleanup()  # the daemon has read the key; this process holds it in memory
        return cls(p2p, identity, announce_host, initial_peers)

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def listen(self, host: str, port: int = 0) -> list[str]:
        """Accept direct TLS connections on host:port (0: any free port); returns the addresses to announce."""
        if self.identity is None:
            raise RouteError("a client-mode node does not accept connections")
        self._server = await asyncio.start_server(
            self._accept, host, port, ssl=self.identity.server_context(), limit=STREAM_LIMIT, ssl_handshake_timeout=10
        )
        bound = self._server.sockets[0].getsockname()[1]
        self.data_addrs = await self._announced_addrs(host, bound)
        return self.data_addrs

    async def _announced_addrs(self, host: str, port: int) -> list[str]:
        if self.announce_host is not None:
            return [_join_addr(self.announce_host, port)]
        if host not in ("0.0.0.0", "::"):
            return [_join_addr(host, port)]
        ips = []
        for maddr in await self.p2p.get_visible_maddrs():
            parts = str(maddr).split("/")
            if len(parts) > 2 and parts[1] in ("ip4", "ip6") and parts[2] not in ips and parts[2] not in ("0.0.0.0", "::"):
                ips.append(parts[2])
        # loopback last: from another host it reaches the wrong machine (and fails its identity check)
        ips.sort(key=lambda ip: ipaddress.ip_address(ip).is_loopback)
        return [_join_addr(ip, port) for ip in ips]

    async def add_handler(self, protocol: str, handler: Handler) -> None:
        self._handlers[protocol] = handler

        async def via_libp2p(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await handler(reader, writer)

        await self.p2p.add_binary_stream_handler(protocol, via_libp2p)

    async def remove_handler(self, protocol: str) -> None:
        self._handlers.pop(protocol, None)
        await self.p2p.remove_binary_stream_handler(protocol)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read the hello and hand the stream to its protocol's handler, which then owns it."""
        try:
            header, _ = await asyncio.wait_for(read_frame(reader), DIRECT_TIMEOUT)
            handler = self._handlers.get(header.get("protocol"))
            if handler is None:
                await write_frame(writer, {"kind": "error", "message": f"no handler for protocol {header.get('protocol')!r}"})
        except (TimeoutError, EOFError, FrameError, ConnectionError) as exc:
            log.debug("dropped a direct connection before its hello: %r", exc)
            handler = None
        if handler is None:
            writer.close()
            return
        await handler(reader, writer)

    async def open(self, peer_id: str, data_addrs: list[str], protocol: str, timeout: float = 15.0) -> Stream:
        """A stream to `protocol` on `peer_id`: direct when it answers there, else through libp2p."""
        if data_addrs and self._direct_failed.get(peer_id, 0.0) < time.monotonic():
            for addr in data_addrs:
                try:
                    return await asyncio.wait_for(self._open_direct(peer_id, addr, protocol), min(timeout, DIRECT_TIMEOUT))
                except (OSError, TimeoutError, ValueError, RouteError) as exc:
                    log.info("no direct connection to %s at %s (%r); using libp2p", peer_id, addr, exc)
            self._direct_failed[peer_id] = time.monotonic() + DIRECT_RETRY
        _, reader, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol), timeout
        )
        return reader, writer

    async def _open_direct(self, peer_id: str, addr: str, protocol: str) -> Stream:
        host, port = _split_addr(addr)
        reader, writer = await asyncio.open_connection(host, port, ssl=self._client_tls, limit=STREAM_LIMIT)
        try:
            verify_peer(writer.get_extra_info("ssl_object").getpeercert(binary_form=True), peer_id)
        except BaseException:
            writer.close()
            raise
        writer.writelines(encode({"protocol": protocol}))
        return reader, writer

    async def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self.p2p.shutdown()


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _join_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not a host:port address: {addr!r}")
    return host.strip("[]"), int(port)
