"""Probe a peer over our own transport: is it reachable, and how fast is the link to it?

Every peer answers PROTOCOL by echoing each frame back. A small frame measures the round trip;
a large one measures throughput. There is no speed-test server: peers measure each other, over
the same path (direct TLS, or libp2p) that hidden states would take.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from contextlib import asynccontextmanager

import torch

from p2pfusion.errors import PeerFailed, PeerUnreachable, RequestError
from p2pfusion.net.clients import Source
from p2pfusion.net.compression import LinkSpeed
from p2pfusion.net.framing import FrameLimits, read_frame, write_frame
from p2pfusion.net.silence import ask_all
from p2pfusion.net.transport import Transport

PROTOCOL = "p2pfusion.probe.v1"
MAX_ECHO_BYTES = 16 << 20  # a probe never makes a peer echo more than this
PROBE_LIMITS = FrameLimits(header=4 << 10, body=MAX_ECHO_BYTES, decoded=MAX_ECHO_BYTES)
PROBE_IDLE = 10.0  # a probe's frames come back to back; a stream quiet this long is dropped


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: Source) -> None:
    """Answer each frame with itself, until the stream ends; one-way streams ask for no answer.
    A probe that sends garbage, too much or nothing just loses its stream."""
    try:
        while True:
            header, tensor = await asyncio.wait_for(read_frame(reader, PROBE_LIMITS), PROBE_IDLE)
            if header.get("echo", True):
                await write_frame(writer, header, tensor)
    except (EOFError, RequestError, TimeoutError, OSError):
        return
    finally:
        writer.close()


async def serve_probes(transport: Transport) -> None:
    await transport.add_handler(PROTOCOL, echo)


@asynccontextmanager
async def _stream(transport: Transport, peer_id: str, data_addrs: list[str]):
    reader, writer = await transport.open(peer_id, data_addrs, PROTOCOL)
    try:
        yield reader, writer
    finally:
        writer.close()


async def _round_trips(reader, writer, tensor: torch.Tensor | None, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        await write_frame(writer, {"probe": 1}, tensor)
        await read_frame(reader, PROBE_LIMITS)  # a hostile peer's answer costs no more than a probe
        best = min(best, time.perf_counter() - t0)
    return best


async def _rtt(transport: Transport, peer_id: str, data_addrs: list[str]) -> float:
    async with _stream(transport, peer_id, data_addrs) as (reader, writer):
        return await _round_trips(reader, writer, None, rounds=1)


async def echo_time(transport: Transport, peer_id: str, data_addrs: list[str], timeout: float = 3.0) -> tuple[str | None, float]:
    """(None, the echo's round trip, its stream's setup excluded) when the peer echoes within
    `timeout`; else (why not, in a few words, inf)."""
    try:
        return None, await asyncio.wait_for(_rtt(transport, peer_id, data_addrs), timeout)
    except TimeoutError:
        return f"no echo within {timeout:g} s", math.inf
    except PeerUnreachable:
        return "no connection opens to it, directly or through libp2p", math.inf
    except (PeerFailed, RequestError, EOFError, OSError) as exc:
        return f"its echo failed: {str(exc)[:80] or type(exc).__name__}", math.inf


async def silent_peers(
    transport: Transport, peers: Mapping[str, list[str]], timeout: float, rtts: dict[str, float],
    unknown_like_first: bool = False,
) -> dict[str, str]:
    """Of `peers` (peer id -> data addresses), all asked at once, those that do not echo, and why.
    Once one has echoed, a silent one is given up after a few of its earlier round trips
    (net/silence.py): a frozen peer keeps its connections open and would cost the whole timeout.
    `rtts` holds the round trips of earlier echoes, and takes this round's."""
    calls = {peer_id: echo_time(transport, peer_id, addrs, timeout) for peer_id, addrs in peers.items()}
    answers = await ask_all(calls, rtts, timeout, lambda answer: answer[0] is None, unknown_like_first)
    echoed = any(answer is not None and answer[0] is None for answer in answers.values())
    silent = {}
    for peer_id, answer in answers.items():
        if answer is None:  # given up: early only once another echoed, if its round trip was known
            early = echoed and (unknown_like_first or peer_id in rtts)
            silent[peer_id] = "no echo while other peers echoed at once" if early else f"no echo within {timeout:g} s"
        elif answer[0] is not None:
            silent[peer_id] = answer[0]
        else:
            rtts.pop(peer_id, None)  # the latest last: a caller trims the oldest
            rtts[peer_id] = answer[1]
    return silent


async def reachable(transport: Transport, peer_id: str, data_addrs: list[str], timeout: float = 3.0) -> bool:
    return (await echo_time(transport, peer_id, data_addrs, timeout))[0] is None


async def _measure(transport: Transport, peer_id: str, data_addrs: list[str], payload_bytes: int) -> LinkSpeed:
    async with _stream(transport, peer_id, data_addrs) as (reader, writer):
        rtt = await _round_trips(reader, writer, None, rounds=5)
        # zeros Python makes: torch would fill them on several threads, and the event loop's thread
        # must not start an OpenMP pool of its own (models/threads.py)
        payload = torch.frombuffer(bytearray(payload_bytes - payload_bytes % 4), dtype=torch.float32)
        seconds = await _round_trips(reader, writer, payload, rounds=2)
    return LinkSpeed(rtt=rtt, bytes_per_second=2 * payload_bytes / max(seconds - rtt, 1e-9))


async def measure_link(
    transport: Transport, peer_id: str, data_addrs: list[str], payload_bytes: int = 1 << 20, timeout: float = 10.0
) -> LinkSpeed:
    """Best of a few round trips, so a busy moment does not pass for the link's speed."""
    return await asyncio.wait_for(_measure(transport, peer_id, data_addrs, payload_bytes), timeout)
