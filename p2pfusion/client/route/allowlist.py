"""Routing only through peers the user trusts (`--trusted-peers FILE`), tested without a network.

A trusted-peers file lists one peer per line, as its peer id or as a multiaddr ending in
`/p2p/<peer id>`; blank lines and `#` comments are ignored. With such a list, a client reads the
model's records only through `trusted_records`: its routes, failovers and verification checks
see no other peer, so a session's inputs never reach one. Layers the trusted peers do not serve
are an error at once, never a reason to wait for, or fall back to, other peers.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

from hivemind.p2p import PeerID

from p2pfusion.client.route.planner import format_ranges, missing_layers
from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.errors import RequestError, RouteError
from p2pfusion.net.identity import SHA2_256

IDENTITY = 0x00  # the multihash of a public key short enough to be inlined (SHA2_256 otherwise)
MAX_INLINE_KEY = 42  # libp2p inlines public keys up to this many bytes (ed25519's are 36)
MAX_FILE_BYTES = 1 << 20

# the option: a trusted-peers file's path, peer ids (or multiaddrs naming them), or None for any peer
TrustedPeers = str | os.PathLike | Collection[str] | None


class TrustedGap(RouteError):
    """The trusted peers leave layers unserved, and no trusted peer is on its way to serve them."""


def parse_peer_id(text: str) -> str:
    """The peer id that `text` (a peer id, or a multiaddr ending in /p2p/<peer id>) names; a
    ValueError saying what is wrong otherwise."""
    if text.startswith("/"):
        _, sep, text = text.rpartition("/p2p/")
        if not sep or not text or "/" in text:
            raise ValueError("a multiaddr here must end in /p2p/<peer id>")
    try:
        raw = PeerID.from_base58(text).to_bytes()
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a peer id (not base58: {exc})") from exc
    code, length = (raw[0], raw[1]) if len(raw) >= 2 else (None, 0)
    if (code, length) != (SHA2_256, 32) and not (code == IDENTITY and 0 < length <= MAX_INLINE_KEY):
        raise ValueError(f"{text!r} is not a libp2p peer id (not a multihash of a public key)")
    if len(raw) != length + 2:
        raise ValueError(f"{text!r} is not a libp2p peer id (its multihash is {len(raw) - 2} bytes, not {length})")
    return text


def parse_trusted(text: str, where: str) -> frozenset[str]:
    """The peer ids of a trusted-peers file's `text` (`where` names the file in errors)."""
    peers = set()
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            peers.add(parse_peer_id(entry))
        except ValueError as exc:
            raise RequestError(f"{where}, line {number}: {exc}") from None
    if not peers:
        raise RequestError(f"{where} lists no peer: routing only through trusted peers needs at least one")
    return frozenset(peers)


def read_trusted(path: str | os.PathLike) -> frozenset[str]:
    """The peer ids a trusted-peers file lists; a RequestError for a missing or unreadable file,
    a bad line (named by its number) or a list of none."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise RequestError(f"cannot read the trusted peers file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise RequestError(f"the trusted peers file {path} is over {MAX_FILE_BYTES >> 20} MiB")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise RequestError(f"the trusted peers file {path} is not UTF-8 text") from None
    return parse_trusted(text, f"trusted peers file {path}")


def trusted_peers(peers: TrustedPeers) -> frozenset[str] | None:
    """The option as the client keeps it: None (route through any peer), or the peer ids of a
    file's path (a str or Path) or of a collection of peer ids or multiaddrs."""
    if peers is None:
        return None
    if isinstance(peers, (str, os.PathLike)):
        trusted = read_trusted(Path(peers))
    elif isinstance(peers, Collection) and all(isinstance(p, str) for p in peers):
        trusted = parse_trusted("\n".join(p.replace("\n", " ") for p in peers), "trusted peers")
    else:
        raise RequestError("trusted_peers is a path to a trusted-peers file or a collection of peer ids")
    return trusted


def trusted_records(
    records: list[PeerRecord], trusted: Collection[str], num_layers: int, model: str,
    down: Collection[str] = (), first: int = 0,
) -> list[PeerRecord]:
    """The records of trusted peers, or a TrustedGap naming the layers from `first` on that no
    trusted peer serves: none online or a backup but those `down` (peers this client banned or
    distrusts), and none joining. Layers a joining trusted peer is loading are left for routing
    to wait for; a trusted peer that failed this client counts as gone."""
    kept = [r for r in records if r.peer_id in trusted]
    serving = [r for r in kept if r.state in (PeerState.ONLINE, PeerState.BACKUP) and r.peer_id not in down]
    coming = [r for r in kept if r.state == PeerState.JOINING]
    gaps = [(max(a, first), b) for a, b in missing_layers(serving + coming, num_layers) if b > first]
    if not gaps:
        return kept
    failed = sorted({r.peer_id for r in kept if r.peer_id in down and any(r.start < b and a < r.end for a, b in gaps)})
    why = f" (trusted peers of them failed or were caught: {', '.join(failed)})" if failed else ""
    raise TrustedGap(
        f"the trusted peers do not serve layers {format_ranges(gaps)} of {model}{why}; "
        "p2pfusion never routes through other peers when --trusted-peers is given"
    )
