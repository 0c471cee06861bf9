"""Peers started as real processes announce themselves, and SIGTERM leaves cleanly."""

import signal

import uvloop

from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.dht.records import PeerState
from p2pfusion.dht.swarm import join_swarm


async def _states(maddrs, model):
    client = await join_swarm(maddrs, client_mode=True)
    try:
        return {(r.start, r.end): r.state for r in await client.lookup(model)}
    finally:
        await client.shutdown()


def test_layer_claim_and_sigterm_announce_offline(tiny_models):
    source = tiny_models["qwen2"]
    with LocalSwarm(model=str(source.folder)) as swarm:
        swarm.start([(0, 2)])
        # without --layers, the joining peer takes the layers nobody serves
        second = swarm.launch(None, ["--max-layers", "2"])
        swarm.wait_ready(second)
        assert uvloop.run(_states(swarm.maddrs, source.name)) == {(0, 2): PeerState.ONLINE, (2, 4): PeerState.ONLINE}
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
        assert uvloop.run(_states(swarm.maddrs, source.name))[(2, 4)] == PeerState.OFFLINE
