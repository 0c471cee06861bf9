"""Tensor codecs for the wire: how a tensor becomes a frame's body, and back.

Error bounds, for x sent and y received (elementwise; NaN and +-inf always arrive as sent):
- none:      exact.
- float16:   |y - x| <= 2^-11 |x| + 2^-24 where |x| <= 65504; larger magnitudes arrive as +-65504.
- bfloat16:  |y - x| <= 2^-8 |x| + 2^-133 (bfloat16 keeps float32's range).
- int8:      |y - x| <= m / 254, m the largest |x| in x's block of 64 (flattened order) among the
             values quantized; values over OUTLIER_RMS times the tensor's RMS (a few channels of an
             LLM's hidden states reach 100 times it) arrive exactly, sent aside like NaN and inf.
- topk:      the k largest |x| arrive exactly, every other entry as 0. `ErrorFeedback` carries what
             was dropped into the next tensor, so nothing is lost over a run of steps. A frame may
             not decode to more than MAX_EXPANSION times its size (past the first MiB), so k is at
             least `min_topk` (1/32 of a float32 tensor's entries, under the 1/10 that training
             takes at least).
A spec (the frame header's description) comes from an untrusted sender: `unpack` checks every
field against the body and the caller's ceiling before it allocates or reads anything, and no
decode holds more than the decoded tensor, the body and a few MiB of scratch at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from p2pfusion.errors import RequestError
from p2pfusion.net.compression import Codec

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
BLOCK = 64
OUTLIER_RMS = 6.0
FLOAT16_MAX = 65504.0
BFLOAT16_MAX = torch.finfo(torch.bfloat16).max
MAX_DECODED_BYTES = 1 << 31
MAX_EXPANSION = 16  # decoded bytes per body byte a sparse frame may claim (beyond the first MiB)
MAX_DIMS = 8
DECODE_CHUNK = 1 << 18  # entries int8 dequantizes at once: its float32 scratch stays at a few MiB


class CodecError(RequestError):
    """A frame's tensor description is malformed or does not match its bytes."""


@dataclass(frozen=True)
class Packed:
    spec: dict[str, Any]  # travels in the frame header
    parts: list[memoryview]  # travel, concatenated, as the frame body

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def body(self) -> bytearray:
        """The parts as one buffer, as a receiver reads them."""
        return bytearray().join(self.parts)


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's own buffer as bytes, with no copy (bfloat16 has no numpy type: viewed as int16)."""
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return memoryview(tensor.numpy().reshape(-1)).cast("B")


def pack(tensor: torch.Tensor, codec: Codec = Codec.NONE, k: int | None = None) -> Packed:
    tensor = tensor.detach().cpu()
    if tensor.dtype not in DTYPE_NAMES:
        raise RequestError(f"cannot send tensors of dtype {tensor.dtype}")
    if codec != Codec.NONE and not tensor.dtype.is_floating_point:
        codec = Codec.NONE  # lossy codecs are for activations and gradients, never for ids
    spec: dict[str, Any] = {"codec": codec.value, "dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape)}
    flat = tensor.reshape(-1)
    if codec == Codec.NONE:
        parts = [_bytes(flat)]
    elif codec == Codec.FLOAT16:
        parts = [_bytes(_clamp_finite(flat, FLOAT16_MAX).to(torch.float16))]
    elif codec == Codec.BFLOAT16:
        parts = [_bytes(_clamp_finite(flat, BFLOAT16_MAX).to(torch.bfloat16))]
    elif codec == Codec.INT8:
        parts = _pack_int8(flat)
    elif codec == Codec.TOPK:
        k = flat.numel() if k is None else max(min(int(k), flat.numel()), min_topk(flat.numel(), tensor.dtype))
        spec["k"] = k
        parts = _pack_topk(flat, k)
    else:
        raise RequestError(f"unknown codec {codec!r}")
    spec["parts"] = [p.nbytes for p in parts]
    return Packed(spec, parts)


def _clamp_finite(x: torch.Tensor, limit: float) -> torch.Tensor:
    if not x.numel() or torch.finfo(x.dtype).max <= limit:
        return x
    return torch.where(torch.isfinite(x), x.clamp(-limit, limit), x)


def _pack_int8(flat: torch.Tensor) -> list[memoryview]:
    x = flat.float()
    finite = torch.isfinite(x)
    x = x.masked_fill(~finite, 0.0)
    rms = x.pow(2).mean().sqrt() if x.numel() else x.new_zeros(())
    aside = ~finite | (x.abs() > OUTLIER_RMS * rms)
    exc_index = aside.nonzero().reshape(-1)
    if exc_index.numel():
        x = x.masked_fill(aside, 0.0)  # sent aside exactly; kept out of the block scales
    blocks = torch.nn.functional.pad(x, (0, -x.numel() % BLOCK)).view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1) / 127.0
    q = torch.round(blocks / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).clamp_(-127, 127)
    q = q.to(torch.int8).reshape(-1)[: x.numel()]
    return [_bytes(q), _bytes(scales), _bytes(exc_index), _bytes(flat[exc_index])]


