"""host:port addresses of the direct (TLS) plane: reading and writing them, a free port, and the
addresses a listener announces."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence

ANY = ("0.0.0.0", "::")


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def join_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not a host:port address: {addr!r}")
    return host.strip("[]"), int(port)


def announced(host: str, port: int, announce_host: str | None, visible_maddrs: Sequence[str]) -> list[str]:
    """What a listener on host:port announces: `announce_host` when given, else `host`, else (on
    every interface) the IPs of the libp2p daemon's `visible_maddrs`, loopback last: from another
    host it reaches the wrong machine (and fails its identity check)."""
    if announce_host is not None:
        return [join_addr(announce_host, port)]
    if host not in ANY:
        return [join_addr(host, port)]
    ips = []
    for maddr in visible_maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6") and parts[2] not in ips and parts[2] not in ANY:
            ips.append(parts[2])
    ips.sort(key=lambda ip: ipaddress.ip_address(ip).is_loopback)
    return [join_addr(ip, port) for ip in ips]
