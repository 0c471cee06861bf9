"""Observe a peer's real speed from this client: a short one-hop session of one-token steps.

This is the client's own measurement, network included, so it can be compared with what the
peer advertises; routing trusts it over the advertisement.
"""

from __future__ import annotations

import time

import torch

from p2pfusion.client.health import PeerHealth
from p2pfusion.client.session import InferenceSession
from p2pfusion.dht.records import PeerRecord
from p2pfusion.dht.swarm import SwarmNode

PROBE_STEPS = 4


async def observe_peer(
    swarm: SwarmNode, record: PeerRecord, hidden_size: int, health: PeerHealth, dtype: torch.dtype = torch.float32
) -> float:
    """Time one-token steps through `record`'s layers; update `health` and return its layer-rate."""
    session = await InferenceSession(swarm.transport, [record], PROBE_STEPS + 1).open()
    try:
        await session.step(torch.randn(1, 1, hidden_size, dtype=dtype))
        t0 = time.perf_counter()
        for _ in range(PROBE_STEPS):
            await session.step(torch.randn(1, 1, hidden_size, dtype=dtype))
        seconds = (time.perf_counter() - t0) / PROBE_STEPS
    finally:
        await session.close()
    health.observe(record.peer_id, record.span, seconds)
    return record.span / seconds
