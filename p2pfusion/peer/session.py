"""One session on a peer: its state, the checks on what it receives, and how it packs what it sends.

An inference session keeps a KV cache and grows step by step. A training session keeps no cache:
each step is a full forward, whose input is kept until its `Backward` comes (at most MAX_SAVED
steps at once, so a client cannot fill the peer's memory).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from p2pfusion.errors import RequestError
from p2pfusion.models.stage import Stage
from p2pfusion.net.codecs import Codec, ErrorFeedback, Packed, pack
from p2pfusion.net.compression import AUTO, LinkSpeed, Purpose, choose_codec

MAX_SAVED = 8


@dataclass
class Session:
    session_id: str
    max_length: int
    stage: Stage  # kept per session: sessions opened before a move finish on the old layers
    upstream: asyncio.StreamWriter
    purpose: Purpose = Purpose.INFERENCE
    compression: str = AUTO
    link: LinkSpeed | None = None  # to the next hop, or from the last hop to the client
    upstream_link: LinkSpeed | None = None  # to whoever sent us the session (gradients go there)
    cache: object | None = None
    length: int = 0
    downstream: asyncio.StreamWriter | None = None
    sink: asyncio.StreamWriter | None = None
    relay: asyncio.Task | None = field(default=None, repr=False)
    saved: dict[int, torch.Tensor] = field(default_factory=dict)  # training: step -> its input
    compute_seconds: float = 0.0  # of the last step: the time budget of a training transfer
    feedback: dict[str, ErrorFeedback] = field(default_factory=dict)  # top-k residuals, per direction

    @property
    def training(self) -> bool:
        return self.purpose == Purpose.TRAINING

    def check_hidden(self, tensor: torch.Tensor | None) -> torch.Tensor:
        stage = self.stage
        if tensor is None:
            raise RequestError("step carries no hidden states")
        if tensor.dtype != stage.dtype:
            raise RequestError(f"hidden states must be {stage.dtype}, got {tensor.dtype}")
        if tensor.dim() != 3 or tensor.shape[0] < 1 or tensor.shape[1] < 1 or tensor.shape[2] != stage.hidden_size:
            raise RequestError(
                f"hidden states must have shape [batch, tokens, {stage.hidden_size}], got {list(tensor.shape)}"
            )
        length = tensor.shape[1] + (0 if self.training else self.length)
        if length > self.max_length:
            raise RequestError(f"session length {length} exceeds its max_length {self.max_length}")
        if self.training and len(self.saved) >= MAX_SAVED:
            raise RequestError(f"{MAX_SAVED} training steps already await their backward pass")
        if not torch.isfinite(tensor).all():
            raise RequestError("hidden states contain NaN or infinity")
        return tensor

    def take_saved(self, step: int, grad: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The input kept for `step`, and its output's gradient once checked against it."""
        if not self.training:
            raise RequestError("backward: this is not a training session")
        if step not in self.saved:
            raise RequestError(f"backward: no forward of step {step} awaits its backward pass")
        hidden = self.saved[step]  # kept until a valid gradient comes, so a client may send it again
        if grad is None or grad.dtype != hidden.dtype or grad.shape != hidden.shape:
            got = None if grad is None else (grad.dtype, list(grad.shape))
            raise RequestError(f"backward: the gradient must be {hidden.dtype} of shape {list(hidden.shape)}, got {got}")
        if not torch.isfinite(grad).all():
            raise RequestError("backward: the gradient contains NaN or infinity")
        return self.saved.pop(step), grad

    def pack(self, tensor: torch.Tensor, upstream: bool = False) -> Packed:
        """Pack an output (downstream) or an input gradient (upstream) for its link."""
        link = self.upstream_link if upstream else self.link
        budget = self.compute_seconds if self.training else None
        choice = choose_codec(link, tensor.numel() * 4, self.purpose, self.compression, budget)
        if choice.codec == Codec.TOPK:
            feedback = self.feedback.setdefault("up" if upstream else "down", ErrorFeedback())
            return feedback.pack(tensor, choice.k)
        return pack(tensor, choice.codec, choice.k)
