"""Fuzz what a peer reads from strangers: frames on a byte stream (`read_frame`, with a stage
server's limits), message validation (`messages.from_header`, every kind) and every codec's decode.

    .venv/bin/python scripts/fuzz_frames.py --runs 100000

Coverage-guided with atheris (libFuzzer). Each input must end in a result or an expected refusal
(EOFError, or a RequestError: FrameError, BadTensor, CodecError), within INPUT_SECONDS, with no
decoded tensor over the stream's limit, no Python heap peak beyond HEAP_BOUND (tracemalloc), and
the process's peak RSS at most RSS_BOUND over its start. The first failing input is written by
libFuzzer as crash-<sha1> in the working directory, and replays with `--replay FILE`.
`tests/test_fuzz.py` drives the same inputs from hypothesis, for a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import resource
import sys
import time
import tracemalloc
from collections import Counter
from dataclasses import fields
from pathlib import Path

import msgpack
import torch

try:
    import atheris
except ImportError:  # the tests drive the checks from hypothesis and need no atheris
    atheris = None

if atheris is not None:
    with atheris.instrument_imports(include=["p2pfusion"]):
        from p2pfusion.errors import RequestError
        from p2pfusion.net import codecs
        from p2pfusion.net import messages as m
        from p2pfusion.net.framing import PREFIX, FrameLimits, read_frame
else:
    from p2pfusion.errors import RequestError
    from p2pfusion.net import codecs
    from p2pfusion.net import messages as m
    from p2pfusion.net.framing import PREFIX, FrameLimits, read_frame

# A session stream of a stage server with a 576-wide model: steps of up to 2048 tokens
LIMITS = FrameLimits(header=64 << 10, body=5 << 20, decoded=2048 * 576 * 4, tensor_kinds=m.TENSOR_KINDS)
EXPECTED = (EOFError, RequestError)
INPUT_SECONDS = 2.0
HEAP_BOUND = 4 << 20  # Python heap (headers, bodies) per input: inputs are at most a few KiB
RSS_BOUND = 4 * LIMITS.decoded + (256 << 20)
KINDS = sorted(m.MESSAGES)
CODECS = [c.value for c in codecs.Codec]
DTYPES = list(codecs.DTYPES)
INTS = [0, 1, -1, 2, 7, 64, 255, 1 << 20, 1 << 29, 1 << 31, (1 << 63) - 1, -(1 << 63), (1 << 64) - 1]
FLOATS = [0.0, -0.0, 1.5, -1.0, 1e300, math.inf, -math.inf, math.nan]


class Draws:
    """Where an input's choices come from: atheris's bytes, or hypothesis's draws."""

    def int(self, low: int, high: int) -> int:
        raise NotImplementedError

    def bytes(self, most: int) -> bytes:
        raise NotImplementedError

    def pick(self, options: list):
        return options[self.int(0, len(options) - 1)]


class AtherisDraws(Draws):
    def __init__(self, data: bytes):
        self.fdp = atheris.FuzzedDataProvider(data)

    def int(self, low: int, high: int) -> int:
        return self.fdp.ConsumeIntInRange(low, high)

    def bytes(self, most: int) -> bytes:
        return self.fdp.ConsumeBytes(self.fdp.ConsumeIntInRange(0, most))


