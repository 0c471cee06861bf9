"""Split a Hugging Face decoder-only model into a client head and pipeline stages.

Both halves are the family's own transformers modules, so a new architecture needs no
hand-written block code:
- a *stage* is the family's base model (e.g. LlamaModel) built with only layers [start, end),
  with no embedding and no final norm: hidden states in, hidden states out;
- the *head* is the family's causal-LM model built with zero layers: it embeds tokens, and turns
  the last stage's hidden states into logits with the model's own norm, lm_head and soft-capping.
Only the weights of the modules built are read from disk.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    DynamicCache,
    PretrainedConfig,
)
from transformers.initialization import no_init_weights

from p2pfusion.errors import ModelError
from p2pfusion.models.adapters import StageAdapter, applied
from p2pfusion.models.fingerprint import weight_files
from p2pfusion.models.kv_cache import SessionCache, batchable, batched_step
from p2pfusion.models.source import ModelSource

LAYER_PREFIX = "model.layers."


def load_config(source: ModelSource) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(source.folder)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot read the config of {source.name}: {exc}") from exc


def _sliced_config(config: PretrainedConfig, start: int, end: int) -> PretrainedConfig:
    """A config for layers [start, end) renumbered from 0, so caches and masks index locally."""
    sliced = copy.deepcopy(config)
    sliced.num_hidden_layers = end - start
    if getattr(config, "layer_types", None) is not None:
        sliced.layer_types = list(config.layer_types[start:end])
    return sliced


def _without_vocab(config: PretrainedConfig) -> PretrainedConfig:
    """A stage never embeds tokens, so it need not allocate a vocabulary-sized table."""
    small = copy.deepcopy(config)
    small.vocab_size = 1
    small.pad_token_id = None
    return small


class _Passthrough(nn.Module):
    """Stands where a stage has no embedding or final norm: those live on the client."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


@dataclass
class Graph:
    """A training forward's output with its autograd graph, until its backward pass."""

    output: torch.Tensor
    leaves: list[torch.Tensor]  # the input, then the adapter's parameters
    nbytes: int  # activations it holds


@dataclass
class Stage:
    """Layers [start, end) of a model, ready to run with a KV cache."""

    start: int
    end: int
    module: nn.Module
    dtype: torch.dtype
    hidden_size: int
    device: torch.device = torch.device("cpu")
    batchable: bool = False  # sessions' steps may run as one batch (models.kv_cache)

    def new_cache(self) -> SessionCache | DynamicCache:
        if self.batchable:
            return SessionCache(self.end - self.start)
        return DynamicCache(config=self.module.config)

    def _run(self, hidden, offset, cache, attention_mask, position_ids, adapter) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(offset, offset + hidden.shape[1], device=self.device).unsqueeze(0)
        with applied(self.module, adapter, offset):
            return self.module(
                inputs_embeds=hidden.to(self.device),
                attention_mask=None if attention_mask is None else attention_mask.to(self.device),
                position_ids=position_ids.to(self.device),
                past_key_values=cache,
                use_cache=cache is not None,
            ).last_hidden_state

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        offset: int,
        cache: DynamicCache | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        adapter: StageAdapter | None = None,
    ) -> torch.Tensor:
        """Run hidden states [batch, tokens, hidden] whose first token is the sequence's `offset`-th.

        `attention_mask` [batch, offset + tokens] marks padding (None: none); `position_ids`
        [batch, tokens] default to the sequence positions; `adapter` is the session's own."""
        return self._run(hidden, offset, cache, attention_mask, position_ids, adapter).cpu()

    @torch.inference_mode()
    def forward_batch(
        self,
        hidden: list[torch.Tensor],
        caches: list[SessionCache],
        masks: list[torch.Tensor | None],
        positions: list[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """Steps of several sessions (the same number of tokens each, each after its own cache) as
        one forward; each session's output, as `forward` would give it alone (within float
        rounding: the padded batch sums in another order)."""
        rows = [h.shape[0] for h in hidden]
        step = batched_step(caches, rows, hidden[0].shape[1], masks, positions)
        out = self.module(
            inputs_embeds=torch.cat(hidden).to(self.device),
            attention_mask=step.attention_mask.to(self.device),
            position_ids=step.position_ids.to(self.device),
            past_key_values=step.cache,
            use_cache=True,
        ).last_hidden_state.cpu()
        return list(out.split(rows))

    def forward_for_backward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        adapter: StageAdapter | None = None,
    ) -> Graph:
        """A full-sequence forward that keeps its autograd graph, and how many bytes of activations
        the graph holds (the weights it refers to are not counted: they exist anyway)."""
        weights = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        held = 0

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal held
            if tensor.untyped_storage().data_ptr() not in weights:
                held += tensor.numel() * tensor.element_size()
            return tensor

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            inputs = hidden.detach().to(self.device).requires_grad_(True)
            leaves = [] if adapter is None else [t.detach().to(self.device).requires_grad_(True) for t in adapter.tensors]
            trained = None if adapter is None else adapter.with_tensors(leaves)
            out = self._run(inputs, 0, None, attention_mask, position_ids, trained)
        return Graph(out, [inputs, *leaves], held)

    def backward(self, graph: Graph, grad_output: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The gradients of a forward's input and of the adapter's parameters, given its output's."""
        grads = torch.autograd.grad(graph.output, graph.leaves, grad_output.to(self.device), allow_unused=True)
        params = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(graph.leaves[1:], grads[1:])]
        return grads[0].cpu(), [g.cpu() for g in params]

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())


