"""The formats a peer may hold its layers in, what each costs in memory, and how to make them.

A format is what a peer announces and a client chooses by: float32 (what transformers computes,
token-identical), bfloat16 or float16 (half the memory, rounding on every operation), int8 or
int4 (weights quantized by a maintained library; activations stay in the compute dtype):
- int8: torchao's weight-only int8 (one scale per output row), on CPU and CUDA;
- int4: bitsandbytes' NF4 with blocks of 64 (what QLoRA and Petals use), on CPU and CUDA.
Layers are quantized one at a time as they load, so a peer never holds its whole range at full
precision: what fits a peer is decided by the quantized size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import math
from enum import Enum
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from p2pfusion.errors import ModelError, RequestError
from p2pfusion.models.fingerprint import weight_files

class WeightFormat(str, Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    INT8 = "int8"
    INT4 = "int4"


# How close a format comes to float32, for clients that set a floor: higher is closer (the two
# half-precision formats trade range for mantissa, and rank equal).
PRECISION = {
    WeightFormat.FLOAT32: 3, WeightFormat.BFLOAT16: 2, WeightFormat.FLOAT16: 2,
    WeightFormat.INT8: 1, WeightFormat.INT4: 0,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTS = (WeightFormat.INT8, WeightFormat.INT4)
LAYER_PREFIX = "model.layers."
SAFETENSORS_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
NF4_BLOCK = 64
# Bytes per weight of a linear layer's matrix once quantized: int8 stores a byte and one float32
# scale per row; NF4 half a byte, and per block of 64 an absmax (itself quantized to a byte, with a
# float32 per 256 blocks).
QUANTIZED_BYTES = {WeightFormat.INT8: 1.0, WeightFormat.INT4: 0.5 + 1 / NF4_BLOCK}


def weight_format(dtype: torch.dtype, quant: str | None) -> WeightFormat:
    if quant is not None:
        return WeightFormat(quant)
    names = {v: k for k, v in DTYPES.items()}
    return WeightFormat(names[dtype])


def parse_format(text: str) -> WeightFormat | None:
    """A format named in a record from another peer; None for a name this version does not know."""
    try:
        return WeightFormat(text)
    except ValueError:
        return None


def accepts(text: str, minimum: WeightFormat) -> bool:
    """Does a client whose floor is `minimum` take a peer announcing format `text`?"""
    announced = parse_format(text)
    return announced is not None and PRECISION[announced] >= PRECISION[minimum]


def matrix_bytes(shape: list[int], stored: torch.dtype, fmt: WeightFormat, compute: torch.dtype) -> int:
    """Bytes a tensor of `shape` takes once loaded in `fmt` (computing in `compute`); `stored` is
    its dtype on disk, kept for integer tensors."""
    count = math.prod(shape)
    if not stored.is_floating_point:
        return count * stored.itemsize
    if fmt in QUANTS and len(shape) == 2:
        return math.ceil(count * QUANTIZED_BYTES[fmt]) + 4 * shape[0]
    return count * compute.itemsize


def linear_names(module: nn.Module) -> set[str]:
    """The qualified names of a module's plain linear layers: the ones a quantized format packs."""
    return {name for name, child in module.named_modules() if type(child) is nn.Linear}


def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        return None


_TRIM = _malloc_trim()


def trim_heap() -> None:
    """Return the heap's free pages to the system. glibc keeps large freed blocks in its heap once
    it has seen a few (its mmap threshold grows): a quantized layer's float32 weights and the
    quantizer's temporaries, freed KV caches. A peer quantizing 24 layers of 64 MiB to int8 peaked
    at 4.6 GiB, for 385 MiB of weights, before it trimmed after each matrix (docs/benchmarks.md)."""
    if _TRIM is not None:
        _TRIM(0)


def load_quantizer(fmt: WeightFormat) -> None:
    """Import the library that makes `fmt`, if any: before a peer counts the memory it holds (torchao
    is some 80 MiB), so its budget counts it."""
    if fmt == WeightFormat.INT8:
        importlib.import_module("torchao.quantization")
    elif fmt == WeightFormat.INT4:
        try:
            importlib.import_module("bitsandbytes")
        except ImportError as exc:
            raise ModelError(f"int4 needs bitsandbytes: {exc}") from exc


