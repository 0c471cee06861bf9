"""A peer's life: join the swarm, claim layers, load them, serve, announce, leave cleanly."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import torch

from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.dht.swarm import RECORD_TTL, SwarmNode, join_swarm
from p2pfusion.models.source import ModelSource
from p2pfusion.models.stage import load_config, load_stage
from p2pfusion.peer.claim import choose_layers
from p2pfusion.peer.server import StageServer

log = logging.getLogger(__name__)

PLACEHOLDER_THROUGHPUT = 1.0


@dataclass
class PeerOptions:
    source: ModelSource
    initial_peers: list[str]
    layers: tuple[int, int] | None = None
    max_layers: int | None = None
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 0
    identity: str | None = None
    address_file: Path | None = None
    max_length: int = 2048


class Peer:
    def __init__(self, options: PeerOptions, swarm: SwarmNode):
        self.options = options
        self.swarm = swarm
        self.server: StageServer | None = None
        self.record: PeerRecord | None = None

    async def _record(self, start: int, end: int, state: PeerState) -> PeerRecord:
        return PeerRecord(
            model=self.options.source.name,
            peer_id=self.swarm.peer_id,
            maddrs=await self.swarm.maddrs(),
            start=start,
            end=end,
            state=state,
            throughput=PLACEHOLDER_THROUGHPUT,
            device=self.options.device,
        )

    async def start(self) -> None:
        num_layers = load_config(self.options.source).num_hidden_layers
        if self.options.layers is not None:
            start, end = self.options.layers
        else:
            records = await self.swarm.lookup(self.options.source.name)
            start, end = choose_layers(records, num_layers, self.options.max_layers or num_layers)
        self.record = await self._record(start, end, PeerState.JOINING)
        await self.swarm.announce(self.record)
        log.info("loading layers %d:%d of %s", start, end, self.options.source.name)
        stage = await asyncio.to_thread(load_stage, self.options.source, start, end, torch.float32, self.options.device)
        self.server = StageServer(stage, self.swarm.p2p, self.options.max_length)
        await self.server.start()
        self.record = await self._record(start, end, PeerState.ONLINE)
        await self.swarm.announce(self.record)
        log.info("serving layers %d:%d as %s", start, end, self.swarm.peer_id)

    async def announce_forever(self) -> None:
        while True:
            await asyncio.sleep(RECORD_TTL / 3)
            try:
                await self.swarm.announce(self.record)
            except Exception:  # a failed refresh is retried on the next tick; the record has slack
                log.warning("could not refresh the DHT record", exc_info=True)

    async def leave(self) -> None:
        """Announce offline first, so clients route around this peer, then let sessions finish."""
        if self.record is not None:
            self.record = await self._record(self.record.start, self.record.end, PeerState.OFFLINE)
            await self.swarm.announce(self.record)
        if self.server is not None:
            self.server.draining = True
            await self.server.stop()


async def serve(options: PeerOptions, on_ready=None) -> None:
    """Run a peer until SIGINT or SIGTERM. `on_ready(maddrs)` is called once it serves."""
    swarm = await join_swarm(options.initial_peers, options.host, options.port, options.identity)
    peer = Peer(options, swarm)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await peer.start()
        maddrs = await swarm.maddrs()
        if options.address_file is not None:
            tmp = options.address_file.with_suffix(".tmp")
            tmp.write_text("\n".join(maddrs) + "\n")
            tmp.replace(options.address_file)
        if on_ready is not None:
            on_ready(maddrs)
        refresher = asyncio.create_task(peer.announce_forever())
        await stop.wait()
        refresher.cancel()
        log.info("leaving the swarm")
        await peer.leave()
    finally:
        await swarm.shutdown()
