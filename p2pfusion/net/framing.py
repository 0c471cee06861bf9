"""Frames on a byte stream: a msgpack header, then the raw buffers of at most one tensor.

Layout: 4-byte header length, 8-byte body length (big-endian), header, body. The tensor's codec,
dtype and shape travel in the header under "tensor" (see `codecs`); the body is the codec's
buffers, written straight from the tensor's memory and read back into one writable buffer that
the decoded tensor owns. Every check here guards a peer against a bad or hostile sender.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from p2pfusion.errors import RequestError
from p2pfusion.net.codecs import MAX_DECODED_BYTES, CodecError, Packed, declared, pack, unpack

PREFIX = struct.Struct("!IQ")
MAX_HEADER_BYTES = 1 << 20
MAX_BODY_BYTES = 1 << 31
MAX_HEADER_MAP = 64  # keys in any map of a header: every message's maps hold a dozen at most
READ_CHUNK = 1 << 20  # a body grows as its bytes arrive, never ahead of them


@dataclass(frozen=True)
class FrameLimits:
    """What one stream may send: checked on the 12-byte prefix (header and body sizes), then on the
    header (only `tensor_kinds` may carry a body), then on the tensor's declared size (at most
    `decoded` bytes once decoded), each before the bytes are read or allocated."""

    header: int = MAX_HEADER_BYTES
    body: int = MAX_BODY_BYTES
    decoded: int = MAX_DECODED_BYTES
    tensor_kinds: frozenset[str] | None = None  # None: any kind may carry a tensor


UNLIMITED = FrameLimits()


class FrameError(RequestError):
    """The byte stream holds no valid frame; the stream cannot be trusted after this."""


class BadTensor(RequestError):
    """A whole frame arrived, but its tensor does not decode; the stream itself is still in step."""

    def __init__(self, message: str, header: dict[str, Any]):
        super().__init__(message)
        self.header = header


def encode(header: dict[str, Any], payload: torch.Tensor | Packed | None = None) -> list[bytes | memoryview]:
    """The frame's pieces, ready for `writelines`; a bare tensor goes uncompressed."""
    if payload is None:
        parts: list[memoryview] = []
    else:
        packed = payload if isinstance(payload, Packed) else pack(payload)
        header = {**header, "tensor": packed.spec}
        parts = packed.parts
    packed_header = msgpack.packb(header, use_bin_type=True)
    return [PREFIX.pack(len(packed_header), sum(p.nbytes for p in parts)), packed_header, *parts]


async def write_frame(
    writer: asyncio.StreamWriter, header: dict[str, Any], payload: torch.Tensor | Packed | None = None
) -> None:
    writer.writelines(encode(header, payload))
    await writer.drain()


async def read_frame(
    reader: asyncio.StreamReader, limits: FrameLimits = UNLIMITED
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Read one frame within `limits`. Raises EOFError at a clean end of stream, FrameError on
    garbage or on a frame over its limits."""
    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise EOFError from exc
        raise FrameError("stream ended inside a frame prefix") from exc
    header_len, body_len = PREFIX.unpack(prefix)
    if header_len > limits.header or body_len > limits.body:
        raise FrameError(
            f"frame too large (header {header_len} B, body {body_len} B; this stream allows "
            f"{limits.header} B and {limits.body} B)"
        )
    try:
        packed = await reader.readexactly(header_len)
    except asyncio.IncompleteReadError as exc:
        raise FrameError("stream ended inside a frame") from exc
    header = _decode_header(packed)
    kind = header.get("kind")
    if body_len and limits.tensor_kinds is not None and not (isinstance(kind, str) and kind in limits.tensor_kinds):
        raise FrameError(f"a {str(kind)[:40]!r} frame carries no body, got {body_len} B")
    spec = header.pop("tensor", None)
    if spec is None:
        if body_len:
            raise FrameError("frame has a body but no tensor description")
        return header, None
    try:
        declared(spec, body_len, limits.decoded)
    except CodecError as exc:
        await _skip(reader, body_len)  # keeps the stream in step without holding the body
        raise BadTensor(str(exc), header) from exc
    body = await _read_body(reader, body_len)
    try:
        return header, unpack(spec, body, limits.decoded)
    except CodecError as exc:
        raise BadTensor(str(exc), header) from exc


def _decode_header(packed: bytes) -> dict[str, Any]:
    try:
        # msgpack bounds strings and arrays by the header's own size; maps cost more per byte
        header = msgpack.unpackb(packed, raw=False, max_map_len=MAX_HEADER_MAP)
    except (ValueError, msgpack.UnpackException) as exc:
        raise FrameError(f"undecodable frame header: {str(exc)[:100]}") from exc
    if not isinstance(header, dict):
        raise FrameError("frame header is not a map")
    return header


async def _read_body(reader: asyncio.StreamReader, size: int) -> bytearray:
    """The body in one writable buffer of its own (so the tensor decoded from it is an ordinary
    writable one), grown chunk by chunk: memory follows the bytes that arrived, not the prefix's
    claim, and no second copy of a large body exists at any time."""
    body = bytearray()
    while len(body) < size:
        chunk = await reader.read(min(size - len(body), READ_CHUNK))
        if not chunk:
            raise FrameError("stream ended inside a frame")
        body += chunk
    return body


async def _skip(reader: asyncio.StreamReader, size: int) -> None:
    while size:
        chunk = await reader.read(min(size, READ_CHUNK))
        if not chunk:
            raise FrameError("stream ended inside a frame")
        size -= len(chunk)
