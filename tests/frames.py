"""Frames as bytes, for tests that feed a reader by hand."""

from __future__ import annotations

import asyncio

import msgpack

from p2pfusion.net.framing import PREFIX, encode, read_frame


def parse(data: bytes):
    """Read one frame from these bytes, as a peer would from its stream."""

    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader)

    return asyncio.run(go())


def frame_bytes(header, tensor=None) -> bytes:
    return b"".join(bytes(part) for part in encode(header, tensor))


def raw_frame(header: dict, body: bytes) -> bytes:
    """A frame with any header, even one no honest sender would write."""
    packed = msgpack.packb(header)
    return PREFIX.pack(len(packed), len(body)) + packed + body
