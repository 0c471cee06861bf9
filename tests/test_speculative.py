"""Speculative decoding: drafts looked up in the text, checked by the swarm in one step, the peers'
caches cut back to what stood. Greedy text is transformers' own; sampled text keeps the model's
distribution."""

import pytest
import torch
import uvloop
from transformers import LlamaConfig

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.generate.conversation import Conversation
from p2pfusion.client.generate.draft import (
    EXPLORE_EVERY,
    Speculation,
    accept_greedy,
    accept_sampled,
    best_drafts,
    lookup,
)
from p2pfusion.client.generate.draft_model import DraftModel
from p2pfusion.client.options import ClientOptions
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import ModelError, PeerRefused, RequestError
from tests.conftest import reference_model
from tests.swarm import running_peers

# a prompt that repeats itself: a random tiny model falls into loops the drafts then predict
PROMPT = [3, 17, 42, 99, 5, 250, 7, 1, 3, 17, 42, 99]


def test_lookup_takes_the_latest_longest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # "1 2 3" last seen before 7 8
    assert lookup([5, 6, 4, 6], 3, min_ngram=1) == [4, 6]  # only "6" occurred before: what followed it
    assert lookup([5, 6, 4, 6], 3) == []  # one token in common is not enough by default
    assert lookup([1, 2, 3], 4) == [] and lookup([1, 1], 0) == []
    assert lookup([1, 2, 1, 2, 1], 5) == [2, 1]  # never past the text's end


def test_the_number_of_drafts_follows_what_pays():
    assert best_drafts(0.0, 0.9, 0.1, 8) == 0  # nothing stands: plain steps
    assert best_drafts(0.9, 0.9, 0.05, 8) == 8  # nearly all stand and cost little: as many as allowed
    assert best_drafts(0.9, 0.9, 0.05, 3) == 3  # no more than were found
    assert best_drafts(0.5, 0.5, 1.0, 8) == 0  # each draft costs a whole step: never worth it
    # a copy stands or falls in runs: with the same share standing overall, runs pay for more drafts
    assert best_drafts(0.6, 0.95, 0.2, 8) > best_drafts(0.6, 0.6, 0.2, 8)
    spec = Speculation()
    text = [1, 2, 3, 4] * 4
    assert spec.drafts(text, room=100) == []  # no drafts before a plain step was timed
    spec.took(0, 0, 0.010)  # a plain step: 10 ms
    assert spec.drafts(text, room=100) and spec.drafts(text, room=0) == []
    for _ in range(20):  # drafts that never stand, each costing 5 ms
        spec.took(2, 0, 0.020)
    assert spec.drafts(text, room=100) == []  # drafting stopped paying
    for _ in range(EXPLORE_EVERY - 1):
        assert not spec.explores_next()
        spec.took(0, 0, 0.010)
    assert spec.explores_next()  # a draft model reads ahead beside this plain step
    spec.took(0, 0, 0.010)
    assert len(spec.drafts(text, room=100)) == 1  # but it tries one now and then...
    spec.took(1, 0, 0.015)
    for _ in range(EXPLORE_EVERY):
        spec.took(0, 0, 0.010)
    assert spec.drafts(text, room=100) == []  # ...less often after a try that fell
    for _ in range(EXPLORE_EVERY):
        spec.took(0, 0, 0.010)
    assert len(spec.drafts(text, room=100)) == 1
    # a draft model: its drafting is timed within the step, and counted once
    spec = Speculation()
    spec.took(0, 0, 0.010)
    for _ in range(20):  # 4 drafts that stand, drafted at 4 ms each: 5 tokens in 30 ms, against 10 ms a token
        spec.took(4, 4, 0.030, drafting=0.004)
    assert spec.size(8) >= 4
    for _ in range(20):  # the same in 60 ms: fewer tokens per second than plain steps
        spec.took(4, 4, 0.060, drafting=0.004)
    assert spec.size(8) == 0


def test_greedy_acceptance():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accept_greedy([5, 6], [4, 6, 1]) == 0
    assert accept_greedy([5, 6], [5, 6, 1]) == 2


