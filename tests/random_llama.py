"""A random Llama of about 400M parameters (24 layers of 64 MiB in float32), bigger than a peer's
budget in the memory tests and benchmark; generated, as no such model can be downloaded here."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.initialization import no_init_weights

CONFIG = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
              num_key_value_heads=16, vocab_size=256, max_position_embeddings=256)


def write_random_llama(folder: Path) -> Path:
    """Saved as safetensors, filled with small normal values: a faithful random init of 400M
    parameters takes longer than the tests that use it."""
    torch.manual_seed(0)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.02 * torch.randn_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder
