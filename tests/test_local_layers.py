"""Local first layers (`local_layers=K`): the client runs layers [0, b) itself, b the first stage
start at or after K, and no peer sees the token embeddings. Real peers on 127.0.0.1 serve the
tiny llama in stages 0:1, 1:2, 2:4 (twice) and 0:2; tokens are compared with transformers'."""

import asyncio
import logging

import pytest
import torch

from p2pfusion.cli.commands import client_model
from p2pfusion.cli.main import build_parser
from p2pfusion.client.tune.adapter import Adapter, TuningConfig
from p2pfusion.client.generate.conversation import Conversation
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.generate.local_layers import LocalRun
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import RequestError
from p2pfusion.models.stage import load_config, load_stage
from tests.conftest import reference_model
from tests.swarm import peers_in_background
from tests.test_verify import lie, noise

IDS = [3, 17, 42, 99, 5, 250, 7, 1]
NEW = 6
RANGES = [(0, 1), (1, 2), (2, 4), (2, 4), (0, 2)]


@pytest.fixture(scope="module")
def swarm(tiny_models):
    source = tiny_models["llama"]
    with peers_in_background(source, RANGES) as (peers, maddrs, loop):
        client = loop.run(join_swarm(maddrs, client_mode=True))  # the tests' clients share one node
        try:
            yield source, loop, peers, client, reference_model(source)
        finally:
            loop.run(client.shutdown())


def greedy(ref, ids: list[int], new: int = NEW) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[0, len(ids):].tolist()


def model_of(swarm, local_layers: int, **options) -> RemoteCausalLM:
    source, _, _, client, _ = swarm
    options.setdefault("verify", 0.0)
    model = RemoteCausalLM.build(source, client, compression="none", local_layers=local_layers, **options)
    model.core.health.observed = {}  # what earlier runs saw of these peers must not steer the routes
    return model


async def reply(conversation: Conversation, ids: list[int]) -> tuple[list[int], int]:
    """Greedy tokens after `ids`, and the layer the conversation's session starts at."""
    result = await conversation.generate(ids, NEW, stop_at_eos=False, decode=False)
    return result.token_ids, conversation.session.session.route[0].start


def test_the_first_layer_runs_here_and_no_peer_of_layer_0_opens_a_session(swarm, caplog):
    source, loop, peers, _, ref = swarm
    caplog.set_level(logging.INFO, logger="p2pfusion")
    before = [peer.server.sessions_opened for peer in peers]
    model = model_of(swarm, 1)

    async def run():
        conversation = Conversation(model, keep=False)
        try:
            tokens, first = await reply(conversation, IDS)
        finally:
            await conversation.close()
        return tokens, first, await model.forward_logits(torch.tensor([IDS]))

    tokens, first, logits = loop.run(run())
    assert tokens == greedy(ref, IDS) and first == 1
    with torch.no_grad():
        torch.testing.assert_close(logits, ref(torch.tensor([IDS])).logits, atol=1e-5, rtol=0)
    opened = [peer.server.sessions_opened - b for peer, b in zip(peers, before)]
    assert opened[0] == 0 and opened[4] == 0 and opened[1] == 2  # the generation, then forward_logits
    said = [r.getMessage() for r in caplog.records if "on this machine" in r.getMessage()]
    assert said == ["running layers 0:1 on this machine (--local-layers 1; the swarm's stages start at 0, 1, 2)"]


def test_a_two_turn_conversation_keeps_its_local_cache(swarm):
    source, loop, peers, _, ref = swarm
    model = model_of(swarm, 1)

    async def run():
        conversation = Conversation(model)
        try:
            first, _ = await reply(conversation, IDS)
            session = conversation.session
            sequence = IDS + first + [11, 12, 13]
            second, start = await reply(conversation, sequence)
            assert conversation.session is session and start == 1  # the second turn sent only its new tokens
            return first, second, sequence, conversation.local.position
        finally:
            await conversation.close()

    first, second, sequence, held = loop.run(run())
    assert first == greedy(ref, IDS) and second == greedy(ref, sequence)
    assert held == len(sequence) + NEW - 1  # the last token is sampled, not yet sent


