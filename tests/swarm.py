"""Real peers on 127.0.0.1, in this process's event loop, for tests that need many swarms quickly."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager, contextmanager

from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.dht.records import PeerState
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import ModelSource
from p2pfusion.peer.runtime import Peer, PeerOptions


async def start_peer(source: ModelSource, initial: list[str], layers=None, **options) -> Peer:
    """A started peer; `throughput` defaults to a fixed figure so tests do not depend on the machine."""
    options.setdefault("throughput", "100")
    swarm = await join_swarm(initial, secret=options.get("swarm_secret"))
    peer = Peer(PeerOptions(source=source, initial_peers=initial, layers=layers, **options), swarm)
    await peer.start()
    return peer


async def stop_peer(peer: Peer) -> None:
    await peer.leave()
    await peer.swarm.shutdown()


@asynccontextmanager
async def running_peers(source: ModelSource, ranges: list[tuple[int, int]], refresh: bool = False, **options):
    """Start one peer per range (the first starts the swarm); yield (peers, bootstrap maddrs).
    `refresh`: the peers' records are announced again as run-peer's upkeep would, or they expire
    after 30 s (which a test on a busy machine may outlast)."""
    peers: list[Peer] = []
    initial: list[str] = []
    refresher = asyncio.create_task(_keep_announcing(peers)) if refresh else None
    try:
        for layers in ranges:
            peers.append(await start_peer(source, initial, layers, **options))
            if not initial:
                initial = await peers[0].swarm.maddrs()
        yield peers, initial
    finally:
        if refresher is not None:
            refresher.cancel()
        for peer in peers:
            await stop_peer(peer)


@contextmanager
def peers_in_background(source: ModelSource, ranges: list[tuple[int, int]], **options):
    """Like running_peers, on a loop of their own thread, for tests of the synchronous client API
    and module-wide swarms; yields (peers, bootstrap maddrs, the loop)."""
    loop = BackgroundLoop("test-peers")
    peers = running_peers(source, ranges, refresh=True, **options)
    try:
        started, maddrs = loop.run(peers.__aenter__())
        yield started, maddrs, loop
    finally:
        try:
            loop.run(peers.__aexit__(None, None, None))
        finally:
            loop.close()


async def _start(coro) -> asyncio.Task:
    return asyncio.create_task(coro)


async def _keep_announcing(peers: list[Peer]) -> None:
    """Every refresh period, each started peer announces its record again (the list may grow)."""
    while True:
        await asyncio.sleep(peers[0].options.refresh_period if peers else 1.0)
        for peer in list(peers):
            if peer.record is not None and peer.record.state != PeerState.OFFLINE:
                await peer.announce()


@contextmanager
def named_swarm(source: ModelSource, layout: list[tuple[str, tuple[int, int], dict]], name: str):
    """In-process peers named as in `layout` (name, layers, PeerOptions fields), kept announcing,
    and one client node the tests share: (loop, {name: peer}, client)."""
    loop = BackgroundLoop(name)
    peers, maddrs = {}, []

    async def start():
        for peer_name, layers, options in layout:
            peers[peer_name] = await start_peer(source, maddrs, layers, **options)
            maddrs[:] = maddrs or await peers[peer_name].swarm.maddrs()

    client = refresher = None
    try:
        loop.run(start())
        refresher = loop.run(_start(_keep_announcing(list(peers.values()))))
        client = loop.run(join_swarm(maddrs, client_mode=True))
        yield loop, peers, client
    finally:
        if refresher is not None:
            loop.loop.call_soon_threadsafe(refresher.cancel)
        if client is not None:
            loop.run(client.shutdown())
        for peer in peers.values():
            loop.run(stop_peer(peer))
        loop.close()
