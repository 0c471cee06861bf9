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
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
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
from p2pfusion.models.tuning import StageParams, applied
from p2pfusion.models.cache_arg import cache_arg
from p2pfusion.models.fingerprint import weight_files
from p2pfusion.models.formats import (
    LAYER_PREFIX, QUANTS, WeightFormat, is_weight, linear_names, quantize, stored_bytes, trim_heap, weight_format,
    weight_storages,
)
from p2pfusion.models.kv_cache import SessionCache, batchable, batched_step
from p2pfusion.models.source import ModelSource



def load_config(source: ModelSource) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(source.folder)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot read the config of {source.name}: {exc}") from exc


def max_positions(config: PretrainedConfig) -> int:
    """The positions a model takes, as its config says (every supported family's does)."""
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise ModelError("the model's config does not say how many positions it takes (max_position_embeddings)")
    return positions


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
    leaves: list[torch.Tensor]  # the input, then the session's parameters
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
    format: WeightFormat = WeightFormat.FLOAT32

    views: dict[int, Stage] = field(default_factory=dict, repr=False, compare=False)

    def first_layers(self, end: int) -> Stage:
        """Layers [start, end) of this stage, sharing its weights: a session whose route leaves this
        peer before its last layer runs only those (and caches only those). One view per `end`,
        so sessions of the same view batch together."""
        if not self.start < end <= self.end:
            raise ValueError(f"layers {self.start}:{end} are not the first ones of {self.start}:{self.end}")
        if end == self.end:
            return self
        if end not in self.views:
            view = copy.copy(self.module)
            # its own registry of the same submodules, with fewer layers; and a config that says so
            # (the family's forward runs `layers[:num_hidden_layers]` and sizes caches from it)
            object.__setattr__(view, "_modules", dict(self.module._modules))
            view._modules["layers"] = nn.ModuleList(self.module.layers[: end - self.start])
            view.config = _sliced_config(self.module.config, 0, end - self.start)
            self.views[end] = replace(self, end=end, module=view, views={})
        return self.views[end]

    @property
    def trains_weights(self) -> bool:
        """A training replica's: its backward passes add its weights' gradients to their `.grad`."""
        return any(p.requires_grad for p in self.module.parameters())

    @property
    def quantized_on_cpu(self) -> bool:
        """Its forwards dequantize weights into temporaries that the C heap keeps (see `trim_heap`)."""
        return self.format in QUANTS and self.device.type == "cpu"

    def new_cache(self) -> SessionCache | DynamicCache:
        if self.batchable:
            return SessionCache(self.end - self.start)
        return DynamicCache(config=self.module.config)

    def _run(self, hidden, offset, cache, attention_mask, position_ids, params) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(offset, offset + hidden.shape[1], device=self.device).unsqueeze(0)
        with applied(self.module, params, offset):
            return self.module(
                inputs_embeds=hidden.to(self.device, self.dtype),
                attention_mask=None if attention_mask is None else attention_mask.to(self.device),
                position_ids=position_ids.to(self.device),
                use_cache=cache is not None,
                **{cache_arg(type(self.module).forward): cache},
            ).last_hidden_state.to(hidden.dtype)  # hidden states travel in the sender's dtype, whatever ours

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        offset: int,
        cache: DynamicCache | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        params: StageParams | None = None,
    ) -> torch.Tensor:
        """Run hidden states [batch, tokens, hidden] whose first token is the sequence's `offset`-th.

        `attention_mask` [batch, offset + tokens] marks padding (None: none); `position_ids`
        [batch, tokens] default to the sequence positions; `params` are the session's own (its client's adapter)."""
        return self._run(hidden, offset, cache, attention_mask, position_ids, params).cpu()

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
        # the same sessions in the same rows whatever order their steps came in: their padded
        # buffer is then kept from one step to the next (models/kv_cache.py)
        order = sorted(range(len(caches)), key=lambda i: id(caches[i]))
        hidden = [hidden[i] for i in order]
        rows = [h.shape[0] for h in hidden]
        step = batched_step([caches[i] for i in order], rows, hidden[0].shape[1], [masks[i] for i in order],
                            [positions[i] for i in order])
        out = self.module(
            inputs_embeds=torch.cat([h.to(self.dtype) for h in hidden]).to(self.device),
            attention_mask=step.attention_mask.to(self.device),
            position_ids=step.position_ids.to(self.device),
            use_cache=True,
            **{cache_arg(type(self.module).forward): step.cache},
        ).last_hidden_state.cpu()
        outputs = [part.to(h.dtype) for part, h in zip(out.split(rows), hidden)]
        return [outputs[order.index(i)] for i in range(len(order))]

    def forward_for_backward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        params: StageParams | None = None,
    ) -> Graph:
        """A full-sequence forward that keeps its autograd graph, and how many bytes of activations
        the graph holds (the weights it refers to are not counted: they exist anyway)."""
        weights = weight_storages(self.module)
        held = 0

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal held
            if not is_weight(tensor, weights):
                held += tensor.numel() * tensor.element_size()
            return tensor

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            inputs = hidden.detach().to(self.device).requires_grad_(True)
            leaves = [] if params is None else [t.detach().to(self.device).requires_grad_(True) for t in params.tensors]
            trained = None if params is None else params.with_tensors(leaves)
            out = self._run(inputs, 0, None, attention_mask, position_ids, trained)
        return Graph(out, [inputs, *leaves], held)

    def backward(self, graph: Graph, grad_output: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The gradients of a forward's input and of the session's parameters, given its output's.
        A training replica's weights (those that require grad) add theirs to their `.grad`."""
        weights = [p for p in self.module.parameters() if p.requires_grad]
        wanted = [*graph.leaves, *weights]
        grads = torch.autograd.grad(graph.output, wanted, grad_output.to(self.device), allow_unused=True)
        for weight, g in zip(weights, grads[len(graph.leaves):]):
            if g is not None:
                weight.grad = g if weight.grad is None else weight.grad.add_(g)
        leaves = grads[:len(graph.leaves)]
        params = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(graph.leaves[1:], leaves[1:])]
        return leaves[0].cpu(), [g.cpu() for g in params]

    def parameter_bytes(self) -> int:
        """Bytes its weights take, as stored (a quantized weight's packed data and scales)."""
        return stored_bytes(self.module)


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Which file holds each tensor (from the headers only: no weight is read)."""
    files = {}
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            files.update((key, path) for key in f.keys())
    return files


def _read(
    files: dict[str, Path], wanted: dict[str, str], dtype: torch.dtype, own: bool = False
) -> dict[str, torch.Tensor]:
    """Tensors `wanted` (file name -> module name), each converted to `dtype` as it is read, so a
    half-precision peer never holds a float32 copy of more than one tensor. A tensor in the file's
    own format stays a view of its memory-mapped file unless `own`: then it is copied out, so that
    nothing keeps the mapping (and every page read through it, counted in the process's resident
    memory) once the tensors are replaced, as quantized layers' are."""
    weights = {}
    by_file: dict[Path, list[str]] = {}
    for key in wanted:
        by_file.setdefault(files[key], []).append(key)
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                tensor = f.get_tensor(key)
                converted = tensor.to(dtype) if tensor.is_floating_point() else tensor
                weights[wanted[key]] = converted.clone() if own and converted is tensor else converted
    return weights


