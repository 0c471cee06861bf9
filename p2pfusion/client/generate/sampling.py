"""How the client picks a token from the logits the head gives: greedy, or sampled."""

from __future__ import annotations

import torch


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` with all but its nucleus zeroed: the likeliest tokens whose probabilities reach `top_p`
    together (the likeliest always stays), the tokens transformers' top-p sampling keeps."""
    ordered, order = probs.sort(descending=True)
    before = ordered.cumsum(-1) - ordered  # the mass of the likelier tokens
    outside = before >= top_p
    outside[..., 0] = False
    return torch.zeros_like(probs).scatter(-1, order, ordered.masked_fill(outside, 0.0))


def choose_token(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None, top_p: float = 1.0
) -> int:
    """Temperature 0 is greedy; otherwise sample from the softened distribution, within its nucleus
    when `top_p` < 1 (taken after the temperature, as transformers does)."""
    if temperature <= 0:
        return int(logits.argmax(-1))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        probs = nucleus(probs, top_p)
    return int(torch.multinomial(probs, 1, generator=generator))
