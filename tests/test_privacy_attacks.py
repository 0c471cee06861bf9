"""The privacy attack harness (scripts/privacy_attacks.py) on a tiny random Llama: it attacks
exactly the states a peer receives, the exact attack inverts them completely, and it fails when
the states carry no information (so its successes mean something)."""

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from p2pfusion.models.source import ModelSource
from p2pfusion.models.stage import load_stage
from p2pfusion.net.compression import Codec
from tests.conftest import reference_model

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "privacy_attacks.py"


def _load():
    spec = importlib.util.spec_from_file_location("privacy_attacks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["privacy_attacks"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


attacks = _load()
PROMPTS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))


@dataclass
class Setting:
    source: ModelSource
    model: torch.nn.Module
    embeddings: torch.Tensor
    probes: dict  # depth -> the probe fitted at that depth
    tables: dict  # depth -> first_position_table


@pytest.fixture(scope="module")
def setting(tiny_models) -> Setting:
    source = tiny_models["llama"]
    model = reference_model(source)
    model.requires_grad_(False)
    embeddings = model.get_input_embeddings().weight.detach()
    train = torch.randint(0, 256, (32, 32), generator=torch.Generator().manual_seed(4))
    probes, tables = {}, attacks.first_position_table(model, [0, 1, 2])
    for depth in (0, 1, 2):
        states = attacks.states_at(model, train, depth)
        probes[depth] = attacks.Probe.fit(states.reshape(-1, states.shape[-1]), train.reshape(-1), embeddings)
    return Setting(source, model, embeddings, probes, tables)


@pytest.mark.parametrize("depth", [1, 2])
def test_states_are_what_a_peer_receives(setting, depth):
    model = setting.model
    peer_input = load_stage(setting.source, 0, depth).forward(setting.embeddings[PROMPTS], 0)
    torch.testing.assert_close(attacks.states_at(model, PROMPTS, depth), peer_input, atol=1e-5, rtol=0)
    with torch.no_grad():
        expected = model(PROMPTS, output_hidden_states=True).hidden_states[depth]
    torch.testing.assert_close(attacks.states_at(model, PROMPTS, depth), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_exact_attack_inverts_raw_states(setting, depth):
    model, score = setting.model, attacks.Score()
    for ids in PROMPTS:
        observed = attacks.states_at(model, ids[None], depth)[0]
        tolerance = attacks.sink_tolerance(observed, observed)  # float rounding only
        inversion = attacks.exact_attack(model, observed, depth, setting.probes[depth], tolerance, 256,
                                         setting.tables[depth])
        score.add(inversion.ids, ids.tolist())
    assert score.rates()["tokens"] == 1.0 and score.rates()["prompts"] == 1.0


def test_a_whole_vocabulary_search_finds_what_a_tiny_budget_misses(setting):
    """Ranked by a probe fitted on states paired with the wrong tokens, and cut to 1 candidate per
    position, the search misses; searching the rest of the vocabulary where it does gives every
    token back."""
    model, depth = setting.model, 2
    train = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(6))
    states = attacks.states_at(model, train, depth).reshape(-1, setting.embeddings.shape[-1])
    shuffled = train.reshape(-1)[torch.randperm(train.numel(), generator=torch.Generator().manual_seed(7))]
    misled = attacks.Probe.fit(states, shuffled, setting.embeddings)
    for full, want in ((False, lambda rate: rate < 1.0), (True, lambda rate: rate == 1.0)):
        score, tried = attacks.Score(), []
        for ids in PROMPTS:
            observed = attacks.states_at(model, ids[None], depth)[0]
            tolerance = attacks.sink_tolerance(observed, observed)
            inversion = attacks.exact_attack(model, observed, depth, misled, tolerance, 1, setting.tables[depth], full=full)
            score.add(inversion.ids, ids.tolist())
            tried += inversion.tried
        assert want(score.rates()["tokens"]), (full, score.rates())
    assert min(tried) <= 1 < max(tried)


def test_nearest_neighbour_inverts_embeddings(setting):
    embedded = attacks.states_at(setting.model, PROMPTS, 0).reshape(-1, 64)
    guesses = attacks.nearest_neighbour(embedded, setting.embeddings)
    assert torch.equal(guesses["cosine"], PROMPTS.reshape(-1)) and torch.equal(guesses["l2"], PROMPTS.reshape(-1))


def test_heavy_noise_defeats_the_exact_attack(setting):
    model = setting.model
    generator = torch.Generator().manual_seed(5)
    score = attacks.Score()
    for ids in PROMPTS:
        clean = attacks.states_at(model, ids[None], 1)
        noisy = attacks.apply_sink(clean, attacks.Sink(noise=10.0), generator)[0]
        # tolerance 0: every candidate of the whole vocabulary is tried, the nearest wins
        inversion = attacks.exact_attack(model, noisy, 1, setting.probes[1], 0.0, 256, setting.tables[1])
        score.add(inversion.ids, ids.tolist())
    assert score.rates()["tokens"] < 0.5


def test_codec_sinks_change_states_within_their_bounds(setting):
    clean = attacks.states_at(setting.model, PROMPTS[:1], 2)
    assert torch.equal(attacks.apply_sink(clean, attacks.RAW), clean)
    float16 = attacks.relative_error(clean, attacks.apply_sink(clean, attacks.Sink(Codec.FLOAT16)))
    assert 0 < float(float16.max()) < 1e-3
    topk = attacks.apply_sink(clean, attacks.Sink(Codec.TOPK, topk_share=0.1))
    assert int((topk != 0).sum()) == round(0.1 * clean.numel())
