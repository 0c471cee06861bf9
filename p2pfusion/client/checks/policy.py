"""Checking peers' results: pure policies (no network), used by p2pfusion.client.checks.verifier.

A check compares the final hidden states the session's route returned with those of another route
for the same inputs, per position, as a relative L2 error. Honest routes differ only by rounding,
whose size depends on the dtype peers compute in and the codecs hidden states crossed the wire in;
`tolerance` sets the bar from those, with a wide margin over what honest peers were measured at.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import replace
from enum import Enum

import torch

from p2pfusion.dht.records import PeerRecord
from p2pfusion.client.route.planner import expected_throughput, usable
from p2pfusion.errors import RequestError
from p2pfusion.net.compression import AUTO, Codec, Compression

DEFAULT_RATE = 0.05  # chance that a step is checked; a generation's end is always checked
MAX_REWINDS = 8  # wrong results caught in one generation before it gives up

# Relative L2 error per position between two honest routes' final hidden states. Measured on the
# default model (30 layers, 3 hops, a 60-token prefill): float32 prefill against token-by-token
# decoding 2.5e-6; float16 on the wire 1.5e-3, bfloat16 9.3e-3; float16 compute 6.6e-3, bfloat16
# compute on one hop 2.5e-2. Each bar is those figures with a margin of 6x to 80x.
COMPUTE_TOLERANCE = {torch.float32: 2e-4, torch.float16: 5e-2, torch.bfloat16: 0.2}
# The same per weight format of the peers (scripts/bench_formats.py, all 30 layers in the format
# against float32): bfloat16 8.2e-2, float16 7.8e-3, int8 1.0e-1, int4 0.77. Two routes are
# compared with the bar of the least precise format among their own peers. Against int4 peers that
# bar catches only gross lies (noise, zeros, another model's states); the greedy tokens and the
# next-token distributions the client's head reads from both routes are compared too
# (client/checks/verifier.py).
FORMAT_TOLERANCE = {"float32": 2e-4, "float16": 5e-2, "bfloat16": 0.2, "int8": 0.3, "int4": 2.0}
WIRE_TOLERANCE = {Codec.NONE: 0.0, Codec.FLOAT16: 2e-2, Codec.BFLOAT16: 5e-2, Codec.INT8: 0.1, Codec.TOPK: math.inf}
# Below this relative error between two routes' final states at a position, the greedy tokens
# they give are not compared: honest float32 routes differ by about 2.5e-6, and the least change
# that flipped a decode step's greedy token on the default model was 5.3e-3 of the state's norm
# (scripts/bench_verify.py, "token nudge"); float16 rounding alone is 5e-4.
FLIP_FLOOR = 1e-4
# Total variation (half the L1 distance) between two honest routes' next-token distributions at
# the client's head, at positions that chose a token: the greedy token is not all a sampled reply
# depends on. Measured on the default model against float32, at most: on held-out text
# (scripts/bench_formats.py) bfloat16 weights 0.11, float16 6.7e-3, int8 0.11, int4 0.78; on 5
# chat replies of 48 tokens, two stages of a format each and every codec between them, float32
# with float16 on the wire 1.6e-3, bfloat16 2.1e-2, int8 6.0e-2; bfloat16 weights 0.14, int8
# 0.15, int4 0.98. int4 weights change this small model's distribution outright, so against int4
# peers only the greedy token is compared. Each bar is about twice those.
SHIFT_TOLERANCE = {"float32": 2e-3, "float16": 0.3, "bfloat16": 0.3, "int8": 0.3, "int4": 1.0}
COMPUTE_SHIFT = {torch.float32: 2e-3, torch.float16: 0.3, torch.bfloat16: 0.3}
WIRE_SHIFT = {Codec.NONE: 0.0, Codec.FLOAT16: 5e-3, Codec.BFLOAT16: 5e-2, Codec.INT8: 0.15, Codec.TOPK: 1.0}
# One hop's output is compared with a tighter bar: what a hop adds, later layers amplify (noise
# of 1e-4 on a middle hop's output reached the last hop's as 4.6e-4).
HOP_SHARE = 0.25


def check_rate(rate: float, name: str = "verify") -> float:
    if not 0 <= rate <= 1:
        raise RequestError(f"{name} is a probability, from 0 to 1; got {rate}")
    return rate


def tolerance(
    compression: Compression, dtype: torch.dtype, formats: Collection[str] = (), codecs: Collection[Codec] | None = None
) -> float:
    """The largest per-position relative error honest routes show, for a session's codec choice,
    the dtype of its hidden states and the weight formats of the peers that may compute them.
    Under `auto`, `codecs` are those the states compared actually crossed the wire in (the hops'
    signed receipts say); None: unknown, and float16 may have been one."""
    weights = [FORMAT_TOLERANCE.get(f, math.inf) for f in formats]
    wire = _on_the_wire(WIRE_TOLERANCE, compression, codecs)
    return max(COMPUTE_TOLERANCE.get(dtype, COMPUTE_TOLERANCE[torch.bfloat16]), wire, *weights)


def shift_tolerance(
    compression: Compression, dtype: torch.dtype, formats: Collection[str] = (), codecs: Collection[Codec] | None = None
) -> float:
    """The largest total variation between honest routes' next-token distributions, from the same
    things as `tolerance`; 1 (never passed) where nothing bounds it."""
    weights = [SHIFT_TOLERANCE.get(f, 1.0) for f in formats]
    wire = _on_the_wire(WIRE_SHIFT, compression, codecs)
    return max(COMPUTE_SHIFT.get(dtype, COMPUTE_SHIFT[torch.bfloat16]), wire, *weights)


def _on_the_wire(bars: dict[Codec, float], compression: Compression, codecs: Collection[Codec] | None) -> float:
    """A codec's bar for a session's codec choice; under `auto`, the largest among the codecs the
    states crossed the wire in (None: unknown, and float16 may have been one)."""
    if compression is not AUTO:
        return bars[compression]
    if codecs is None:
        return bars[Codec.FLOAT16]
    return max((bars[c] for c in codecs), default=0.0)


def total_variation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row total variation between the softmaxes of two logits tensors [..., vocab]; a row
    with a non-finite logit is as far as can be (1)."""
    a, b = a.float(), b.float()
    distance = 0.5 * (a.softmax(dim=-1) - b.softmax(dim=-1)).abs().sum(dim=-1)
    return torch.where(torch.isfinite(distance), distance, torch.ones_like(distance))


