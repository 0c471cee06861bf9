"""A user's trainable parameters on a stage's frozen layers: LoRA on the layers' projections and
deep prompts added before the layers.

Parameters are named by their global layer, as `layers.{L}.{projection}.lora_A|lora_B` and
`layers.{L}.prompt`, so a client can hand each peer the part for its layers. Peers apply them per
step with forward hooks on transformers' own modules and remove them afterwards: the shared
weights are never changed, and one session's parameters never reach another's step.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AutoModel, PretrainedConfig

from p2pfusion.errors import RequestError

PROMPT = "prompt"
DEEP_PROMPT = "deep_prompt"
LORA = "lora"
TUNING_MODES = (PROMPT, DEEP_PROMPT, LORA)
MAX_RANK = 256
MAX_PROMPT_TOKENS = 256
DEFAULT_LORA_TARGETS = ("q_proj", "v_proj")


def layer_projections(config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """Every linear projection inside one decoder layer: path -> (in_features, out_features).

    One layer of the family's own model is built on the meta device, so the answer follows
    transformers' module tree for any architecture and costs no memory."""
    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    if getattr(one, "layer_types", None) is not None:
        one.layer_types = list(one.layer_types[:1])
    one.vocab_size = 1
    one.pad_token_id = None
    with torch.device("meta"):
        model = AutoModel.from_config(one)
    prefix = "layers.0."
    return {
        name[len(prefix):]: (module.in_features, module.out_features)
        for name, module in model.named_modules()
        if name.startswith(prefix) and isinstance(module, nn.Linear)
    }


def resolve_targets(projections: dict[str, tuple[int, int]], targets: list[str] | tuple[str, ...]) -> list[str]:
    """LoRA targets given as PEFT does (a projection's last name, e.g. "q_proj") -> paths in a layer
    (`projections`: what layer_projections gives)."""
    paths = []
    for target in targets:
        found = [path for path in projections if path == target or path.endswith("." + target)]
        if not found:
            names = sorted({path.rsplit(".", 1)[-1] for path in projections})
            raise RequestError(f"unknown LoRA target {target!r}; this model's projections: {', '.join(names)}")
        paths.extend(p for p in found if p not in paths)
    return paths


def layer_of(name: str) -> int:
    """The global layer a parameter name belongs to."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
        raise RequestError(f"adapter parameter {name!r} is not named layers.<index>.<...>")
    return int(parts[1])


@dataclass
class StageParams:
    """The parameters a session gave this stage, checked against its modules; paths are local."""

    digest: str
    scaling: float
    names: list[str]  # global names, in the order gradients are sent back
    tensors: list[torch.Tensor]
    lora: dict[str, tuple[int, int]] = field(default_factory=dict)  # local module path -> (index of A, index of B)
    prompts: dict[int, int] = field(default_factory=dict)  # local layer -> index of its prompt

    def with_tensors(self, tensors: list[torch.Tensor]) -> StageParams:
        return StageParams(self.digest, self.scaling, self.names, tensors, self.lora, self.prompts)


def stage_params(
    module: nn.Module, start: int, end: int, entries: dict[str, torch.Tensor], scaling: float, digest: str
) -> StageParams:
    """Check a session's parameters for layers [start, end) against this stage's own modules."""
    if not 0 < abs(scaling) < 1e4:
        raise RequestError(f"adapter: LoRA scaling must be a nonzero number below 1e4, got {scaling}")
    params = StageParams(digest, scaling, list(entries), list(entries.values()))
    hidden = module.config.hidden_size
    rank = None
    for index, (name, tensor) in enumerate(entries.items()):
        layer = layer_of(name)
        if not start <= layer < end:
            raise RequestError(f"adapter parameter {name} is for a layer outside {start}:{end}")
        rest = name.split(".", 2)[2]
        local = f"layers.{layer - start}"
        if rest == PROMPT:
            if tensor.dim() != 2 or tensor.shape[1] != hidden or not 0 < tensor.shape[0] <= MAX_PROMPT_TOKENS:
                raise RequestError(f"adapter: {name} must be [1..{MAX_PROMPT_TOKENS}, {hidden}], got {list(tensor.shape)}")
            params.prompts[layer - start] = index
            continue
        path, _, which = rest.rpartition(".")
        target = _submodule(module, f"{local}.{path}")
        if which not in ("lora_A", "lora_B") or not isinstance(target, nn.Linear):
            raise RequestError(f"adapter parameter {name} names no LoRA matrix of a linear projection")
        r = tensor.shape[0] if which == "lora_A" else tensor.shape[-1]
        want = [r, target.in_features] if which == "lora_A" else [target.out_features, r]
        if list(tensor.shape) != want or not 0 < r <= MAX_RANK or rank not in (None, r):
            raise RequestError(f"adapter: {name} must be {want} with one rank in 1..{MAX_RANK}, got {list(tensor.shape)}")
        rank = r
        pair = params.lora.get(f"{local}.{path}", (-1, -1))
        params.lora[f"{local}.{path}"] = (index, pair[1]) if which == "lora_A" else (pair[0], index)
    half = [path for path, pair in params.lora.items() if -1 in pair]
    if half:
        raise RequestError(f"adapter: {half[0]} has only one of lora_A and lora_B")
    lengths = {params.tensors[i].shape[0] for i in params.prompts.values()}
    if len(lengths) > 1:
        raise RequestError("adapter: deep prompts of different lengths")
    return params


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


@contextmanager
def applied(module: nn.Module, params: StageParams | None, offset: int) -> Iterator[None]:
    """Run `module` with a session's parameters: LoRA added to its projections' outputs, deep prompts added to
    the hidden states of sequence positions [0, prompt length) before their layers. `offset` is
    where this step's first token sits in its sequence (a KV cache holds the ones before)."""
    if params is None:
        yield
        return
    handles = []
    try:
        for path, (a, b) in params.lora.items():
            hook = _lora_hook(params.tensors[a], params.tensors[b], params.scaling)
            handles.append(module.get_submodule(path).register_forward_hook(hook))
        for layer, index in params.prompts.items():
            hook = _prompt_hook(params.tensors[index], offset)
            handles.append(module.get_submodule(f"layers.{layer}").register_forward_pre_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _lora_hook(lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float):
    def hook(_module, args, output):
        x = args[0]
        return output + ((x.to(lora_a.dtype) @ lora_a.T @ lora_b.T) * scaling).to(output.dtype)

    return hook


def _prompt_hook(prompt: torch.Tensor, offset: int):
    def hook(_module, args):
        hidden = args[0]
        count = min(prompt.shape[0] - offset, hidden.shape[1])
        if count <= 0:
            return None
        head = hidden[:, :count] + prompt[offset:offset + count].to(hidden.dtype)
        return (torch.cat([head, hidden[:, count:]], dim=1), *args[1:])

    return hook