def value(draws: Draws, depth: int = 0):
    """Any msgpack value, leaning toward what headers hold: small maps, lists, ids, numbers."""
    kind = draws.int(0, 9 if depth < 4 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return bool(draws.int(0, 1))
    if kind == 2:
        return draws.pick(INTS) if draws.int(0, 1) else draws.int(-(1 << 40), 1 << 40)
    if kind == 3:
        return draws.pick(FLOATS)
    if kind == 4:
        return draws.bytes(64).decode("utf-8", "replace") if draws.int(0, 3) else "p" * draws.int(0, 300)
    if kind == 5:
        return draws.bytes(64)
    if kind in (6, 7):
        return [value(draws, depth + 1) for _ in range(draws.int(0, 4))]
    if kind == 8:
        return {draws.pick(KEYS): value(draws, depth + 1) for _ in range(draws.int(0, 5))}
    return [[[[[[[[[[[[[[[[None]]]]]]]]]]]]]]]] * draws.int(1, 3)  # nesting deeper than any message


KEYS = sorted({f.name for cls in m.MESSAGES.values() for f in fields(cls)} | {f.name for f in fields(m.Hop)})
KEYS += ["kind", "tensor", "protocol", "rtt", "bytes_per_second", "codec", "dtype", "shape", "parts", "k"]


def header(draws: Draws, kind: str) -> dict:
    """A header of this kind: each of its fields present or not, each a plausible or a wild value."""
    cls = m.MESSAGES[kind]
    out = {"kind": kind}
    for f in fields(cls):
        choice = draws.int(0, 3)
        if choice == 0:
            continue
        out[f.name] = value(draws) if choice == 1 else plausible(draws, f.name)
    return out


def plausible(draws: Draws, name: str):
    if name in ("session_id", "peer_id", "failed_peer", "digest", "adapter", "message", "code"):
        return draws.pick(["s", "p" * 128, "p" * 129, "", m.ErrorCode.BUSY, m.ErrorCode.EXPIRED])
    if name == "route":
        return [hop(draws) for _ in range(draws.pick([0, 1, 2, 257]))]
    if name == "timings":
        return [[draws.pick(["p", ""]), draws.pick(FLOATS)] for _ in range(draws.pick([0, 1, 257]))]
    if name in ("link", "client_link"):
        return {"rtt": draws.pick(FLOATS), "bytes_per_second": draws.pick(FLOATS)}
    if name == "entries":
        return [[draws.pick(["w", ""]), [draws.pick(INTS) for _ in range(draws.int(0, 5))]] for _ in range(draws.int(0, 3))]
    if name in ("mask", "positions"):
        return draws.bytes(64)
    return draws.pick(INTS)


def hop(draws: Draws) -> dict:
    addrs = ["127.0.0.1:1"] * draws.pick([0, 1, 8, 9])
    return {"peer_id": draws.pick(["p", "", "p" * 200]), "data_addrs": addrs, "start": draws.pick(INTS), "end": draws.pick(INTS)}


def tensor_spec(draws: Draws) -> tuple[dict, bytes]:
    """A tensor description and its body: an honest one (packed by a real sender) with a few bytes
    or fields bent, or a wild one whose part sizes at least add up to its body."""
    if draws.int(0, 1):
        shape = [draws.int(0, 5) for _ in range(draws.int(0, 3))]
        count = math.prod(shape)
        values = torch.frombuffer(bytearray(draws.bytes(4 * count).ljust(4 * count, b"\0")) or bytearray(4), dtype=torch.float32)
        dtype = codecs.DTYPES[draws.pick(DTYPES)]
        tensor = values[:count].view(shape).to(dtype) if dtype.is_floating_point else values[:count].view(shape).nan_to_num().long()
        packed = codecs.pack(tensor, codecs.Codec(draws.pick(CODECS)), draws.int(0, count))
        spec, body = dict(packed.spec), bytearray(packed.body())
        for _ in range(draws.int(0, 3)):
            if draws.int(0, 1) and body:
                body[draws.int(0, len(body) - 1)] = draws.int(0, 255)
            else:
                field = draws.pick(["codec", "dtype", "shape", "parts", "k"])
                spec[field] = value(draws) if draws.int(0, 1) else wild_spec(draws, len(body))[field]
        return spec, bytes(body)
    body = draws.bytes(2048)
    return wild_spec(draws, len(body)), body


def wild_spec(draws: Draws, body_size: int) -> dict:
    cuts = sorted(draws.int(0, body_size) for _ in range(draws.pick([0, 1, 3])))
    return {
        "codec": draws.pick(CODECS + ["zip", 3]),
        "dtype": draws.pick(DTYPES + ["float64", None]),
        "shape": [draws.pick([0, 1, 2, 3, 63, 64, 65, 1 << 29, 1 << 40, 1 << 41, -1]) for _ in range(draws.int(0, 9))],
        "k": draws.pick(INTS) if draws.int(0, 1) else draws.int(0, 512),
        "parts": [b - a for a, b in zip([0, *cuts], [*cuts, body_size])],
    }


def frame(draws: Draws) -> bytes:
    """A byte stream of one to three frames: honest prefixes around fuzzed headers, or lying ones."""
    out = b""
    for _ in range(draws.int(1, 3)):
        raw = header(draws, draws.pick(KINDS)) if draws.int(0, 2) else value(draws)
        body = b""
        if draws.int(0, 1) and isinstance(raw, dict):
            raw["tensor"], body = tensor_spec(draws)
        packed = msgpack.packb(raw, use_bin_type=True) if draws.int(0, 4) else draws.bytes(256)
        sizes = (len(packed), len(body)) if draws.int(0, 3) else (draws.pick(INTS) % (1 << 32), draws.pick(INTS) % (1 << 64))
        out += PREFIX.pack(*sizes) + packed + body
    return out[: len(out) - draws.pick([0, 0, 0, 1, 7])]  # sometimes cut short


LOOP = asyncio.new_event_loop()
OUTCOMES: Counter[str] = Counter()
WORST = {"seconds": 0.0, "heap": 0}  # over all inputs so far


async def _frames(data: bytes) -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    while True:
        header_, tensor = await read_frame(reader, LIMITS)
        if tensor is not None and tensor.numel() * tensor.element_size() > LIMITS.decoded:
            raise AssertionError(f"decoded {tensor.numel() * tensor.element_size()} B past the limit")
        m.from_header(header_)


def check_frame(data: bytes) -> None:
    LOOP.run_until_complete(_frames(data))


def check_header(raw: dict) -> None:
    m.from_header(raw)


def check_codec(spec: dict, body: bytes) -> None:
    tensor = codecs.unpack(spec, bytearray(body), LIMITS.decoded)
    if tensor.numel() * tensor.element_size() > LIMITS.decoded:
        raise AssertionError(f"decoded {tensor.numel() * tensor.element_size()} B past the limit")


def one_input(draws: Draws) -> None:
    """One fuzzed input through one of the three targets; AssertionError on anything unexpected."""
    target = draws.int(0, 2)
    if target == 0:
        run = (check_frame, frame(draws))
    elif target == 1:
        run = (check_header, header(draws, draws.pick(KINDS)))
    else:
        run = (check_codec, *tensor_spec(draws))
    tracemalloc.start()  # around the check only: tracing the input's making would cost more than the check
    t0 = time.perf_counter()
    try:
        run[0](*run[1:])
        OUTCOMES["accepted"] += 1
    except EXPECTED as exc:
        OUTCOMES[type(exc).__name__] += 1
        if "\n" in str(exc):
            raise AssertionError(f"a refusal of more than one line: {exc!r}") from exc
    finally:
        seconds = time.perf_counter() - t0
        heap = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    WORST.update(seconds=max(WORST["seconds"], seconds), heap=max(WORST["heap"], heap))
    if seconds > INPUT_SECONDS:
        raise AssertionError(f"one input took {seconds:.1f} s")
    if heap > HEAP_BOUND:
        raise AssertionError(f"one input peaked at {heap} B of Python heap")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0, help="libFuzzer's seed (0: random)")
    parser.add_argument("--replay", type=Path, help="run one input file (a crash libFuzzer wrote) and stop")
    args = parser.parse_args()
    if atheris is None:
        sys.exit("atheris is not installed: pip install atheris==3.0.0 (Linux x86_64, Python 3.11+)")
    if args.replay:
        one_input(AtherisDraws(args.replay.read_bytes()))
        print(f"{args.replay}: {dict(OUTCOMES)}")
        return
    start_rss, t0 = peak_rss(), time.perf_counter()
    done = 0

    def fuzz_one(data: bytes) -> None:
        nonlocal done
        one_input(AtherisDraws(data))
        done += 1
        if done % 10_000 == 0 and peak_rss() - start_rss > RSS_BOUND:
            raise AssertionError(f"peak RSS grew {(peak_rss() - start_rss) >> 20} MiB")
        if done == args.runs:
            grown = (peak_rss() - start_rss) >> 20
            print(
                f"{done} inputs in {time.perf_counter() - t0:.0f} s; slowest {WORST['seconds'] * 1e3:.1f} ms, "
                f"Python heap peak {WORST['heap'] >> 10} KiB, process peak RSS +{grown} MiB; outcomes: {dict(OUTCOMES)}"
            )
            sys.stdout.flush()

    atheris.Setup([sys.argv[0], f"-runs={args.runs}", f"-seed={args.seed}", "-timeout=20", "-max_len=8192", "-len_control=0"], fuzz_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