def _pack_topk(flat: torch.Tensor, k: int) -> list[memoryview]:
    magnitude = flat.float().abs().nan_to_num(nan=math.inf)  # non-finite entries are always kept
    index = torch.topk(magnitude, k, sorted=False).indices if k < flat.numel() else torch.arange(flat.numel())
    index = index.sort().values.to(_index_dtype(flat.numel()))
    return [_bytes(index), _bytes(flat[index.long()])]


def min_topk(count: int, dtype: torch.dtype) -> int:
    """The fewest entries a top-k frame of `count` entries keeps, so that `unpack`'s limit on how
    much a frame may expand (a few bytes must not make a peer allocate gigabytes) lets it through."""
    decoded = count * dtype.itemsize
    if decoded <= 1 << 20:
        return 0
    per_entry = _index_dtype(count).itemsize + dtype.itemsize
    return min(count, -(-decoded // (MAX_EXPANSION * per_entry)))


def _index_dtype(count: int) -> torch.dtype:
    return torch.int32 if count < 2**31 else torch.int64


def _brief(value: Any) -> str:
    """A sender's value in an error message: one short line, whatever it sent."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_parts(spec: dict[str, Any], body_size: int, expected: list[int]) -> list[int]:
    parts = spec.get("parts")
    if not (
        isinstance(parts, list)
        and len(parts) == len(expected)
        and all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in parts)
    ):
        raise CodecError(f"tensor description has malformed part sizes {_brief(parts)}")
    if sum(parts) != body_size:
        raise CodecError(f"tensor parts of {sum(parts)} B do not fit the {body_size} B body")
    if any(e >= 0 and p != e for p, e in zip(parts, expected)):
        raise CodecError(f"tensor parts {parts} do not fit codec {spec.get('codec')!r} and shape {_brief(spec.get('shape'))}")
    return parts


def _view(body: memoryview, offset: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    if size == 0:
        return torch.empty(0, dtype=dtype)
    if size % dtype.itemsize:
        raise CodecError(f"a part of {size} B is not a whole number of {dtype} values")
    raw_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    return torch.frombuffer(body, dtype=raw_dtype, count=size // dtype.itemsize, offset=offset).view(dtype)


def _shape(raw: Any) -> list[int]:
    if not (
        isinstance(raw, list)
        and len(raw) <= MAX_DIMS
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw)
        # an empty tensor's other dimensions too: torch overflows past int64 entries
        and math.prod(max(d, 1) for d in raw) <= MAX_DECODED_BYTES
    ):
        raise CodecError(f"invalid tensor shape {_brief(raw)}")
    return raw


def decoded_limit(max_decoded: int, body_bytes: int) -> int:
    """The most bytes a tensor decoded from a body of `body_bytes` may take."""
    return min(max_decoded, MAX_DECODED_BYTES, max(1 << 20, MAX_EXPANSION * body_bytes))


def declared(spec: Any, body_bytes: int, max_decoded: int = MAX_DECODED_BYTES) -> tuple[Codec, torch.dtype, list[int]]:
    """The codec, dtype and shape a tensor description declares, checked against the size of its
    body and the caller's ceiling on decoded bytes: a frame's reader calls it before reading the
    body, so a frame that claims too much costs nothing. CodecError says what is wrong."""
    if not isinstance(spec, dict):
        raise CodecError("malformed tensor description in frame header")
    try:
        codec = Codec(spec.get("codec"))
    except (ValueError, TypeError):
        raise CodecError(f"unknown codec {_brief(spec.get('codec'))}") from None
    dtype = DTYPES.get(spec.get("dtype")) if isinstance(spec.get("dtype"), str) else None
    if dtype is None:
        raise CodecError(f"unsupported tensor dtype {_brief(spec.get('dtype'))}")
    shape = _shape(spec.get("shape"))
    if math.prod(shape) * dtype.itemsize > decoded_limit(max_decoded, body_bytes):
        raise CodecError(f"a tensor of shape {shape} is too large for a {body_bytes} B frame on this stream")
    if codec != Codec.NONE and not dtype.is_floating_point:
        raise CodecError(f"codec {codec.value} does not apply to {spec['dtype']}")
    return codec, dtype, shape


def unpack(spec: Any, body: bytearray | memoryview, max_decoded: int = MAX_DECODED_BYTES) -> torch.Tensor:
    """Rebuild a tensor from a frame's description and its writable body, which the result may
    share; CodecError on anything inconsistent, or on a tensor over `max_decoded` bytes."""
    body = memoryview(body).cast("B")
    codec, dtype, shape = declared(spec, body.nbytes, max_decoded)
    count = math.prod(shape)
    if codec == Codec.NONE:
        _check_parts(spec, body.nbytes, [count * dtype.itemsize])
        out = _view(body, 0, count * dtype.itemsize, dtype)
    elif codec in (Codec.FLOAT16, Codec.BFLOAT16):
        wire = torch.float16 if codec == Codec.FLOAT16 else torch.bfloat16
        _check_parts(spec, body.nbytes, [count * 2])
        out = _view(body, 0, count * 2, wire).to(dtype)
    elif codec == Codec.INT8:
        out = _unpack_int8(spec, body, count, dtype)
    else:
        out = _unpack_topk(spec, body, count, dtype)
    return out.reshape(shape)


def _unpack_int8(spec: dict[str, Any], body: memoryview, count: int, dtype: torch.dtype) -> torch.Tensor:
    blocks = -(-count // BLOCK)
    q_size, s_size, i_size, v_size = _check_parts(spec, body.nbytes, [count, blocks * 4, -1, -1])
    exceptions = i_size // 8
    if i_size % 8 or v_size != exceptions * dtype.itemsize:
        raise CodecError("int8 frame: exception indices and values do not match")
    q = _view(body, 0, q_size, torch.int8)
    scales = _view(body, q_size, s_size, torch.float32)
    out = torch.empty(count, dtype=dtype)
    for first in range(0, count, DECODE_CHUNK):  # DECODE_CHUNK is whole blocks
        chunk = q[first : first + DECODE_CHUNK].float()
        rows = torch.nn.functional.pad(chunk, (0, -chunk.numel() % BLOCK)).view(-1, BLOCK)
        rows *= scales[first // BLOCK : first // BLOCK + rows.shape[0], None]
        out[first : first + chunk.numel()] = rows.view(-1)[: chunk.numel()]
    if exceptions:
        index = _view(body, q_size + s_size, i_size, torch.int64)
        if index.min() < 0 or index.max() >= count:
            raise CodecError("int8 frame: exception index out of range")
        out[index] = _view(body, q_size + s_size + i_size, v_size, dtype)
    return out


def _unpack_topk(spec: dict[str, Any], body: memoryview, count: int, dtype: torch.dtype) -> torch.Tensor:
    k = spec.get("k")
    if not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= count):
        raise CodecError(f"topk frame: k must be in 0..{count}, got {_brief(k)}")
    index_dtype = _index_dtype(count)
    i_size, v_size = _check_parts(spec, body.nbytes, [k * index_dtype.itemsize, k * dtype.itemsize])
    out = torch.zeros(count, dtype=dtype)
    if k:
        index = _view(body, 0, i_size, index_dtype).long()
        if index.min() < 0 or index.max() >= count:
            raise CodecError("topk frame: index out of range")
        out[index] = _view(body, i_size, v_size, dtype)
    return out


class ErrorFeedback:
    """Top-k with error feedback for one stream: what a step leaves out is added to the next one,
    so over many steps every value gets through (FusionLLM's AdaTopK keeps the same residual)."""

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None

    def pack(self, tensor: torch.Tensor, k: int) -> Packed:
        tensor = tensor.detach().cpu()
        acc = tensor if self.residual is None or self.residual.shape != tensor.shape else tensor + self.residual
        packed = pack(acc, Codec.TOPK, k)
        residual = acc.reshape(-1).clone()
        residual[_view(packed.parts[0], 0, packed.parts[0].nbytes, _index_dtype(acc.numel())).long()] = 0
        self.residual = residual.reshape(acc.shape)
        return packed
