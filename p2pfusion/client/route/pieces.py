"""How a step's tensors are cut to fit the peers: pure functions, tested without a network.

An inference step's tokens go in pieces that the hops work on at once, as a pipeline; a training
batch goes as chunks of whole sequences, each within what a peer takes in one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from p2pfusion.errors import RequestError
from p2pfusion.net import messages as m

if TYPE_CHECKING:
    from p2pfusion.client.route.session import RouteSession

MIN_CHUNK_TOKENS = 64  # smaller pieces make matrix products less efficient than the overlap gains


def chunk_sizes(tokens: int, hops: int) -> list[int]:
    """How to split an inference step's tokens so the hops work on pieces at once, as a pipeline:
    hop 2 computes the first piece while hop 1 computes the second. Pieces of at least
    MIN_CHUNK_TOKENS, no more pieces than hops (beyond that they only add per-step costs)."""
    pieces = max(1, min(hops, tokens // MIN_CHUNK_TOKENS))
    return [tokens // pieces + (i < tokens % pieces) for i in range(pieces)]


@dataclass
class Chunk:
    """Some sequences of a batch, as one training step on the peers."""

    hidden: torch.Tensor
    mask: torch.Tensor | None
    positions: torch.Tensor
    step: int = 0  # its number in `session`, once sent
    session: RouteSession | None = field(default=None, repr=False)


def split_batch(
    hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, max_tokens: int = m.MAX_STEP_TOKENS
) -> list[Chunk]:
    """Whole sequences per chunk, as many as fit in `max_tokens`; at most MAX_SAVED chunks, which
    is what peers keep between a forward pass and its backward."""
    batch, tokens = hidden.shape[:2]
    if tokens > max_tokens:
        raise RequestError(f"sequences of {tokens} tokens are longer than peers take in one step ({max_tokens})")
    rows = max_tokens // tokens
    if -(-batch // rows) > m.MAX_SAVED:
        raise RequestError(
            f"a batch of {batch} sequences of {tokens} tokens is larger than the peers accept: at most "
            f"{rows * m.MAX_SAVED} such sequences per forward pass ({m.MAX_SAVED} steps of {max_tokens} tokens)"
        )
    return [
        Chunk(h, None if mask is None else mask[i:i + rows], positions[i:i + rows])
        for i, h in zip(range(0, batch, rows), hidden.split(rows))
    ]