def _progress(total: int, what: str) -> tqdm:
    return tqdm(total=total, desc=f"loading {what}", unit="layer", leave=False, file=sys.stderr,
                disable=not sys.stderr.isatty())


def _check_complete(module: nn.Module, names, what: str) -> None:
    missing = {n for n, _ in module.named_parameters()} - set(names)
    if missing:
        raise ModelError(f"weights missing for {what}: {sorted(missing)[:3]}")


def _load_quantized(
    layer: nn.Module, files: dict[str, Path], wanted: dict[str, str], dtype: torch.dtype, quant: WeightFormat,
    device: str,
) -> None:
    """Read one linear layer's tensors at a time and quantize it before reading the next, so that
    loading holds one float32 matrix (and its quantizer's temporaries) beyond what the stage keeps;
    a whole float32 layer at once had put a 400M int8 peer's peak 200 MiB over its budget."""
    linears = linear_names(layer)
    groups: dict[str, dict[str, str]] = {}
    for key, name in wanted.items():
        owner = name.rpartition(".")[0]
        groups.setdefault(owner if owner in linears else "", {})[key] = name
    for owner, keys in groups.items():
        layer.load_state_dict(_read(files, keys, dtype, own=True), strict=False, assign=True)
        if owner:
            parent, _, child = owner.rpartition(".")
            quantize(layer.get_submodule(parent), child, quant, dtype, device)
            trim_heap()  # the float32 copy and the quantizer's temporaries: given back, not kept


def _frozen(module: nn.Module, device: str, dtype: torch.dtype | None) -> nn.Module:
    """Moved to `device` (and buffers too to `dtype`, as transformers' own loading does), for inference."""
    module.to(device=device, dtype=dtype)
    module.eval()
    module.requires_grad_(False)
    return module


