"""A client's trainable parameters, and their files in the PEFT format.

- `prompt`: soft prompt tokens before every sequence, trained and applied on the client;
- `deep_prompt`: the soft prompt, plus a prompt per later layer that peers add to the hidden
  states of those positions before the layer;
- `lora`: LoRA matrices on the layers' projections, applied by the peers.
Only the client owns and updates them; peers get the parts for their layers per session.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig

from p2pfusion.client.route.params import SessionParams
from p2pfusion.errors import ModelError, RequestError
from p2pfusion.models.tuning import (
    DEEP_PROMPT,
    DEFAULT_LORA_TARGETS,
    LORA,
    MAX_PROMPT_TOKENS,
    MAX_RANK,
    PROMPT,
    TUNING_MODES,
    layer_projections,
    resolve_targets,
)
from p2pfusion.models.source import ModelSource
from p2pfusion.net import messages as m
from p2pfusion.net.payloads import flatten

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model.model."  # where PEFT puts a causal LM's decoder layers
SOFT_PROMPT_KEY = "prompt_embeddings"  # PEFT's name for prompt tuning's virtual tokens
MODEL_KEY_FIELD = "p2pfusion_model_key"  # the base model's swarm key; PEFT ignores fields it does not know
PEFT_TYPES = {LORA: "LORA", PROMPT: "PROMPT_TUNING", DEEP_PROMPT: "P2PFUSION_DEEP_PROMPT"}


@dataclass(frozen=True)
class TuningConfig:
    mode: str
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    prompt_tokens: int = 16

    def __post_init__(self):
        if self.mode not in TUNING_MODES:
            raise RequestError(f"unknown tuning mode {self.mode!r}; choose one of {', '.join(TUNING_MODES)}")
        if not 0 < self.rank <= MAX_RANK:
            raise RequestError(f"lora_rank must be in 1..{MAX_RANK}, got {self.rank}")
        if not 0 < self.prompt_tokens <= MAX_PROMPT_TOKENS:
            raise RequestError(f"prompt_tokens must be in 1..{MAX_PROMPT_TOKENS}, got {self.prompt_tokens}")


def _key(name: str) -> str:
    return name.replace(".", "/")  # nn.ParameterDict refuses dots in names


class Adapter(nn.Module):
    def __init__(self, config: PretrainedConfig, tuning: TuningConfig, embeddings: nn.Embedding | None = None):
        super().__init__()
        self.tuning = tuning
        self.num_layers = config.num_hidden_layers
        hidden = config.hidden_size
        self.soft_prompt = None
        self.remote = nn.ParameterDict()
        if tuning.mode in (PROMPT, DEEP_PROMPT):
            self.soft_prompt = nn.Parameter(_prompt_init(embeddings, tuning.prompt_tokens, hidden))
        if tuning.mode == DEEP_PROMPT:  # layer 0's prompt is the soft prompt itself
            for layer in range(1, self.num_layers):
                self.remote[_key(f"layers.{layer}.prompt")] = nn.Parameter(torch.zeros(tuning.prompt_tokens, hidden))
        if tuning.mode == LORA:
            projections = layer_projections(config)
            paths = resolve_targets(projections, tuning.targets)
            for layer in range(self.num_layers):
                for path in paths:
                    fan_in, fan_out = projections[path]
                    lora_a = torch.empty(tuning.rank, fan_in)
                    nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5))  # as PEFT: B starts at 0, so LoRA starts as a no-op
                    self.remote[_key(f"layers.{layer}.{path}.lora_A")] = nn.Parameter(lora_a)
                    self.remote[_key(f"layers.{layer}.{path}.lora_B")] = nn.Parameter(torch.zeros(fan_out, tuning.rank))

    @property
    def prompt_length(self) -> int:
        return 0 if self.soft_prompt is None else self.soft_prompt.shape[0]

    @property
    def scaling(self) -> float:
        return self.tuning.alpha / self.tuning.rank if self.tuning.mode == LORA else 1.0

    def named_remote(self) -> list[tuple[str, nn.Parameter]]:
        return [(key.replace("/", "."), p) for key, p in self.remote.items()]

    def session_params(self) -> SessionParams | None:
        """The parameters peers apply, named by a digest of their values (None: none)."""
        named = self.named_remote()
        if not named:
            return None
        flat = flatten([p for _, p in named])
        digest = hashlib.blake2b(flat.numpy().tobytes(), digest_size=12)
        digest.update(json.dumps([(n, list(p.shape)) for n, p in named]).encode())
        message = m.Params(digest.hexdigest(), self.scaling, [(n, list(p.shape)) for n, p in named])
        return SessionParams(message, flat)

    # PEFT files

    def save(self, path: str | Path, base_model: ModelSource) -> None:
        """Write the PEFT files; they name the base model for people (PEFT's field) and by its swarm
        key, so loading can tell the same weights under another name from other weights."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        tuning = self.tuning
        config = {"peft_type": PEFT_TYPES[tuning.mode], "task_type": "CAUSAL_LM",
                  "base_model_name_or_path": base_model.name, MODEL_KEY_FIELD: base_model.key,
                  "inference_mode": True, "num_layers": self.num_layers}
        weights = {}
        if tuning.mode == LORA:
            config.update(r=tuning.rank, lora_alpha=tuning.alpha, target_modules=list(tuning.targets), lora_dropout=0.0,
                          bias="none", fan_in_fan_out=False, use_rslora=False, use_dora=False, modules_to_save=None)
            weights = {f"{PEFT_PREFIX}{name}.weight": p for name, p in self.named_remote()}
        else:
            config.update(num_virtual_tokens=tuning.prompt_tokens, token_dim=self.soft_prompt.shape[1],
                          num_transformer_submodules=1, prompt_tuning_init="RANDOM")
            weights = {SOFT_PROMPT_KEY: self.soft_prompt, **dict(self.named_remote())}
        save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(folder / WEIGHTS_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, config: PretrainedConfig, base_model: ModelSource) -> Adapter:
        """Read an adapter saved by `save` (or by PEFT, for LoRA and prompt tuning), checking that
        it fits this model."""
        folder = Path(path)
        try:
            saved = json.loads((folder / CONFIG_FILE).read_text())
            weights = load_file(str(folder / WEIGHTS_FILE))
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read the adapter in {folder}: {exc}") from exc
        tuning = _tuning_of(saved, folder)
        adapter = cls(config, tuning)
        expected = {SOFT_PROMPT_KEY: adapter.soft_prompt} if adapter.soft_prompt is not None else {}
        prefix = PEFT_PREFIX if tuning.mode == LORA else ""
        expected.update({f"{prefix}{name}.weight" if prefix else name: p for name, p in adapter.named_remote()})
        unknown = sorted(set(weights) - set(expected))
        if unknown:
            raise ModelError(f"the adapter in {folder} does not fit this model: it has {unknown[0]}, which this model lacks")
        for key, param in expected.items():
            if key not in weights:
                raise ModelError(f"the adapter in {folder} does not fit this model: {key} is missing")
            if weights[key].shape != param.shape:
                raise ModelError(
                    f"the adapter in {folder} does not fit this model: {key} is {list(weights[key].shape)}, "
                    f"this model needs {list(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(weights[key])
        trained_on = saved.get(MODEL_KEY_FIELD)
        if trained_on is not None and trained_on != base_model.key:  # it fits, but other weights may need other values
            log.warning("the adapter in %s was trained on other weights (%s, key %s) than %s (key %s)",
                        folder, saved.get("base_model_name_or_path"), trained_on, base_model.name, base_model.key)
        return adapter


def _tuning_of(saved: dict, folder: Path) -> TuningConfig:
    modes = {peft: mode for mode, peft in PEFT_TYPES.items()}
    mode = modes.get(saved.get("peft_type"))
    if mode is None:
        raise ModelError(f"the adapter in {folder} is of type {saved.get('peft_type')!r}; supported: {', '.join(modes)}")
    try:
        if mode == LORA:
            targets = saved["target_modules"]
            targets = (targets,) if isinstance(targets, str) else tuple(targets)
            return TuningConfig(mode, rank=int(saved["r"]), alpha=float(saved["lora_alpha"]), targets=targets)
        return TuningConfig(mode, prompt_tokens=int(saved["num_virtual_tokens"]))
    except (KeyError, TypeError, ValueError, RequestError) as exc:
        raise ModelError(f"the adapter config in {folder} is invalid: {exc}") from exc


def _prompt_init(embeddings: nn.Embedding | None, tokens: int, hidden: int) -> torch.Tensor:
    """Start from the embeddings of random vocabulary tokens, a common and stable choice."""
    if embeddings is None:
        return torch.zeros(tokens, hidden)
    ids = torch.randint(0, embeddings.num_embeddings, (tokens,))
    with torch.no_grad():
        return embeddings(ids).detach().float().clone()
