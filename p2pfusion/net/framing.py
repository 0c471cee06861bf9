"""Frames on a byte stream: a msgpack header, then the raw buffer of at most one tensor.

Layout: 4-byte header length, 8-byte body length (big-endian), header, body. The tensor's dtype
and shape travel in the header under "tensor"; the body is its contiguous bytes, with no
serialization step in between. Every check here guards a peer against a bad or hostile sender.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack
import torch

from p2pfusion.errors import RequestError

PREFIX = struct.Struct("!IQ")
MAX_HEADER_BYTES = 1 << 20
MAX_BODY_BYTES = 1 << 31
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class FrameError(RequestError):
    """The byte stream holds no valid frame; the stream cannot be trusted after this."""


def encode(header: dict[str, Any], tensor: torch.Tensor | None = None) -> list[bytes | memoryview]:
    body: bytes | memoryview = b""
    if tensor is not None:
        if tensor.dtype not in DTYPE_NAMES:
            raise RequestError(f"cannot send tensors of dtype {tensor.dtype}")
        tensor = tensor.detach().contiguous().cpu()
        header = {**header, "tensor": [DTYPE_NAMES[tensor.dtype], list(tensor.shape)]}
        # bfloat16 has no numpy dtype, so view its bytes as int16 (same width) to share the buffer.
        as_numpy = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
        if tensor.numel():
            body = memoryview(as_numpy.numpy().reshape(-1)).cast("B")
    packed = msgpack.packb(header, use_bin_type=True)
    return [PREFIX.pack(len(packed), len(body)), packed, body]


async def write_frame(
    writer: asyncio.StreamWriter, header: dict[str, Any], tensor: torch.Tensor | None = None
) -> None:
    writer.writelines(encode(header, tensor))
    await writer.drain()


def _decode_tensor(spec: Any, body: bytes) -> torch.Tensor:
    if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[1], list)):
        raise FrameError("malformed tensor description in frame header")
    dtype_name, shape = spec
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise FrameError(f"unsupported tensor dtype {dtype_name!r}")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise FrameError(f"invalid tensor shape {shape!r}")
    count = 1
    for d in shape:
        count *= d
    if count * dtype.itemsize != len(body):
        raise FrameError(f"tensor of shape {shape} and dtype {dtype_name} does not fit {len(body)} bytes")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(body), dtype=torch.int16 if dtype == torch.bfloat16 else dtype)
    return raw.view(dtype).reshape(shape) if dtype == torch.bfloat16 else raw.reshape(shape)


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Read one frame. Raises EOFError at a clean end of stream, FrameError on garbage."""
    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise EOFError from exc
        raise FrameError("stream ended inside a frame prefix") from exc
    header_len, body_len = PREFIX.unpack(prefix)
    if header_len > MAX_HEADER_BYTES or body_len > MAX_BODY_BYTES:
        raise FrameError(f"frame too large (header {header_len} B, body {body_len} B)")
    try:
        packed = await reader.readexactly(header_len)
        body = await reader.readexactly(body_len) if body_len else b""
    except asyncio.IncompleteReadError as exc:
        raise FrameError("stream ended inside a frame") from exc
    try:
        header = msgpack.unpackb(packed, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise FrameError(f"undecodable frame header: {exc}") from exc
    if not isinstance(header, dict):
        raise FrameError("frame header is not a map")
    spec = header.pop("tensor", None)
    if spec is None:
        if body:
            raise FrameError("frame has a body but no tensor description")
        return header, None
    return header, _decode_tensor(spec, body)