def test_sampled_acceptance_keeps_the_models_distribution():
    """Each emitted token is distributed as the model says, whatever the drafts were."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    drafts = [2, 3]
    first = torch.zeros(4)
    second = torch.zeros(4)  # the token after an accepted first draft
    runs = 20_000
    for _ in range(runs):
        accepted, token = accept_sampled(drafts, probs, generator)
        first[drafts[0] if accepted >= 1 else token] += 1
        if accepted >= 1:
            second[drafts[1] if accepted == 2 else token] += 1
    torch.testing.assert_close(first / runs, probs[0], atol=0.015, rtol=0)
    torch.testing.assert_close(second / second.sum(), probs[1], atol=0.02, rtol=0)


async def _speculative(source, turns, **settings):
    async with running_peers(source, [(0, 2), (2, 4)]) as (_, maddrs):
        swarm = await join_swarm(maddrs, client_mode=True)
        try:
            model = RemoteCausalLM.build(source, swarm, verify=0.0, **settings)
            conversation = Conversation(model)
            results = []
            sequence = list(PROMPT)
            for more in turns:
                sequence += more
                result = await conversation.generate(sequence, 24, decode=False)
                results.append(result)
                sequence += result.token_ids
            spec = conversation.speculation
            await conversation.close()
            return results, (spec.sent, spec.stood)
        finally:
            await swarm.shutdown()


def _greedy_two_turns(source, **settings):
    """Drafts accepted and rejected over two turns of one session: the second turn's tokens are
    transformers' for the whole sequence, so the peers' caches held exactly the accepted tokens."""
    (first, second), (sent, stood) = uvloop.run(_speculative(source, [[], [11, 12]], **settings))
    assert 0 < stood < sent  # some drafts stood, some fell (and left the caches)
    assert first.steps < len(first.token_ids)  # fewer trips than tokens
    ref = reference_model(source)
    with torch.no_grad():
        expected1 = ref.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False)[0, len(PROMPT):].tolist()
        context = PROMPT + expected1 + [11, 12]
        expected2 = ref.generate(torch.tensor([context]), max_new_tokens=24, do_sample=False)[0, len(context):].tolist()
    assert first.token_ids == expected1
    assert second.token_ids == expected2


def test_greedy_speculation_through_peers_is_transformers_text_and_cuts_the_caches(tiny_models):
    _greedy_two_turns(tiny_models["llama"])


def test_a_draft_model_drafts_for_any_text(tiny_models, tmp_path):
    """A draft model that agrees with the target about half the time (its layers' weights off by
    noise of 0.3 of their spread): drafts that stand and fall, the text still transformers' own."""
    source = tiny_models["llama"]
    draft = reference_model(source)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in draft.model.layers.parameters():
            weight.add_(torch.randn(weight.shape, generator=noise) * 0.3 * weight.std())
    draft.save_pretrained(tmp_path / "draft")
    _greedy_two_turns(source, draft_model=str(tmp_path / "draft"))


def test_a_draft_model_needs_the_same_vocabulary(tiny_models):
    with pytest.raises(ModelError, match="the draft model .* has 256 tokens, .* has 512: a draft model needs the same"):
        DraftModel.load(str(tiny_models["llama"].folder), tiny_models["llama"], LlamaConfig(vocab_size=512))
    with pytest.raises(RequestError, match="needs speculate"):
        ClientOptions(draft_model="x", speculate="off")


async def _sampled(source):
    async with running_peers(source, [(0, 2), (2, 4)]) as (_, maddrs):
        swarm = await join_swarm(maddrs, client_mode=True)
        try:
            model = RemoteCausalLM.build(source, swarm, verify=0.0)
            return await model.generate(PROMPT, 24, temperature=0.7, seed=3, decode=False)
        finally:
            await swarm.shutdown()


def test_sampled_speculation_through_peers_generates(tiny_models):
    result = uvloop.run(_sampled(tiny_models["llama"]))
    assert len(result.token_ids) == 24 and result.steps is not None and result.steps <= 24


async def _cut_on_sliding_window(source):
    async with running_peers(source, [(0, 4)]) as (_, maddrs):
        swarm = await join_swarm(maddrs, client_mode=True)
        try:
            model = RemoteCausalLM.build(source, swarm)
            session = await model.open_session(16)
            try:
                await session.step(model.embed([3, 17, 42]))
                session.keep(2)
                with pytest.raises(PeerRefused, match="sliding-window cache, which cannot drop positions"):
                    await session.step(model.embed([5]))
            finally:
                await session.close()
            return model.speculates()
        finally:
            await swarm.shutdown()


def test_sliding_window_layers_refuse_to_cut_and_clients_do_not_draft_for_them(tiny_models):
    assert uvloop.run(_cut_on_sliding_window(tiny_models["mistral"])) is False
