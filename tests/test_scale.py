"""Twenty nodes, each with its own libp2p daemon: 4 peers that place themselves, 15 DHT-only nodes
and a client. Records spread to every node, survive a third of the DHT nodes crashing, and a
generation through the swarm is token-identical to transformers. (scripts/bench_scale.py runs
60 nodes as processes, with churn.)"""

import asyncio
import random
import time

import pytest
import torch
import uvloop

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.dht.swarm import join_swarm
from tests.conftest import reference_model
from tests.swarm import running_peers, start_peer, stop_peer

DHT_NODES = 15
SPREAD_WITHIN = 20.0  # seconds: generous, for a loaded 2-core machine


async def _seen_by_all(nodes, model: str) -> bool:
    found = await asyncio.gather(*(node.lookup(model) for node in nodes))
    return all(found)


@pytest.mark.slow
def test_twenty_nodes_spread_records_survive_crashes_and_generate_like_transformers(tiny_models):
    source = tiny_models["llama"]
    ids = [5, 17, 42, 99, 3]

    async def scenario():
        async with running_peers(source, [(0, 2)]) as (peers, maddrs):
            nodes = list(await asyncio.gather(*(join_swarm(maddrs) for _ in range(DHT_NODES))))
            try:
                rng = random.Random(0)
                for _ in range(3):  # peers joining through DHT nodes, placing themselves
                    entry = await rng.choice(nodes).maddrs()
                    peers.append(await start_peer(source, entry, None, max_layers=2))
                peer_ids = {p.record.peer_id for p in peers}
                client = await join_swarm(await nodes[-1].maddrs(), client_mode=True)
                try:
                    probe = PeerRecord("probe", client.writer_id, [], 0, 1, PeerState.ONLINE, 1.0, None, "probe")
                    await client.announce(probe)
                    deadline = time.monotonic() + SPREAD_WITHIN
                    while not await _seen_by_all(nodes, "probe"):
                        assert time.monotonic() < deadline, "a DHT node did not see the new record"
                        await asyncio.sleep(0.5)
                    for node in nodes[:DHT_NODES // 3]:  # crash: no goodbye to anyone
                        await node.dht.shutdown()
                        await node.transport.shutdown()
                    del nodes[:DHT_NODES // 3]
                    listed = {r.peer_id for r in await client.lookup(source.key)}
                    model = RemoteCausalLM.build(source, client)
                    result = await model.generate(ids, 8, stop_at_eos=False, decode=False)
                finally:
                    await client.shutdown()
            finally:
                for peer in peers[1:]:
                    await stop_peer(peer)
                del peers[1:]
                for node in nodes:
                    await node.shutdown()
        return listed, peer_ids, result.token_ids

    listed, peer_ids, tokens = uvloop.run(scenario())
    assert peer_ids <= listed
    with torch.no_grad():
        expected = reference_model(source).generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert tokens == expected[0, len(ids):].tolist()
