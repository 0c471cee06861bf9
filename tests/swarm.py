"""Real peers on 127.0.0.1, in this process's event loop, for tests that need many swarms quickly."""

from __future__ import annotations

from contextlib import asynccontextmanager

from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import ModelSource
from p2pfusion.peer.runtime import Peer, PeerOptions


@asynccontextmanager
async def running_peers(source: ModelSource, ranges: list[tuple[int, int]]):
    """Start one peer per range (the first starts the swarm); yield (peers, bootstrap maddrs)."""
    peers: list[Peer] = []
    initial: list[str] = []
    try:
        for layers in ranges:
            swarm = await join_swarm(initial)
            peer = Peer(PeerOptions(source=source, initial_peers=initial, layers=layers), swarm)
            peers.append(peer)
            await peer.start()
            if not initial:
                initial = await swarm.maddrs()
        yield peers, initial
    finally:
        for peer in peers:
            await peer.leave()
            await peer.swarm.shutdown()
