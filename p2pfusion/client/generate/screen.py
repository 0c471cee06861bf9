"""Greedy decoding's next token, screened in a narrower format: exactly the token of the float32
LM head, for a fraction of its cost on a CPU client.

On a CPU the head is a matrix-vector product over the whole vocabulary, bound by memory bandwidth:
113 MB of float32 weights for SmolLM2-135M (7 ms per token here, a sixth of decoding), 2 GB for
Llama-3-8B. A float16 copy halves the bytes read. Every float16 logit lies within a proven bound
of the float32 one, so only the tokens whose bound reaches the best lower bound can be the argmax;
their float32 logits are computed from the float32 rows, and the largest wins. When the two best
are too close for any float32 summation order to agree on (about 1% of the default model's tokens
here), the caller runs the full float32 head, as it always did.

The bound, for row w and input x of length d, with u the format's unit roundoff (2^-11 for
float16), g = d 2^-24 / (1 - d 2^-24) (float32 summation in any order; torch's float16
matrix-vector product accumulates in float32 unless reduced-precision reductions are switched on):
    |z16 - z32| <= (2u + u^2 + 2g) sum|w_i x_i| + u |z16| + 2^-24 + sqrt(d) 2^-24 (|w| + |x|),
the last two terms for float16's subnormals, and sum|w_i x_i| <= |w| |x| (Cauchy-Schwarz), with the row
norms computed once. A safety factor of 1.5 covers the rounding of the norms themselves.

Several rows at once (`next_tokens`) cost less as one product than screened one by one. Where the
CPU multiplies bfloat16 natively (AVX512-BF16, AMX), a bfloat16 product of 8 rows took 4 ms here
against 13 ms in float32, and the same bound holds with u = 2^-8 (bfloat16 keeps float32's
exponents, so the subnormal terms only add slack), provided the kernel sums the products in
float32, as oneDNN's and torch's own CPU kernels do. That is checked on this machine, once per
count of rows, on the call's own data (`_sums_in_float32`); where a bfloat16 product is slower,
the caller keeps float32 (client/generate/greedy.py measures both).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

U16 = 2.0 ** -11  # float16's unit roundoff
UBF16 = 2.0 ** -8  # bfloat16's
F32_TERM = 2.0 ** -24
SAFETY = 1.5
FLOAT16_SAFE = 6.0e4  # inputs beyond this would overflow float16: the full head decides
# past this many candidates the full head decides; their exact logits cost a fraction of it until
# then (1,024 of the default model's 49,152 rows: 2.4 MB read against 113 MB)
MAX_CANDIDATES = 1024
NEAR = 2.0 * (1 + 2.0 ** -10)  # 2 `most` (_decide), widened for the rounding of that threshold itself
CHECKED_ROWS = 2048  # vocabulary rows the check of a bfloat16 kernel compares in float64
TIE_SLACK = 2.0 ** -20  # for the rounding of a tie's bound itself (norms rounded up, sums in float64)


def summation_error(d: int) -> float:
    """The relative error bound of a float32 sum of d products, in any order."""
    return d * F32_TERM / (1 - d * F32_TERM)


@dataclass
class ScreenedHead:
    weight: torch.Tensor  # float32 [vocab, hidden]
    half: torch.Tensor  # its float16 copy
    norms: torch.Tensor  # float32 [vocab]: each row's L2 norm, rounded up
    top_norm: float  # the largest of them
    brain: torch.Tensor | None = None  # its bfloat16 copy, made when many rows are first screened in it
    sound: dict[int, bool] = field(default_factory=dict)  # rows -> whether the bfloat16 kernel sums in float32

    @classmethod
    def of(cls, weight: torch.Tensor) -> ScreenedHead:
        weight = weight.detach()
        norms = (weight.double().norm(dim=1) * (1 + 1e-6)).float()
        return cls(weight, weight.to(torch.float16), norms, float(norms.max()))

    def next_token(self, x: torch.Tensor) -> int | None:
        """argmax(weight @ x) for a float32 vector x, or None when only the full head can tell."""
        if not bool(torch.isfinite(x).all()) or float(x.abs().max()) > FLOAT16_SAFE:
            return None
        screened = nn.functional.linear(x.to(torch.float16), self.half).float()
        return self._decide(x[None], screened[None], U16)[0]

    def next_tokens(self, x: torch.Tensor, bfloat16: bool = False) -> list[int | None]:
        """argmax(weight @ x_i) for each float32 row of x [rows, hidden] (None where only the full
        head can tell), as one product: screened in bfloat16 when asked and sound here, else in
        float32, whose top two logits are kept only when no float32 summation order could swap them."""
        rows = x.shape[0]
        if bfloat16 and self.sound.get(rows, True):
            if self.brain is None:
                self.brain = self.weight.to(torch.bfloat16)
            low = x.to(torch.bfloat16)
            screened = nn.functional.linear(low, self.brain)
            if rows not in self.sound:
                self.sound[rows] = self._sums_in_float32(low, screened)
            if self.sound[rows]:
                return self._decide(x, screened.float(), UBF16)
        # the vocabulary as the left operand: MKL's kernel for a few right-hand columns takes
        # half the time of `linear`'s for 2 to 8 rows here (docs/benchmarks.md)
        logits = (self.weight @ x.T).T
        top = torch.topk(logits, 2, dim=1)
        g = summation_error(x.shape[-1])
        tokens: list[int | None] = []
        for row, (values, indices) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
            sure = math.isfinite(values[0]) and math.isfinite(values[1])
            sure = sure and self._apart(values[0] - values[1], indices, x[row], float(x[row].double().norm()), g)
            tokens.append(indices[0] if sure else None)
        return tokens

    def _decide(self, x: torch.Tensor, screened: torch.Tensor, u: float) -> list[int | None]:
        """Each row's token from its screened logits [rows, vocab], rounded with unit roundoff `u`.

        A logit's bound is `scale * |w| + offset + SAFETY u |z|` (the module's docstring), at most
        `most` for any token of the row. The floor (the best lower bound) is at least the best
        screened logit less `most`, so only tokens within 2 `most` of the best can reach it, and the
        floor itself is one of theirs: the bounds are computed for those few only."""
        d = x.shape[-1]
        g = summation_error(d)
        x_norms = x.double().norm(dim=1)
        low, high = screened.amin(dim=1), screened.amax(dim=1)  # NaN and inf show in these (aminmax: 40x slower here)
        finite = (torch.isfinite(low) & torch.isfinite(high) & torch.isfinite(x_norms)).tolist()
        norm = x_norms.float()
        tail = math.sqrt(d) * F32_TERM
        scale = SAFETY * ((2 * u + u * u + 2 * g) * norm + tail)
        offset = SAFETY * (F32_TERM + tail * norm)
        most = scale * self.top_norm + offset + SAFETY * u * torch.maximum(high.abs(), low.abs())
        rows, ids = torch.nonzero(screened >= (high - NEAR * most)[:, None]).unbind(dim=1)
        values = screened[rows, ids]
        error = scale[rows] * self.norms[ids] + offset[rows] + SAFETY * u * values.abs()
        floors = torch.full_like(high, -math.inf).scatter_reduce(0, rows, values - error, "amax")
        reach = values + error >= floors[rows]
        rows, ids = rows[reach], ids[reach]
        counts = torch.bincount(rows, minlength=x.shape[0])
        few = counts[rows] <= MAX_CANDIDATES
        rows, ids = rows[few], ids[few]
        # the candidates' float32 logits, each summed in its own order: `_apart` allows for any
        exact = (self.weight[ids] * x[rows]).sum(dim=1)
        best: dict[int, list[tuple[float, int]]] = {}
        for row, token, logit in zip(rows.tolist(), ids.tolist(), exact.tolist()):
            best.setdefault(row, []).append((logit, token))
        tokens: list[int | None] = []
        for row, count in enumerate(counts.tolist()):
            if not finite[row] or count > MAX_CANDIDATES:
                tokens.append(None)
            elif count == 1:
                tokens.append(best[row][0][1])
            else:
                (first, a), (second, b) = sorted(best[row], reverse=True)[:2]
                tokens.append(a if self._apart(first - second, (a, b), x[row], float(x_norms[row]), g) else None)
        return tokens

    def _apart(self, gap: float, pair: list[int] | tuple[int, int], x: torch.Tensor, x_norm: float, g: float) -> bool:
        """Whether the best two float32 logits are far enough apart that no float32 summation
        order could swap them. A float32 sum of the products w_i x_i errs by at most g sum|w_i x_i|
        in any order, so the gap this product found and the full head's own differ by at most
        2g (sum|w_a x| + sum|w_b x|). Cauchy-Schwarz bounds each sum by |w| |x| at no cost; only a
        near tie computes the two sums themselves, in float64 (about half of |w| |x| here)."""
        first, second = pair
        if gap > 2 * g * x_norm * float(self.norms[first] + self.norms[second]) * (1 + TIE_SLACK):
            return True
        sums = float((self.weight[[first, second]].double().abs() @ x.double().abs()).sum())
        return gap > 2 * g * sums * (1 + TIE_SLACK)

    def _sums_in_float32(self, low: torch.Tensor, screened: torch.Tensor) -> bool:
        """Whether this bfloat16 product's results lie within float32 summation's bound (and their
        own rounding to bfloat16) of the exact products of the rounded operands, on the first
        CHECKED_ROWS vocabulary rows: a kernel that sums or multiplies in bfloat16 errs by far more."""
        w, x = self.brain[:CHECKED_ROWS].double(), low.double()
        exact = x @ w.T
        spread = x.abs() @ w.abs().T
        allowed = SAFETY * (summation_error(x.shape[-1]) * spread + UBF16 * exact.abs()) + 2.0 ** -126
        return bool(((screened[:, :CHECKED_ROWS].double() - exact).abs() <= allowed).all())


def screened_head(model: nn.Module) -> ScreenedHead | None:
    """A screen for a causal LM whose logits are its plain linear head applied to the decoder's
    output (not for soft-capped, scaled or biased heads), in float32 on the CPU."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return None
    if head.weight.dtype != torch.float32 or head.weight.device.type != "cpu":
        return None
    probe = torch.randn(1, 1, head.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = head(model.base_model(inputs_embeds=probe).last_hidden_state)
        if not torch.equal(plain, model(inputs_embeds=probe).logits):
            return None
    return ScreenedHead.of(head.weight)


def final_norm(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The decoder's output as the head takes it, from hidden states [rows, 1, hidden] past the
    last layer: the model's final norm module, where it gives exactly what its base model's
    forward does (0.22 ms for 8 rows here, against 0.66 ms for the forward, which builds masks
    and positions first), else that forward."""
    base = model.base_model

    def whole(hidden: torch.Tensor) -> torch.Tensor:
        return base(inputs_embeds=hidden).last_hidden_state

    norm = getattr(base, "norm", None)
    if not isinstance(norm, nn.Module):
        return whole
    probe = torch.randn(2, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return norm if torch.equal(norm(probe), whole(probe)) else whole