def load_stage(
    source: ModelSource, start: int, end: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
    quant: WeightFormat | None = None, reuse: Stage | None = None,
) -> Stage:
    """Layers [start, end) computing in `dtype`, their linear weights quantized to `quant` if given.
    Layers are read one at a time (a quantized one matrix by matrix), so loading never holds more
    than one layer in a wider format than the stage keeps: in resident memory too (see `_read`).
    The layers that `reuse`, a stage of the same model in the same format, holds are shared with
    it, not read again: a peer moving a few layers over loads only those (`reused`)."""
    config = load_config(source)
    total = config.num_hidden_layers
    if not 0 <= start < end <= total:
        raise ModelError(f"layer range {start}:{end} is out of bounds for {source.name} (0:{total})")
    sliced = _sliced_config(config, start, end)
    with no_init_weights():
        module = AutoModel.from_config(_without_vocab(sliced))
    module.embed_tokens = _Passthrough()
    module.norm = _Passthrough()
    fmt = quant if quant is not None else weight_format(dtype, None)
    kept = reused(reuse, start, end, fmt, dtype, torch.device(device))
    for index, layer in kept.items():
        module.layers[index - start] = layer
    files = _tensor_files(source.folder)
    by_layer: dict[int, dict[str, str]] = {}
    for key in files:
        if key.startswith(LAYER_PREFIX):
            index, rest = key[len(LAYER_PREFIX):].split(".", 1)
            if start <= int(index) < end and int(index) not in kept:
                by_layer.setdefault(int(index), {})[key] = rest
    with _progress(end - start - len(kept), f"layers {start}:{end}") as bar:
        for index in range(start, end):
            if index in kept:
                continue
            layer, wanted = module.layers[index - start], by_layer.get(index, {})
            _check_complete(layer, wanted.values(), f"layer {index}")
            if quant is None:
                layer.load_state_dict(_read(files, wanted, dtype), strict=False, assign=True)
            else:
                _load_quantized(layer, files, wanted, dtype, quant, device)
            bar.update()
    _frozen(module, device, dtype if quant is None else None)
    return Stage(start, end, module, dtype, config.hidden_size, torch.device(device), batchable(sliced), fmt)


def reused(
    stage: Stage | None, start: int, end: int, fmt: WeightFormat, dtype: torch.dtype, device: torch.device,
) -> dict[int, nn.Module]:
    """The layers of [start, end) that `stage` holds in the same format, by index, each ready to sit
    at its place in a stage starting at `start`: the same weights, in modules renumbered for that
    stage's caches (the stage itself keeps serving its own sessions with its own numbering)."""
    if stage is None or (stage.format, stage.dtype, stage.device) != (fmt, dtype, device):
        return {}
    shared = range(max(start, stage.start), min(end, stage.end))
    return {index: _renumbered(stage.module.layers[index - stage.start], index - start) for index in shared}


def _renumbered(module: nn.Module, index: int) -> nn.Module:
    """`module` sharing its weights, hooks and state, with its own tree of submodules, in which
    those that know their layer's place in the stage (attention, for its cache) know `index`."""
    clone = copy.copy(module)
    children = {name: None if child is None else _renumbered(child, index) for name, child in module._modules.items()}
    object.__setattr__(clone, "_modules", children)
    if "layer_idx" in vars(module):
        object.__setattr__(clone, "layer_idx", index)
    return clone


def load_head(source: ModelSource, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The client's causal-LM model with zero layers: embeddings, final norm, lm_head."""
    config = load_config(source)
    head_config = _sliced_config(config, 0, 0)
    with no_init_weights():
        head = AutoModelForCausalLM.from_config(head_config)

    files = _tensor_files(source.folder)
    weights = _read(files, {key: key for key in files if not key.startswith(LAYER_PREFIX)}, dtype)
    if "lm_head.weight" not in weights and getattr(config, "tie_word_embeddings", False):
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    _check_complete(head, weights, "the embeddings and LM head")
    head.load_state_dict(weights, strict=False, assign=True)
    return _frozen(head, "cpu", dtype)


def write_model(source: ModelSource, layers: dict[str, torch.Tensor], path: Path) -> None:
    """A Hugging Face folder of `source` with its decoder layers' tensors replaced by `layers` (by
    their names in the files): the other tensors, the config, tokenizer and notices as they are."""
    files = _tensor_files(source.folder)
    missing = {key for key in files if key.startswith(LAYER_PREFIX)} - set(layers)
    if missing:
        raise ModelError(f"no trained value for {sorted(missing)[0]} (and {len(missing) - 1} more)")
    tensors = _read(files, {key: key for key in files if not key.startswith(LAYER_PREFIX)}, torch.float32)
    tensors.update(layers)
    path.mkdir(parents=True, exist_ok=True)
    for item in source.folder.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name != "model.safetensors.index.json":
            shutil.copy2(item, path / item.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
