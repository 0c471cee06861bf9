"""Can others reach this peer at the addresses it announces? A joining peer asks a neighbour to
dial each of them back, as libp2p's AutoNAT does, before it claims layers; alone, it dials them
itself, which proves less (its own host may reach what others cannot).

A libp2p address passes when a TCP connection to it opens; a direct (TLS) address, when the peer
behind it proves the asker's peer id. An address passes if any neighbour asked reached it, so one
lying neighbour cannot talk a peer out of serving: after a neighbour that reached not all, the next
one is asked too. A neighbour dials for strangers, so it bounds what it does: MAX_ADDRESSES per
request, one request at a time per source address, and never an address more private than the
asker's own (a stranger on the internet cannot make it probe its loopback or LAN).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from p2pfusion.errors import PeerFailed, ProofError, RequestError
from p2pfusion.net import messages as m
from p2pfusion.net import probe
from p2pfusion.net.clients import Source
from p2pfusion.net.framing import FrameError, FrameLimits, read_frame, write_frame
from p2pfusion.net.addresses import split_addr
from p2pfusion.net.transport import Transport
from p2pfusion.net.wire import Length

log = logging.getLogger(__name__)

PROTOCOL = "p2pfusion.dialback.v1"
REACH_TIMEOUT = 3.0  # an address that takes longer to answer is not one clients will wait for
ASK_TIMEOUT = REACH_TIMEOUT + 5.0  # a neighbour's whole answer, its dials included
MAX_ADDRESSES = 8  # of each kind, per request: as many as a peer record lists
MAX_NEIGHBOURS = 3
MAX_ADDRESS = 256
MAX_REASON = 120
BY_NEIGHBOURS = "dialled back by "  # how a check by neighbours names its checkers
LIMITS = FrameLimits(header=16 << 10, body=0, tensor_kinds=frozenset())

Address = Annotated[str, Length(MAX_ADDRESS, 1)]


@dataclass(frozen=True)
class DialBack:
    """Dial these addresses of mine, and tell me which answered."""

    kind: ClassVar[str] = "dial_back"
    maddrs: Annotated[list[Address], Length(MAX_ADDRESSES)] = field(default_factory=list)  # libp2p's
    data_addrs: Annotated[list[Address], Length(MAX_ADDRESSES)] = field(default_factory=list)  # host:port, direct TLS


@dataclass(frozen=True)
class Dialled:
    address: Address
    reached: bool
    reason: Annotated[str, Length(MAX_REASON)] = ""  # why not


@dataclass(frozen=True)
class DialledBack:
    """What a neighbour found; an address it did not dial (see `may_dial`) has no entry."""

    kind: ClassVar[str] = "dialled_back"
    results: Annotated[list[Dialled], Length(2 * MAX_ADDRESSES)] = field(default_factory=list)


MESSAGES = {cls.kind: cls for cls in (DialBack, DialledBack, m.Error)}


@dataclass(frozen=True)
class Reach:
    """The addresses to announce (those reached, and those no one could check), those to leave out
    with the reason, how they were checked, and whether any was reached (not merely unchecked)."""

    maddrs: list[str]
    data_addrs: list[str]
    unreachable: list[Dialled]
    checker: str
    reached_any: bool = True


def tcp_target(maddr: str) -> tuple[str, int] | None:
    """The host and port a plain TCP multiaddr dials; None for others (relayed, DNS, QUIC): not checked."""
    parts = maddr.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or "p2p-circuit" in parts:
        return None
    if not parts[4].isdigit():
        return None
    return parts[2], int(parts[4])


def _scope(ip: str) -> int:
    """0 loopback, 1 private or link-local, 2 public: how far from the host an address reaches."""
    try:
        address = ipaddress.ip_address(ip.split("/")[0])
    except ValueError:
        return 2
    if address.is_loopback:
        return 0
    return 1 if address.is_private or address.is_link_local else 2


def may_dial(target_host: str, source: str) -> bool:
    """Whether a neighbour dials `target_host` for an asker seen at `source` ("ip:ADDRESS", or a
    relay's bucket): only as far from itself as the asker is, so a stranger from the internet never
    makes it dial its own loopback or LAN."""
    asker = source.removeprefix("ip:") if source.startswith("ip:") else ""
    return _scope(target_host) >= (_scope(asker) if asker and asker != "unknown" else 2)


def verdict(maddrs: Sequence[str], data_addrs: Sequence[str], answers: Sequence[Sequence[Dialled]], checker: str) -> Reach:
    """Announce an address unless some checker dialled it and none reached it."""
    reached = {d.address for answer in answers for d in answer if d.reached}
    failed: dict[str, Dialled] = {}
    for answer in answers:
        for d in answer:
            if not d.reached and d.address not in reached:
                failed.setdefault(d.address, d)
    return Reach(
        [a for a in maddrs if a not in failed], [a for a in data_addrs if a not in failed], list(failed.values()), checker,
        bool(reached),
    )


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {REACH_TIMEOUT:.0f} s"
    if isinstance(exc, ProofError):
        return "another host answers there, not this peer"
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno).lower()
    return str(exc)[:MAX_REASON] or type(exc).__name__


async def _tcp(host: str, port: int) -> None:
    _, writer = await asyncio.open_connection(host, port)
    writer.close()


async def _direct(transport: Transport, peer_id: str, addr: str) -> None:
    _, writer = await transport.open_direct(peer_id, addr, probe.PROTOCOL)
    writer.close()


async def _try(address: str, dial) -> Dialled:
    try:
        await asyncio.wait_for(dial, REACH_TIMEOUT)
    except (OSError, TimeoutError, ValueError, ProofError) as exc:
        return Dialled(address, False, _why(exc)[:MAX_REASON])
    return Dialled(address, True)


async def dial(
    transport: Transport, peer_id: str, maddrs: Sequence[str], data_addrs: Sequence[str], source: str | None = None
) -> list[Dialled]:
    """Dial each address at once. `source`: the asker's, for `may_dial` (None: this host's own)."""
    tries = []
    for maddr in maddrs[:MAX_ADDRESSES]:
        target = tcp_target(maddr)
        if target is not None and (source is None or may_dial(target[0], source)):
            tries.append(_try(maddr, _tcp(*target)))
    for addr in data_addrs[:MAX_ADDRESSES]:
        try:
            host, _ = split_addr(addr)
        except ValueError:
            continue
        if source is None or may_dial(host, source):
            tries.append(_try(addr, _direct(transport, peer_id, addr)))
    return list(await asyncio.gather(*tries))


class DialBackService:
    """Dials back for peers that ask; one request at a time per source address."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._busy: set[str] = set()

    async def start(self) -> None:
        await self.transport.add_handler(PROTOCOL, self.handle)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: Source) -> None:
        try:
            header, _ = await asyncio.wait_for(read_frame(reader, LIMITS), REACH_TIMEOUT)
            request = m.from_header(header, MESSAGES)
            if not isinstance(request, DialBack):
                raise RequestError(f"expected {DialBack.kind}, got {request.kind}")
            if source.peer is None:
                raise RequestError("only a peer that proves its id is dialled back")
            if source.address in self._busy:
                raise RequestError("a dial-back for this address is under way")
            self._busy.add(source.address)
            try:
                results = await dial(self.transport, source.peer, request.maddrs, request.data_addrs, source.address)
            finally:
                self._busy.discard(source.address)
            await write_frame(writer, m.to_header(DialledBack(results)))
        except RequestError as exc:
            await _send_error(writer, str(exc))
        except (EOFError, FrameError, OSError, TimeoutError):
            pass
        finally:
            writer.close()


