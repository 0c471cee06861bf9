"""Peers started as real processes announce themselves, and SIGTERM leaves cleanly."""

import asyncio
import signal

import uvloop

from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.dht.records import PeerState
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.peer.runtime import Peer, PeerOptions
from tests.swarm import running_peers, stop_peer


async def _states(maddrs, model):
    client = await join_swarm(maddrs, client_mode=True)
    try:
        return {(r.start, r.end): r.state for r in await client.lookup(model)}
    finally:
        await client.shutdown()


def test_layer_claim_and_sigterm_announce_offline(tiny_models, forks):
    source = tiny_models["qwen2"]
    with LocalSwarm(model=str(source.folder), forks=forks) as swarm:
        swarm.start([(0, 2)])
        # without --layers, the joining peer takes the layers nobody serves
        second = swarm.launch(None, ["--max-layers", "2"])
        swarm.wait_ready(second)
        assert uvloop.run(_states(swarm.maddrs, source.key)) == {(0, 2): PeerState.ONLINE, (2, 4): PeerState.ONLINE}
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
        assert uvloop.run(_states(swarm.maddrs, source.key))[(2, 4)] == PeerState.OFFLINE


class _RacingPeer(Peer):
    """A peer whose first announcement waits until its rival has chosen its layers too: the two
    claims are then made, as when volunteers start together, before either can see the other."""

    def __init__(self, options, swarm, barrier: asyncio.Barrier):
        super().__init__(options, swarm)
        self.barrier, self.claimed = barrier, False

    async def announce(self, **changes) -> None:
        if not self.claimed:
            self.claimed = True
            await self.barrier.wait()
        await super().announce(**changes)


def test_peers_joining_at_once_do_not_claim_the_same_layers(tiny_models):
    """Two volunteers start together against a swarm missing layers 2:4: one serves them, and the
    other, finding the swarm covered, keeps a stage warm instead of duplicating the first's range."""
    source = tiny_models["qwen2"]

    async def join(maddrs, barrier):
        options = PeerOptions(source=source, initial_peers=maddrs, max_layers=2, throughput="100")
        peer = _RacingPeer(options, await join_swarm(maddrs), barrier)
        await peer.start()
        return peer

    async def scenario():
        async with running_peers(source, [(0, 2)]) as (_, maddrs):
            barrier = asyncio.Barrier(2)
            joiners = await asyncio.gather(join(maddrs, barrier), join(maddrs, barrier))
            try:
                return sorted((p.record.start, p.record.end, p.record.state.value) for p in joiners)
            finally:
                for peer in joiners:
                    await stop_peer(peer)

    placed = uvloop.run(scenario())
    assert (2, 4, "online") in placed
    assert sorted(state for *_, state in placed) == ["backup", "online"]
