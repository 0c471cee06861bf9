"""The swarm secret: what a node of a private swarm proves, on every stream it opens and every DHT
request and answer, before the other side serves it.

The libp2p daemon shipped with hivemind has no private-network option, so the secret is checked
here: a stream's hello carries an HMAC under a key derived from the secret, over the peer it dials,
the protocol, a time and a fresh nonce (a proof is worth nothing at another peer, for another
protocol, or later), and `dht/private.py` signs DHT requests and answers under another derived key.
The secret itself never leaves the file it was read from.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from p2pfusion.errors import ConfigError
from p2pfusion.net.wire import Length

log = logging.getLogger(__name__)

SECRET_BYTES = 32
NONCE_BYTES = 12
MAX_SKEW = 60.0  # seconds a proof's time may differ from ours: clocks of a swarm's machines drift
# nonces remembered while their proof could still be accepted; a holder of the secret could flood
# past it, and holders are trusted
MAX_NONCES = 1 << 17
REFUSAL_LOG_INTERVAL = 10.0
MAC_BYTES = 32  # HMAC-SHA256


@dataclass(frozen=True)
class SecretProof:
    """A hello's `secret` entry: an HMAC under the hello key, over the peer dialled, the protocol,
    the time `t` (milliseconds since the epoch) and a fresh nonce `n`."""

    t: int
    n: Annotated[bytes, Length(NONCE_BYTES, NONCE_BYTES)]
    mac: Annotated[bytes, Length(MAC_BYTES, MAC_BYTES)]


def create_secret_file(path: str | Path) -> Path:
    """A fresh secret in a new file (mode 0600), one line of hex; an existing file is never replaced."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} already exists: a swarm secret is never overwritten (pick another file)") from None
    except OSError as exc:
        raise ConfigError(f"cannot create {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w") as file:
        file.write(secrets.token_hex(SECRET_BYTES) + "\n")
    return path


def load_secret(value: str | Path | SwarmSecret | None) -> SwarmSecret | None:
    """The secret in the file `value` names (or `value` itself, already loaded); None: no secret."""
    if value is None or isinstance(value, SwarmSecret):
        return value
    return SwarmSecret.load(value)


class ReplayGuard:
    """Nonces of the proofs accepted lately, each kept while a replay of its proof would be in time."""

    def __init__(self, window: float = 2 * MAX_SKEW, limit: int = MAX_NONCES):
        self.window, self.limit = window, limit
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def fresh(self, nonce: bytes) -> bool:
        """True the first time a nonce comes within the window; it is then remembered."""
        now = time.monotonic()
        while self._seen and (len(self._seen) >= self.limit or next(iter(self._seen.values())) < now):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return False
        self._seen[nonce] = now + self.window
        return True


class SwarmSecret:
    """A private swarm's secret, as the keys derived from it."""

    def __init__(self, secret: bytes, source: str = "<memory>"):
        if len(secret) != SECRET_BYTES:
            raise ConfigError(f"a swarm secret is {SECRET_BYTES} bytes, got {len(secret)}")
        self.source = source
        self.hello_key = _derive(secret, b"hello")
        self.dht_key = _derive(secret, b"dht")
        self._nonces = ReplayGuard()
        self._refusals: dict[str, int] = {}  # refusals of each kind since its last log line
        self._next_log: dict[str, float] = {}

    @classmethod
    def load(cls, path: str | Path) -> SwarmSecret:
        """The secret in `path` (64 hex digits, as `p2pfusion swarm-secret` writes); warns when
        other users may read the file."""
        path = Path(path)
        try:
            text = path.read_text(encoding="ascii")
            mode = path.stat().st_mode
        except FileNotFoundError:
            hint = "`p2pfusion swarm-secret FILE` makes one"
            raise ConfigError(f"swarm secret file {path} does not exist ({hint})") from None
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not a text file of hex digits"
            raise ConfigError(f"cannot read swarm secret file {path}: {reason}") from None
        try:
            secret = bytes.fromhex(text.strip())
        except ValueError:
            secret = b""
        if len(secret) != SECRET_BYTES:
            raise ConfigError(
                f"swarm secret file {path} must hold {2 * SECRET_BYTES} hex digits on one line "
                "(`p2pfusion swarm-secret FILE` makes one)"
            )
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("swarm secret file %s may be read by other users (mode %o): chmod 600 it", path, mode & 0o777)
        return cls(secret, str(path))

    def proof(self, peer_id: str, protocol: str) -> SecretProof:
        """The hello's `secret` entry for a stream to `protocol` on `peer_id`."""
        when, nonce = int(time.time() * 1000), secrets.token_bytes(NONCE_BYTES)
        return SecretProof(when, nonce, self._mac(peer_id, protocol, when, nonce))

    def refusal(self, proof: SecretProof | None, peer_id: str, protocol: str) -> str | None:
        """Why a hello's `secret` entry does not prove the secret for a stream to `protocol` on
        `peer_id` (this node); None when it does."""
        if proof is None:
            return "no proof of the swarm secret"
        mac, when, nonce = proof.mac, proof.t, proof.n
        if not hmac.compare_digest(mac, self._mac(peer_id, protocol, when, nonce)):
            return "a wrong swarm secret"
        if abs(when / 1000 - time.time()) > MAX_SKEW:
            return "a stale proof of the swarm secret (or a clock more than a minute off)"
        if not self._nonces.fresh(nonce):
            return "a replayed proof of the swarm secret"
        return None

    def admits(self, proof: SecretProof | None, peer_id: str, protocol: str, source: str) -> bool:
        """Whether a hello proves the secret (refusals are logged, see `note_refusal`)."""
        reason = self.refusal(proof, peer_id, protocol)
        if reason is not None:
            self.note_refusal(f"streams with {reason}", f" (latest from {source})")
        return reason is None

    def note_refusal(self, what: str, detail: str = "") -> None:
        """Count a refusal; each kind is logged once per interval, with the count since its last line."""
        self._refusals[what] = self._refusals.get(what, 0) + 1
        now = time.monotonic()
        if now >= self._next_log.get(what, 0.0):
            log.info("refused %d %s%s", self._refusals[what], what, detail)
            self._refusals[what], self._next_log[what] = 0, now + REFUSAL_LOG_INTERVAL

    def _mac(self, peer_id: str, protocol: str, when: int, nonce: bytes) -> bytes:
        message = b"\0".join((peer_id.encode(), protocol.encode(), str(when).encode(), nonce))
        return hmac.digest(self.hello_key, message, "sha256")


def _derive(secret: bytes, purpose: bytes) -> bytes:
    """A key for one purpose: a proof made for one never passes for another."""
    return hmac.new(secret, b"p2pfusion swarm secret: " + purpose, hashlib.sha256).digest()