async def _send_error(writer: asyncio.StreamWriter, message: str) -> None:
    try:
        await write_frame(writer, m.to_header(m.Error(message)))
    except OSError:
        pass


async def ask(transport: Transport, neighbour: str, addrs: list[str], maddrs: Sequence[str], data_addrs: Sequence[str]) -> list[Dialled]:
    """A neighbour's dial-back of our addresses; PeerFailed when it cannot or will not."""
    reader, writer = await transport.open(neighbour, addrs, PROTOCOL, REACH_TIMEOUT)
    try:
        await write_frame(writer, m.to_header(DialBack(list(maddrs[:MAX_ADDRESSES]), list(data_addrs[:MAX_ADDRESSES]))))
        header, _ = await asyncio.wait_for(read_frame(reader, LIMITS), ASK_TIMEOUT)
        reply = m.from_header(header, MESSAGES)
    except (EOFError, FrameError, OSError, TimeoutError, RequestError) as exc:
        raise PeerFailed(f"{neighbour} did not dial back: {exc!r}", neighbour) from exc
    finally:
        writer.close()
    if not isinstance(reply, DialledBack):
        raise PeerFailed(f"{neighbour} would not dial back: {getattr(reply, 'message', reply.kind)}", neighbour)
    asked = set(maddrs) | set(data_addrs)
    return [d for d in reply.results if d.address in asked]


async def check(
    transport: Transport, neighbours: Sequence[tuple[str, list[str]]], maddrs: Sequence[str], data_addrs: Sequence[str],
) -> Reach:
    """Which of our addresses others reach: asked of up to MAX_NEIGHBOURS `(peer id, data addrs)`
    until one reaches them all, or, when none answers, dialled from this host."""
    answers, checkers = [], []
    for neighbour, addrs in list(neighbours)[:MAX_NEIGHBOURS]:
        try:
            answer = await ask(transport, neighbour, addrs, maddrs, data_addrs)
        except (PeerFailed, OSError, TimeoutError) as exc:  # PeerUnreachable is a PeerFailed
            log.debug("dial-back through %s failed: %s", neighbour, exc)
            continue
        answers.append(answer)
        checkers.append(f"peer {neighbour}")
        if all(d.reached for d in answer):
            break
    if answers:
        return verdict(maddrs, data_addrs, answers, BY_NEIGHBOURS + " and ".join(checkers))
    alone = "no other peer is known" if not neighbours else "no neighbour answered"
    own = await dial(transport, transport.peer_id, maddrs, data_addrs)
    return verdict(maddrs, data_addrs, [own], f"dialled from this host, as {alone}")