def test_verification_routes_from_the_boundary_and_a_rewind_cuts_the_local_cache(swarm):
    """Every step checked: first with honest peers, then with the faster of the two 2:4 peers
    lying. The liar is caught, the reply goes back to the last checked token (the local cache with
    it), and the tokens are still transformers'."""
    source, loop, peers, _, ref = swarm
    expected = greedy(ref, IDS)
    before = [peer.server.sessions_opened for peer in peers]
    honest = loop.run(model_of(swarm, 1, verify=1.0).generate(IDS, NEW, stop_at_eos=False, decode=False))
    assert honest.token_ids == expected and honest.rewinds == 0
    opened = [peer.server.sessions_opened - b for peer, b in zip(peers, before)]
    assert opened[0] == 0 and opened[4] == 0 and opened[2] > 0 and opened[3] > 0  # the route and its check

    liar, other = peers[2], peers[3]
    model = model_of(swarm, 1, verify=1.0)
    model.core.health.observed = {other.swarm.peer_id: 1e-3}  # seen slow: the route goes through the liar
    lie(liar, noise)
    try:
        caught = loop.run(model.generate(IDS, NEW, stop_at_eos=False, decode=False))
    finally:
        lie(liar, None)
    assert caught.token_ids == expected and caught.rewinds >= 1
    assert model.core.access().distrusted == {liar.swarm.peer_id}


def test_the_boundary_rounds_up_to_the_next_stage_start(swarm, caplog):
    """Seen through a trusted list of the peers 0:2 and 2:4, the swarm's stages start at 0 and 2:
    local_layers=1 runs layers 0:2 here."""
    source, loop, peers, _, ref = swarm
    caplog.set_level(logging.INFO, logger="p2pfusion")
    trusted = [peers[4].swarm.peer_id, peers[2].swarm.peer_id]
    model = model_of(swarm, 1, trusted_peers=trusted)

    async def run():
        conversation = Conversation(model, keep=False)
        try:
            return await reply(conversation, IDS)
        finally:
            await conversation.close()

    tokens, first = loop.run(run())
    assert tokens == greedy(ref, IDS) and first == 2
    said = [r.getMessage() for r in caplog.records if "on this machine" in r.getMessage()]
    assert said == ["running layers 0:2 on this machine (--local-layers 1; the swarm's stages start at 0, 2)"]


def test_adapters_apply_their_first_layers_here(swarm):
    """A LoRA adapter's and a deep prompt's parameters for layers 0:2 apply on the client, the rest
    on the peers: the same logits and tokens as with every layer in the swarm."""
    source, loop, _, _, _ = swarm
    torch.manual_seed(1)
    results = []
    for mode in ("lora", "deep_prompt"):
        adapter = Adapter(load_config(source), TuningConfig(mode, rank=4, prompt_tokens=3))
        for parameter in adapter.parameters():
            parameter.data.normal_(0, 0.3)
        for layers in (0, 2):
            model = model_of(swarm, layers)
            model.adapter = adapter
            if mode == "lora":
                results.append(loop.run(model.forward_logits(torch.tensor([IDS]))))
            else:
                results.append(loop.run(model.generate(IDS, NEW, stop_at_eos=False, decode=False)).token_ids)
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=0)
    assert results[2] == results[3]


@pytest.mark.parametrize("wanted", [3, 4])
def test_no_stage_starting_at_or_after_k_is_a_clear_error(swarm, wanted):
    source, loop, peers, client, _ = swarm
    maddr = str(loop.run(peers[0].swarm.maddrs())[0])
    args = ["infer", "--model", str(source.folder), "--initial-peers", maddr, "--local-layers", str(wanted)]
    model = loop.run(client_model(build_parser().parse_args([*args, "hi"])))  # as `p2pfusion infer` builds it
    try:
        with pytest.raises(RequestError) as error:
            loop.run(model.generate(IDS, NEW))
    finally:
        loop.run(model.core.leave())
    assert str(error.value) == (
        f"--local-layers {wanted}: no stage of the swarm starts at layer {wanted} or later "
        "(the model has 4 layers; the swarm's stages start at 0, 1, 2)"
    )
    with pytest.raises(RequestError, match="local_layers is a whole number"):
        model_of(swarm, -1)


def test_a_rewound_run_gives_what_a_fresh_one_gives(tiny_models):
    """Without a network: steps, a rewind into them, and a step after it; the outputs of the
    positions after the rewind are those of a run that never went past it."""
    stage = load_stage(tiny_models["llama"], 0, 2)
    torch.manual_seed(2)
    embeds = torch.randn(1, 9, 64)

    async def steps(run, *cuts):
        outs = []
        for a, b in cuts:
            if a < run.position:
                run.rewind(a)
            outs.append(await run.step(embeds[:, a:b]))
        return outs

    rewound = asyncio.run(steps(LocalRun(stage), (0, 5), (5, 6), (6, 7), (5, 9)))[-1]
    fresh = asyncio.run(steps(LocalRun(stage), (0, 5), (5, 9)))[-1]
    torch.testing.assert_close(rewound, fresh, atol=1e-6, rtol=0)
    assert LocalRun().first == 0 and LocalRun(stage).first == 2
