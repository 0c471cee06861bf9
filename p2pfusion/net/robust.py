"""An average that a minority of bad members cannot steer far (pure): the outer step's aggregate of
the replicas' pseudo-gradients (net/averaging.py).

Members whose vector is not finite are left out, and, with three members or more, those whose
norm is over NORM_BOUND times the median norm, those further than DISTANCE_BOUND times the
median distance from the coordinate-wise median (a vector reversed and scaled up is as long as an
honest one, but far from the others), and then a minority that points away from the others'
coordinate-wise median (a cosine of 0 or less). That last catches an honest vector reversed,
which the distance does not: the replicas' pseudo-gradients of a model far from trained, each
from its own micro-batches, are as far from each other as from it, yet each agrees with the
others' median in direction (cosines of 0.17 to 0.5 measured in `scripts/bench_poisoned_run.py`).
The rest are combined by CenteredClip (Karimireddy, He and Jaggi, ICML 2021; used by BTARD,
Gorbunov et al. 2022): starting from the coordinate-wise median, each iteration moves by the mean
of the members' differences from the current point, each clipped to a radius of CLIP_SCALE times
their median distance. Members that agree are not clipped, and their average comes out; one far
from the others moves it by at most the radius over the member count. Two members cannot outvote
each other: their aggregate is their average.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NORM_BOUND = 10.0
DISTANCE_BOUND = 4.0  # times the median distance from the coordinate-wise median
CLIP_SCALE = 2.0
ITERATIONS = 3


@dataclass(frozen=True)
class Aggregate:
    value: torch.Tensor
    left_out: tuple[int, ...]  # indices of the members whose vectors were not used at all


def _median(stacked: torch.Tensor, ordered: torch.Tensor | None = None) -> torch.Tensor:
    """Coordinate-wise median of [members, n], the mean of the middle two for an even count;
    `ordered`: its values sorted along members, when the caller has them."""
    ordered = stacked.sort(dim=0).values if ordered is None else ordered
    count = ordered.shape[0]
    if count % 2:
        return ordered[count // 2].clone()
    return (ordered[count // 2 - 1] + ordered[count // 2]) / 2


def _opposed(stacked: torch.Tensor, ordered: torch.Tensor) -> list[int]:
    """The members whose cosine with the coordinate-wise median of the others is not positive (a
    zero vector points nowhere); `ordered`: `stacked` sorted along members. A member's own value
    counts in no median it is compared with: the others' p-th value is the sorted p-th where that
    is below the member's, else the next."""
    count = ordered.shape[0]
    middle = [(count - 2) // 2] if count % 2 == 0 else [(count - 1) // 2 - 1, (count - 1) // 2]
    opposed = []
    for k, vector in enumerate(stacked):
        picks = [torch.where(ordered[p] < vector, ordered[p], ordered[p + 1]) for p in middle]
        median = picks[0] if len(picks) == 1 else (picks[0] + picks[1]) / 2
        scale = float(vector.norm() * median.norm())
        if scale == 0.0 or float(vector @ median) / scale <= 0.0:
            opposed.append(k)
    return opposed


def robust_mean(vectors: list[torch.Tensor]) -> Aggregate:
    """The members' flat float32 vectors (equal lengths) combined, for any input: with no usable
    member, zeros (an outer step that changes nothing)."""
    finite = [i for i, v in enumerate(vectors) if bool(torch.isfinite(v).all())]
    if len(finite) >= 3:
        norms = torch.stack([vectors[i].norm() for i in finite])
        bound = NORM_BOUND * float(norms.median())
        finite = [i for i, norm in zip(finite, norms.tolist()) if norm <= bound]
    if not finite:
        return Aggregate(torch.zeros_like(vectors[0]), tuple(range(len(vectors))))
    stacked = torch.stack([vectors[i] for i in finite])
    ordered = stacked.sort(dim=0).values
    center = _median(stacked, ordered)
    if len(finite) >= 3:
        distances = (stacked - center).norm(dim=1)
        bound = DISTANCE_BOUND * float(distances.median())
        kept = [k for k, distance in enumerate(distances.tolist()) if distance <= bound]
        if len(kept) < len(finite):  # the sort over every member's values again, only when one went
            finite = [finite[k] for k in kept]
            stacked = stacked[kept]
            ordered = stacked.sort(dim=0).values
            center = _median(stacked, ordered)
    if len(finite) >= 3:
        opposed = _opposed(stacked, ordered)
        if 0 < len(opposed) < len(finite) / 2:  # a majority's direction, or none to trust
            kept = [k for k in range(len(finite)) if k not in opposed]
            finite = [finite[k] for k in kept]
            stacked = stacked[kept]
            center = _median(stacked)
    left_out = tuple(i for i in range(len(vectors)) if i not in finite)
    if len(finite) <= 2:
        return Aggregate(stacked.mean(dim=0) if len(finite) == 2 else center, left_out)
    radius = CLIP_SCALE * float((stacked - center).norm(dim=1).median())
    for _ in range(ITERATIONS):
        differences = stacked - center
        distances = differences.norm(dim=1, keepdim=True)
        scale = torch.where(distances > radius, radius / distances.clamp_min(1e-30), torch.ones_like(distances))
        center = center + (differences * scale).mean(dim=0)
    return Aggregate(center, left_out)
