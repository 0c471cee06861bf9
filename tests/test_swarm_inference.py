"""Inference through real peers on 127.0.0.1 matches transformers run locally."""

import pytest
import torch
import uvloop

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from tests.conftest import TINY_CONFIGS, reference_model
from tests.swarm import running_peers

IDS = [3, 17, 42, 99, 5, 250, 7, 1]


async def _tiny_logits(source):
    async with running_peers(source, [(0, 2), (2, 4)]) as (_, maddrs):
        swarm = await join_swarm(maddrs, client_mode=True)
        try:
            model = RemoteCausalLM.build(source, swarm)
            session = await model.open_session(16)
            try:
                prefill = model.logits(await session.step(model.embed(IDS)))
                step = model.logits(await session.step(model.embed([11])))
            finally:
                await session.close()
        finally:
            await swarm.shutdown()
    return prefill, step


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_two_peer_logits_match_transformers(tiny_models, family):
    source = tiny_models[family]
    prefill, step = uvloop.run(_tiny_logits(source))
    ref = reference_model(source)
    with torch.no_grad():
        expected = ref(torch.tensor([IDS + [11]])).logits
    torch.testing.assert_close(prefill, expected[:, :-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(step, expected[:, -1:], atol=1e-5, rtol=0)


async def _default_generation(source, ids):
    async with running_peers(source, [(0, 10), (10, 20), (20, 30)]) as (_, maddrs):
        swarm = await join_swarm(maddrs, client_mode=True)
        try:
            # hidden states compared to 1e-4 must travel raw: `auto` may take float16 on a link that
            # measured slow while this 2-core machine was busy (greedy tokens stay exact with it)
            model = RemoteCausalLM.build(source, swarm, compression="none")
            session = await model.open_session(len(ids) + 1)
            try:
                final = await session.step(model.embed(ids))
            finally:
                await session.close()
            generated = await RemoteCausalLM.build(source, swarm).generate(ids, max_new_tokens=32, temperature=0.0)
        finally:
            await swarm.shutdown()
    return final, generated, model


@pytest.mark.slow
def test_default_model_greedy_32_tokens_match_generate(default_model):
    ref = reference_model(default_model)
    ids = RemoteCausalLM.build(default_model).encode("Name three colors of the rainbow.", chat=True)
    final, generated, model = uvloop.run(_default_generation(default_model, ids))
    with torch.no_grad():
        out = ref(torch.tensor([ids]), output_hidden_states=True)
        expected = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    assert generated.token_ids == expected
    # transformers' last hidden state is after the final norm, which runs on the client
    torch.testing.assert_close(model.head.model.norm(final), out.hidden_states[-1], atol=1e-4, rtol=0)


async def _batch_logits(source, batch):
    async with running_peers(source, [(0, 2), (2, 4)]) as (peers, maddrs):
        swarm = await join_swarm(maddrs, client_mode=True)
        try:
            logits = await RemoteCausalLM.build(source, swarm, compression="none").forward_logits(batch)
            return logits, [peer.server.sessions_opened for peer in peers]
        finally:
            await swarm.shutdown()


def test_batch_forward_in_pipelined_chunks_matches_transformers(tiny_models):
    """128 tokens through 2 hops go as two 64-token pieces, overlapped; logits must not change,
    and the forward opens one session per hop, for the whole batch."""
    source = tiny_models["qwen2"]
    batch = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(1))
    logits, opened = uvloop.run(_batch_logits(source, batch))
    assert opened == [1, 1]
    with torch.no_grad():
        expected = reference_model(source)(batch).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
