"""Greedy decoding's next token, screened in float16: exactly the token of the float32 LM head, for
about half its cost on a CPU client.

On a CPU the head is a matrix-vector product over the whole vocabulary, bound by memory bandwidth:
113 MB of float32 weights for SmolLM2-135M (7 ms per token here, a sixth of decoding), 2 GB for
Llama-3-8B. A float16 copy halves the bytes read. Every float16 logit lies within a proven bound
of the float32 one, so only the tokens whose bound reaches the best lower bound can be the argmax;
their float32 logits are computed from the float32 rows, and the largest wins. When the two best
are too close for any float32 summation order to agree on (about 2% of tokens), the caller runs the
full float32 head, as it always did.

The bound, for row w and input x of length d, with u = 2^-11 (float16 rounding), g = d 2^-24 / (1 -
d 2^-24) (float32 summation in any order; torch's float16 matrix-vector product accumulates in
float32 unless reduced-precision reductions are switched on):
    |z16 - z32| <= (2u + u^2 + 2g) sum|w_i x_i| + u |z16| + 2^-24 + sqrt(d) 2^-24 (|w| + |x|),
the last two terms for float16's subnormals, and sum|w_i x_i| <= |w| |x| (Cauchy-Schwarz), with the row
norms computed once. A safety factor of 1.5 covers the rounding of the norms themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

U16 = 2.0 ** -11
F32_TERM = 2.0 ** -24
SAFETY = 1.5
FLOAT16_SAFE = 6.0e4  # inputs beyond this would overflow float16: the full head decides
MAX_CANDIDATES = 64  # past this the screen saves nothing


def summation_error(d: int) -> float:
    """The relative error bound of a float32 sum of d products, in any order."""
    return d * F32_TERM / (1 - d * F32_TERM)


@dataclass
class ScreenedHead:
    weight: torch.Tensor  # float32 [vocab, hidden]
    half: torch.Tensor  # its float16 copy
    norms: torch.Tensor  # float32 [vocab]: each row's L2 norm, rounded up

    @classmethod
    def of(cls, weight: torch.Tensor) -> ScreenedHead:
        weight = weight.detach()
        norms = (weight.double().norm(dim=1) * (1 + 1e-6)).float()
        return cls(weight, weight.to(torch.float16), norms)

    def next_token(self, x: torch.Tensor) -> int | None:
        """argmax(weight @ x) for a float32 vector x, or None when only the full head can tell."""
        d = x.shape[-1]
        x_norm = float(x.double().norm())
        if not math.isfinite(x_norm) or float(x.abs().max()) > FLOAT16_SAFE:
            return None
        screened = nn.functional.linear(x.to(torch.float16), self.half).float()
        if not torch.isfinite(screened).all():
            return None
        g = summation_error(d)
        error = ((2 * U16 + U16 * U16 + 2 * g) * x_norm) * self.norms
        error += U16 * screened.abs() + F32_TERM + (math.sqrt(d) * F32_TERM) * (self.norms + x_norm)
        error *= SAFETY
        best_floor = float((screened - error).max())
        candidates = torch.nonzero(screened + error >= best_floor).flatten()
        if candidates.numel() > MAX_CANDIDATES:
            return None
        if candidates.numel() == 1:
            return int(candidates[0])
        exact = nn.functional.linear(x, self.weight[candidates])
        top = torch.topk(exact, 2)
        first, second = candidates[top.indices[0]], candidates[top.indices[1]]
        # two float32 sums of the same products differ by at most 2g sum|w_i x_i|: a closer pair
        # might come out in the other order from the full head's own kernel
        tie = 2 * g * x_norm * float(torch.maximum(self.norms[first], self.norms[second])) * SAFETY
        if float(top.values[0] - top.values[1]) <= tie:
            return None
        return int(first)


    def next_tokens(self, x: torch.Tensor) -> list[int | None]:
        """argmax(weight @ x_i) for each float32 row of x [rows, hidden] (None where only the full
        head can tell). Many rows go as one float32 matrix product, which on a CPU costs less
        than screening them one by one (docs/benchmarks.md), and whose top two logits are kept
        only when no float32 summation order could swap them."""
        # the vocabulary as the left operand: MKL's kernel for a few right-hand columns takes
        # half the time of `linear`'s for 2 to 8 rows here (docs/benchmarks.md)
        logits = (self.weight @ x.T).T
        top = torch.topk(logits, 2, dim=1)
        g = summation_error(x.shape[-1])
        tokens: list[int | None] = []
        for row, (values, indices) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
            x_norm = float(x[row].double().norm())
            tie = 2 * g * x_norm * float(torch.maximum(self.norms[indices[0]], self.norms[indices[1]])) * SAFETY
            sure = math.isfinite(values[0]) and math.isfinite(values[1]) and values[0] - values[1] > tie
            tokens.append(indices[0] if sure else None)
        return tokens


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