def quantize(parent: nn.Module, name: str, fmt: WeightFormat, compute: torch.dtype, device: str) -> None:
    """Quantize the linear layer `parent.<name>` in place, moving it to `device`."""
    linear = getattr(parent, name)
    if fmt == WeightFormat.INT8:
        linear.to(device)
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(linear, Int8WeightOnlyConfig())
    elif fmt == WeightFormat.INT4:
        setattr(parent, name, _nf4(linear, compute, device))
    else:
        raise ModelError(f"{fmt.value} is not a quantized format")


def _nf4(linear: nn.Linear, compute: torch.dtype, device: str) -> nn.Module:
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        raise ModelError(f"int4 needs bitsandbytes: {exc}") from exc
    packed = bnb.nn.Linear4bit(
        linear.in_features, linear.out_features, linear.bias is not None, compute_dtype=compute,
        quant_type="nf4", device="meta",
    )
    packed.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4", blocksize=NF4_BLOCK)
    if linear.bias is not None:
        packed.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return packed.to(device)  # bitsandbytes quantizes on this move


def stored_bytes(module: nn.Module) -> int:
    """Bytes a module's weights and buffers take as stored: a quantized tensor's packed data and its
    scales, not the size of the matrix it stands for."""
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        inner = getattr(tensor, "tensor_data_names", None)  # torchao's quantized tensors
        if inner is not None:
            total += sum(getattr(tensor, name).nbytes for name in inner)
            continue
        total += tensor.numel() * tensor.element_size()
        state = getattr(tensor, "quant_state", None)  # bitsandbytes' blocks' scales
        if state is not None:
            total += sum(t.nbytes for t in _state_tensors(state))
    return total


def _state_tensors(state) -> list[torch.Tensor]:
    found = [state.absmax]
    nested = getattr(state, "state2", None)
    if nested is not None:
        found.append(nested.absmax)
    return [t for t in found if isinstance(t, torch.Tensor)]


def weight_storages(module: nn.Module) -> set[int]:
    """The data pointers of a module's plain weights (see `is_weight`)."""
    return {p.untyped_storage().data_ptr() for p in module.parameters() if not _packed(p)}


def is_weight(tensor: torch.Tensor, storages: set[int]) -> bool:
    """Is this tensor (one autograd saved) a weight, rather than an activation?"""
    return _packed(tensor) or tensor.untyped_storage().data_ptr() in storages


def _packed(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "tensor_data_names")  # torchao's quantized tensors have no storage of their own


def _layer_headers(folder: Path):
    """(layer index, tensor name, header slice) of every decoder-layer tensor: headers only, no weight read."""
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith(LAYER_PREFIX):
                    yield int(key[len(LAYER_PREFIX):].split(".", 1)[0]), key, f.get_slice(key)


def layer_sizes(folder: Path, num_layers: int, fmt: WeightFormat, compute: torch.dtype) -> list[int]:
    """Bytes each decoder layer's weights will take in `fmt`, from the safetensors headers alone
    (no weight is read), so a peer knows what fits before it loads anything."""
    sizes = [0] * num_layers
    for index, _, piece in _layer_headers(folder):
        if 0 <= index < num_layers:
            stored = SAFETENSORS_DTYPES.get(piece.get_dtype(), torch.float32)
            sizes[index] += matrix_bytes(list(piece.get_shape()), stored, fmt, compute)
    return sizes


def layer_shapes(folder: Path, start: int, end: int) -> dict[str, list[int]]:
    """The shape of every tensor of layers [start, end), by its name in the files."""
    return {key: list(piece.get_shape()) for index, key, piece in _layer_headers(folder) if start <= index < end}


def minimum_format(text: str | WeightFormat) -> WeightFormat:
    """A client's floor, as the user named it; a RequestError naming the choices otherwise."""
    try:
        return WeightFormat(text)
    except ValueError:
        names = ", ".join(f.value for f in WeightFormat)
        raise RequestError(f"unknown weight format {text!r}; choose one of {names}") from None


def load_settings(fmt: WeightFormat, compute: torch.dtype = torch.float32) -> tuple[torch.dtype, WeightFormat | None]:
    """The dtype and the quantization `load_stage` takes to hold layers in `fmt` (a quantized
    format computes in `compute`)."""
    if fmt in QUANTS:
        return compute, fmt
    return DTYPES[fmt.value], None