def _read_weights(folder: Path, rename) -> dict[str, torch.Tensor]:
    """Read only the tensors that `rename` maps to a name (it returns None for the others)."""
    weights = {}
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            wanted = [(key, rename(key)) for key in f.keys()]
            wanted = [(key, new_key) for key, new_key in wanted if new_key is not None]
            for key, new_key in tqdm(wanted, desc=f"loading {path.name}", unit="tensor", leave=False, file=sys.stderr,
                                      disable=not sys.stderr.isatty()):
                weights[new_key] = f.get_tensor(key)
    return weights


def _materialize(module: nn.Module, weights: dict[str, torch.Tensor], dtype: torch.dtype, what: str) -> None:
    missing = {n for n, _ in module.named_parameters()} - set(weights)
    if missing:
        raise ModelError(f"weights missing for {what}: {sorted(missing)[:3]}")
    module.load_state_dict(weights, strict=False, assign=True)
    module.to(dtype)
    module.eval()
    module.requires_grad_(False)


def load_stage(
    source: ModelSource, start: int, end: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Stage:
    config = load_config(source)
    total = config.num_hidden_layers
    if not 0 <= start < end <= total:
        raise ModelError(f"layer range {start}:{end} is out of bounds for {source.name} (0:{total})")
    sliced = _sliced_config(config, start, end)
    with no_init_weights():
        module = AutoModel.from_config(_without_vocab(sliced))
    module.embed_tokens = _Passthrough()
    module.norm = _Passthrough()

    def rename(key: str) -> str | None:
        if not key.startswith(LAYER_PREFIX):
            return None
        index, rest = key[len(LAYER_PREFIX):].split(".", 1)
        if start <= int(index) < end:
            return f"layers.{int(index) - start}.{rest}"
        return None

    _materialize(module, _read_weights(source.folder, rename), dtype, f"layers {start}:{end}")
    module.to(device)
    return Stage(start, end, module, dtype, config.hidden_size, torch.device(device), batchable(sliced))


def load_head(source: ModelSource, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The client's causal-LM model with zero layers: embeddings, final norm, lm_head."""
    config = load_config(source)
    head_config = _sliced_config(config, 0, 0)
    with no_init_weights():
        head = AutoModelForCausalLM.from_config(head_config)

    def rename(key: str) -> str | None:
        return None if key.startswith(LAYER_PREFIX) else key

    weights = _read_weights(source.folder, rename)
    if "lm_head.weight" not in weights and getattr(config, "tie_word_embeddings", False):
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    _materialize(head, weights, dtype, "the embeddings and LM head")
    return head
