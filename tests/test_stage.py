"""A stage computes exactly what the same layers compute inside transformers' own model."""

import pytest
import torch

from p2pfusion.models.formats import WeightFormat, load_settings
from p2pfusion.models.stage import load_config, load_head, load_stage
from tests.conftest import TINY_CONFIGS, reference_model

IDS = torch.tensor([[3, 17, 42, 99, 5, 250, 7, 1, 64, 128]])


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_a_stage_and_its_first_layers_equal_those_layers_of_the_local_model(tiny_models, family):
    source = tiny_models[family]
    ref = reference_model(source)
    with torch.no_grad():
        states = ref(IDS, output_hidden_states=True).hidden_states
    stage = load_stage(source, 1, 3)
    # hidden_states[i] is the input of layer i (before the final norm for i < num_layers)
    torch.testing.assert_close(stage.forward(states[1], 0), states[3], atol=1e-6, rtol=0)
    # its first layers alone, with a cache of their own (a route that leaves the peer early), and
    # the stage still whole after
    view = stage.first_layers(2)
    assert (view.start, view.end, len(view.module.layers)) == (1, 2, 1) and len(stage.module.layers) == 2
    assert stage.first_layers(2) is view and stage.first_layers(3) is stage
    cache = view.new_cache()
    first, rest = view.forward(states[1][:, :7], 0, cache), view.forward(states[1][:, 7:], 7, cache)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), states[2], atol=1e-5, rtol=0)
    torch.testing.assert_close(stage.forward(states[1], 0), states[3], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="not the first ones"):
        stage.first_layers(1)


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_head_and_stages_give_local_logits_with_cache(tiny_models, family):
    source = tiny_models[family]
    ref = reference_model(source)
    head = load_head(source)
    stages = [load_stage(source, 0, 1), load_stage(source, 1, 4)]
    caches = [s.new_cache() for s in stages]
    with torch.no_grad():
        for position, chunk in ((0, IDS[:, :7]), (7, IDS[:, 7:8]), (8, IDS[:, 8:])):
            hidden = head.get_input_embeddings()(chunk)
            for stage, cache in zip(stages, caches):
                hidden = stage.forward(hidden, position, cache)
            expected = ref(IDS[:, : position + chunk.shape[1]]).logits[:, position:]
            torch.testing.assert_close(head(inputs_embeds=hidden).logits, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", [WeightFormat.FLOAT32, WeightFormat.INT8])
def test_a_stage_moved_over_shares_the_layers_it_kept_and_computes_as_one_read_afresh(tiny_models, fmt):
    # a peer moving from 0:3 to 1:4 keeps layers 1 and 2 (peer/runtime.py `load`)
    source = tiny_models["mistral"]  # sliding-window layers: each keeps its own kind of mask
    dtype, quant = load_settings(fmt)
    old = load_stage(source, 0, 3, dtype, quant=quant)
    moved = load_stage(source, 1, 4, dtype, quant=quant, reuse=old)
    for index in (1, 2):  # the same weights, not copies
        ours, theirs = moved.module.layers[index - 1].named_parameters(), old.module.layers[index].named_parameters()
        assert [(name, id(p)) for name, p in ours] == [(name, id(p)) for name, p in theirs]
    torch.manual_seed(0)
    hidden = torch.randn(1, 9, load_config(source).hidden_size)

    def cached(stage):  # a prompt, then a step on its cache, as a session runs
        cache = stage.new_cache()
        return torch.cat([stage.forward(hidden[:, :8], 0, cache), stage.forward(hidden[:, 8:], 8, cache)], dim=1)

    assert torch.equal(cached(moved), cached(load_stage(source, 1, 4, dtype, quant=quant)))
    if fmt == WeightFormat.FLOAT32:  # and as transformers computes those layers
        ref = reference_model(source)
        with torch.no_grad():
            states = ref(IDS, output_hidden_states=True).hidden_states  # the last after the final norm
            torch.testing.assert_close(ref.model.norm(moved.forward(states[1], 0)), states[4], atol=1e-5, rtol=0)
    # the old stage, which serves its sessions until they end, keeps its own numbering
    assert torch.equal(cached(old), cached(load_stage(source, 0, 3, dtype, quant=quant)))
    # another format is read afresh
    other = load_stage(source, 1, 4, torch.bfloat16, reuse=old)
    assert not {id(p) for p in other.module.parameters()} & {id(p) for p in old.module.parameters()}


@pytest.mark.slow
def test_peer_holds_only_its_layers(default_model):
    ref = reference_model(default_model)
    full = sum(p.numel() * p.element_size() for p in ref.parameters())
    stage = load_stage(default_model, 10, 20)
    assert stage.parameter_bytes() <= 0.45 * full
    assert len(stage.module.layers) == 10


def test_out_of_bounds_range_is_rejected(tiny_models):
    from p2pfusion.errors import ModelError

    with pytest.raises(ModelError, match="out of bounds"):
        load_stage(tiny_models["llama"], 2, 9)
