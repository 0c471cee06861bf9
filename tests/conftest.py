"""Shared fixtures: tiny random models of each family, the real default model, real local peers."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from p2pfusion.cli.forkserver import ForkServer
from p2pfusion.models.source import ModelSource, resolve_model

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.manual_seed(0)

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
)
TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=8),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "gemma": lambda: GemmaConfig(**COMMON, head_dim=16),
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, ModelSource]:
    """One tiny random model per family, saved as a local Hugging Face folder."""
    sources = {}
    for family, make_config in TINY_CONFIGS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make_config())
        folder = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(folder)
        sources[family] = resolve_model(str(folder))
    return sources


@pytest.fixture(scope="session")
def forks():
    """The fork server that tests' peer and API processes start from: each such process would
    otherwise spend seconds of CPU importing torch and transformers (cli/forkserver.py)."""
    server = ForkServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def default_model() -> ModelSource:
    return resolve_model(None)


def reference_model(source: ModelSource):
    return AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