def hop_tolerance(compression: Compression, dtype: torch.dtype, formats: Collection[str] = ()) -> float:
    return HOP_SHARE * tolerance(compression, dtype, formats)


def relative_errors(claimed: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[batch, tokens] relative L2 errors of `claimed` against `reference` ([batch, tokens, hidden]);
    a non-finite claim is an infinite error, and padding (mask 0) counts as agreement."""
    claimed, reference = claimed.float(), reference.float()
    errors = (claimed - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-30)
    finite = torch.isfinite(claimed).all(dim=-1) & ~errors.isnan()
    errors = torch.where(finite, errors, torch.full_like(errors, math.inf))
    if mask is not None:
        errors = errors * mask.to(errors.dtype)
    return errors


def first_mismatch(errors: torch.Tensor, bar: float) -> int | None:
    """The first position (over all rows) whose error passes the bar; None when all meet it."""
    bad = (errors > bar).any(dim=0).nonzero()
    return None if bad.numel() == 0 else int(bad[0, 0])


class Culprit(str, Enum):
    NONE = "none"  # the hop and its witness agree
    PRIMARY = "primary"  # the third opinion sides with the witness
    WITNESS = "witness"  # the third opinion sides with the hop
    UNDECIDED = "undecided"  # no third opinion, or it agrees with neither


def judge(primary_witness: bool, primary_third: bool | None, witness_third: bool | None) -> Culprit:
    """Who computed wrong, from which pairs of three opinions agree (None: no third opinion)."""
    if primary_witness:
        return Culprit.NONE
    if primary_third is None or witness_third is None or primary_third == witness_third:
        return Culprit.UNDECIDED
    return Culprit.WITNESS if primary_third else Culprit.PRIMARY


def _best_chain(
    candidates: list[PeerRecord], start: int, end: int, observed: dict[str, float], reused: Collection[str]
) -> list[PeerRecord] | None:
    """A chain from `start` to exactly `end`: fewest reused peers, then fewest hops, then least time.
    A hop may leave a peer before its last layer, as a route's may (client/route/planner.py)."""
    best: dict[int, tuple[int, int, float, list[PeerRecord]]] = {end: (0, 0, 0.0, [])}
    for layer in range(end - 1, start - 1, -1):
        for r in candidates:
            if r.start != layer:
                continue
            for leave in [e for e in range(layer + 1, min(r.end, end) + 1) if e in best]:
                hop = r if leave == r.end else replace(r, end=leave)
                again, hops, seconds, rest = best[leave]
                option = (
                    again + (r.peer_id in reused),
                    hops + 1,
                    seconds + 1.0 / max(expected_throughput(hop, observed), 1e-9),
                    [hop] + rest,
                )
                if layer not in best or option[:3] < best[layer][:3]:
                    best[layer] = option
    return best[start][3] if start in best else None


def _most_precise_chain(
    candidates: list[PeerRecord], start: int, end: int, observed: dict[str, float], reused: Collection[str]
) -> list[PeerRecord] | None:
    """`_best_chain`, preferring among chains that reuse equally few peers the one whose least
    precise weight format is the most precise: a check's bar is that of the formats it compares,
    so a chain through one int4 peer would check everything else at int4's bar."""
    best: tuple[int, float, list[PeerRecord]] | None = None
    for bar in sorted({FORMAT_TOLERANCE.get(r.weights, math.inf) for r in candidates}):
        within = [r for r in candidates if FORMAT_TOLERANCE.get(r.weights, math.inf) <= bar]
        chain = _best_chain(within, start, end, observed, reused)
        if chain is not None:
            option = (sum(r.peer_id in reused for r in chain), bar, chain)
            if best is None or option[:2] < best[:2]:
                best = option
    return None if best is None else best[2]


def alternative_route(
    records: list[PeerRecord],
    num_layers: int,
    primary: Collection[str],
    avoid: Collection[str] = (),
    observed: dict[str, float] | None = None,
    length: int = 0,
    first: int = 0,
) -> list[PeerRecord] | None:
    """A route from layer `first` for checking one that used the peers `primary`: it reuses as few
    of them as the swarm allows (warm backups welcome), so only the layers of the reused ones go
    unchecked, and among those it takes the most precise formats. None: no route."""
    candidates = [r for r in usable(records, avoid, backups=True, length=length) if r.end <= num_layers]
    return _most_precise_chain(candidates, first, num_layers, observed or {}, set(primary))


def witness_chain(
    records: list[PeerRecord],
    start: int,
    end: int,
    avoid: Collection[str],
    observed: dict[str, float] | None = None,
    length: int = 0,
) -> list[PeerRecord] | None:
    """Other peers that together compute exactly layers [start, end), none of them in `avoid`, of
    the most precise formats that can."""
    candidates = [r for r in usable(records, avoid, backups=True, length=length) if r.start < end]
    return _most_precise_chain(candidates, start, end, observed or {}, ())


def unchecked_layers(route: list[PeerRecord], primary: Collection[str]) -> list[tuple[int, int]]:
    """The ranges a checking route cannot vouch for: those it computed on the checked route's own peers."""
    return [(r.start, r.end) for r in route if r.peer_id in primary]
