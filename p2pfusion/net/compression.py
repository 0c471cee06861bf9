"""Which codec a hop uses on its link: a pure function of the link's measured speed and the payload.

Each candidate's cost is its encode+decode time plus its compressed bytes over the link's
bandwidth. A lossy codec must save at least MIN_GAIN of the raw tensor's time, and MIN_SAVING
seconds, to be worth its error (and in training, MIN_STEP_SHARE of the step's compute time: less
cannot speed the step up noticeably); on a fast link, or for a tensor too small to matter, the raw
tensor goes; on a slow link, the cheapest codec. Inference takes only codecs that keep greedy tokens unchanged (see
docs/benchmarks.md for the measured agreement); training may also take top-k, sized so the
transfer fits a time budget (FusionLLM's AdaTopK), and only on links too slow for that budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Annotated

from p2pfusion.net.wire import Bound, WireError


class Codec(str, Enum):
    """How a tensor travels (net/codecs.py encodes each)."""

    NONE = "none"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"
    TOPK = "topk"


class Auto(Enum):
    """Let each link choose its codec from its measured speed (`choose_codec`)."""

    AUTO = "auto"

    def __str__(self) -> str:
        return self.value


AUTO = Auto.AUTO
Compression = Codec | Auto  # what a client or peer asks for: one codec on every link, or each link's choice

# Bytes of float32 input coded and decoded per second, one core of this project's 2-core machine
# (scripts/bench_codecs.py); what matters is their order against the link's bytes per second.
CODEC_SPEED = {Codec.NONE: math.inf, Codec.FLOAT16: 1.6e9, Codec.BFLOAT16: 1.6e9, Codec.INT8: 1.1e9, Codec.TOPK: 2.3e8}
CODEC_CALL = 5e-5  # seconds a lossy codec costs per tensor, whatever its size (measured: 12-50 us)
MIN_GAIN = 0.2
MIN_SAVING = 5e-4
MIN_STEP_SHARE = 0.05  # training: a lossy codec must also save this share of the step's compute time
WIRE_RATIO = {Codec.NONE: 1.0, Codec.FLOAT16: 2.0, Codec.BFLOAT16: 2.0, Codec.INT8: 4 / (1 + 4 / 64)}
# Codecs that left the default model's greedy tokens unchanged (docs/benchmarks.md, token agreement).
GREEDY_SAFE = (Codec.NONE, Codec.FLOAT16)
TRAINING = (Codec.NONE, Codec.BFLOAT16, Codec.INT8)
MIN_DENSITY = 0.1  # top-k below this share of entries starts to hurt training (Rudakov et al. 2024)
TOPK_BYTES_PER_ENTRY = 8  # an int32 index and a float32 value


class Purpose(str, Enum):
    INFERENCE = "inference"
    TRAINING = "training"


@dataclass(frozen=True)
class LinkSpeed:
    rtt: Annotated[float, Bound(0)]  # seconds
    bytes_per_second: Annotated[float, Bound(0)]  # positive: see `check`

    def check(self) -> None:
        if self.bytes_per_second <= 0:
            raise WireError("field 'bytes_per_second' must be positive")


@dataclass(frozen=True)
class CodecChoice:
    codec: Codec
    k: int | None = None  # top-k's kept entries


def parse_compression(text: str) -> Compression:
    """`auto` or a codec's name; ValueError with the valid names otherwise."""
    if text == AUTO.value:
        return AUTO
    if text in {c.value for c in Codec}:
        return Codec(text)
    raise ValueError(f"unknown compression {text!r}; choose from auto, {', '.join(c.value for c in Codec)}")


def transfer_seconds(codec: Codec, payload_bytes: int, link: LinkSpeed) -> float:
    """Time to code, send and decode `payload_bytes` of float32 over `link` with `codec` (not top-k)."""
    coding = 0.0 if codec == Codec.NONE else CODEC_CALL + payload_bytes / CODEC_SPEED[codec]
    return coding + payload_bytes / WIRE_RATIO[codec] / link.bytes_per_second


def topk_entries(payload_bytes: int, link: LinkSpeed, budget: float) -> int:
    """AdaTopK's k: as many entries as the link carries within `budget`, at least MIN_DENSITY of them."""
    entries = payload_bytes // 4
    fits = int(max(budget - link.rtt, 0.0) * link.bytes_per_second / TOPK_BYTES_PER_ENTRY)
    return max(min(fits, entries), math.ceil(MIN_DENSITY * entries))


def choose_codec(
    link: LinkSpeed | None,
    payload_bytes: int,
    purpose: Purpose = Purpose.INFERENCE,
    forced: Compression = AUTO,
    budget: float | None = None,
) -> CodecChoice:
    """The codec for one tensor of `payload_bytes` (as float32) on `link`; `budget` is the seconds a
    training step can spend on this transfer. An unmeasured link gets the raw tensor."""
    if isinstance(forced, Codec):
        codec = forced
        if codec == Codec.TOPK:
            if link is None or budget is None:
                return CodecChoice(codec, math.ceil(MIN_DENSITY * payload_bytes / 4))
            return CodecChoice(codec, topk_entries(payload_bytes, link, budget))
        return CodecChoice(codec)
    if link is None or payload_bytes == 0:
        return CodecChoice(Codec.NONE)
    candidates = GREEDY_SAFE if purpose == Purpose.INFERENCE else TRAINING
    raw = transfer_seconds(Codec.NONE, payload_bytes, link)
    best = min(candidates, key=lambda c: transfer_seconds(c, payload_bytes, link))
    saving = raw - transfer_seconds(best, payload_bytes, link)
    if saving < MIN_GAIN * raw or saving < MIN_SAVING or (budget is not None and saving < MIN_STEP_SHARE * budget):
        best = Codec.NONE
    if purpose == Purpose.TRAINING and budget is not None and transfer_seconds(best, payload_bytes, link) > budget:
        k = topk_entries(payload_bytes, link, budget)
        topk_seconds = CODEC_CALL + payload_bytes / CODEC_SPEED[Codec.TOPK] + k * TOPK_BYTES_PER_ENTRY / link.bytes_per_second
        if topk_seconds < transfer_seconds(best, payload_bytes, link):
            return CodecChoice(Codec.TOPK, k)
    return CodecChoice(best)
