"""A peer's ports, kept beside its identity file (`run-peer --identity PATH`, in `PATH.ports`), so
that a restarted peer listens where it did and the multiaddr others were given still reaches it.
A port named on the command line wins; a kept port taken by something else is given up, with a
warning, for a free one."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def ports_file(identity: str) -> Path:
    return Path(identity + ".ports")


def kept_ports(identity: str | None, port: int, data_port: int) -> tuple[int, int]:
    """The ports to listen on: those asked for (0: any), else those the identity's last run used."""
    if identity is None or (port and data_port):
        return port, data_port
    try:
        kept = json.loads(ports_file(identity).read_text())
        last = int(kept["port"]), int(kept["data_port"])
    except (OSError, ValueError, KeyError, TypeError):  # no earlier run, or a file that is not ours
        return port, data_port
    if not all(0 < p < 65536 for p in last):
        return port, data_port
    return port or last[0], data_port or last[1]


def keep_ports(identity: str | None, port: int, data_port: int) -> None:
    if identity is None:
        return
    path = ports_file(identity)
    try:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"port": port, "data_port": data_port}) + "\n")
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot keep this peer's ports in %s (%s): a restart will listen on new ones", path, exc)


def listening_ports(maddrs: list[str], data_addrs: list[str]) -> tuple[int, int] | None:
    """The libp2p and direct ports a started node listens on, from its addresses."""
    tcp = [m.split("/tcp/", 1)[1].split("/", 1)[0] for m in maddrs if "/tcp/" in m]
    if not tcp or not data_addrs:
        return None
    return int(tcp[0]), int(data_addrs[0].rsplit(":", 1)[1])
