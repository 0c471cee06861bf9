"""Probe a peer over our own transport: is it reachable, and how fast is the link to it?

Every peer answers PROTOCOL by echoing each frame back. A small frame measures the round trip;
a large one measures throughput. There is no speed-test server: peers measure each other.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P, PeerID

from p2pfusion.net.framing import read_frame, write_frame

PROTOCOL = "p2pfusion.probe.v1"
MAX_ECHO_BYTES = 16 << 20  # a probe never makes a peer echo more than this


@dataclass(frozen=True)
class LinkSpeed:
    rtt: float  # seconds
    bytes_per_second: float


async def serve_probes(p2p: P2P) -> None:
    async def echo(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header, tensor = await read_frame(reader)
                if tensor is not None and tensor.numel() * tensor.element_size() > MAX_ECHO_BYTES:
                    return
                await write_frame(writer, header, tensor)
        except Exception:  # a probe that sends garbage just loses its stream
            return
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(PROTOCOL, echo)


async def reachable(p2p: P2P, peer_id: str, timeout: float = 3.0) -> bool:
    try:
        await asyncio.wait_for(_echo_once(p2p, peer_id, None), timeout)
        return True
    except Exception:
        return False


async def _echo_once(p2p: P2P, peer_id: str, tensor: torch.Tensor | None, rounds: int = 1) -> float:
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), PROTOCOL)
    try:
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            await write_frame(writer, {"probe": 1}, tensor)
            await read_frame(reader)
            best = min(best, time.perf_counter() - t0)
        return best
    finally:
        writer.close()


async def measure_link(p2p: P2P, peer_id: str, payload_bytes: int = 4 << 20, timeout: float = 10.0) -> LinkSpeed:
    """Best of a few round trips, so a busy moment does not pass for the link's speed."""
    rtt = await asyncio.wait_for(_echo_once(p2p, peer_id, None, rounds=5), timeout)
    payload = torch.zeros(payload_bytes // 4, dtype=torch.float32)
    seconds = await asyncio.wait_for(_echo_once(p2p, peer_id, payload, rounds=3), timeout)
    return LinkSpeed(rtt=rtt, bytes_per_second=2 * payload_bytes / max(seconds - rtt, 1e-9))
