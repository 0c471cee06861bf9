"""A route may leave a peer before its last layer: real peers on 127.0.0.1 serving 0:3 and 2:4 of a
tiny model, whose only route runs layers 0:2 on the first and 2:4 on the second. The first peer
runs and caches only those two layers for the session, the tokens are transformers' own, a peer
refuses a hop that would enter it after its first layer, and a checked generation accuses nobody."""

import pytest
import torch

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.net import messages as m
from p2pfusion.net.compression import Codec
from p2pfusion.net.framing import read_frame, write_frame
from tests.conftest import reference_model
from tests.swarm import named_swarm

IDS = [3, 17, 42, 99, 5, 250, 7, 1]
NEW = 6


@pytest.fixture(scope="module")
def swarm(tiny_models):
    source = tiny_models["llama"]
    with named_swarm(source, [("long", (0, 3), {}), ("last", (2, 4), {})], "test-partial") as (loop, peers, client):
        with torch.no_grad():
            out = reference_model(source).generate(torch.tensor([IDS]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        yield source, loop, peers, client, out[0, len(IDS):].tolist()


def test_a_route_that_leaves_a_peer_early_gives_transformers_tokens(swarm):
    source, loop, peers, client, expected = swarm
    model = RemoteCausalLM.build(source, client, compression="none", verify=0.0, speculate="off")

    async def run():
        session = await model.open_session(len(IDS) + NEW)
        try:
            route = [(r.peer_id, r.start, r.end) for r in session.session.route]
            held = [s.stage for s in peers["long"].server.sessions.values()]
        finally:
            await session.close()
        return route, held, await model.generate(IDS, NEW, stop_at_eos=False, decode=False)

    route, held, result = loop.run(run())
    assert route == [(peers["long"].swarm.peer_id, 0, 2), (peers["last"].swarm.peer_id, 2, 4)]
    # the session's stage on the first peer is its first two layers, sharing its weights
    assert [(s.start, s.end, len(s.module.layers)) for s in held] == [(0, 2, 2)]
    assert held[0].module.layers[0] is peers["long"].server.stage.module.layers[0]
    assert result.token_ids == expected


def test_checks_of_a_shortened_hop_accuse_nobody(swarm):
    source, loop, _, client, expected = swarm
    model = RemoteCausalLM.build(source, client, compression="none", verify=1.0, speculate="off")
    result = loop.run(model.generate(IDS, NEW, stop_at_eos=False, decode=False))
    assert result.token_ids == expected and result.rewinds == 0


def test_a_hop_that_enters_a_peer_after_its_first_layer_is_refused_and_the_peer_serves_on(swarm):
    source, loop, peers, client, expected = swarm
    last = peers["last"]

    async def enter_late():
        reader, writer = await client.transport.open(last.swarm.peer_id, last.swarm.transport.data_addrs, m.PROTOCOL)
        hop = m.Hop(last.swarm.peer_id, last.swarm.transport.data_addrs, 3, 4)
        await write_frame(writer, m.to_header(m.Open("late", 32, [hop], compression=Codec.NONE)))
        reply = (await read_frame(reader))[0]
        writer.close()
        return reply

    reply = loop.run(enter_late())
    assert reply["kind"] == "error" and "serves layers 2:4, not 3:4" in reply["message"], reply
    model = RemoteCausalLM.build(source, client, compression="none", verify=0.0, speculate="off")
    assert loop.run(model.generate(IDS, NEW, stop_at_eos=False, decode=False)).token_ids == expected
