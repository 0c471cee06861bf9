"""The client's own float32 computation of the model's layers: for a disputed hop (client/checks/blame.py)
and for the steps of canaries and fault reports (client/checks/evidence.py).

Stages are loaded from the client's copy of the weights on first use and kept, as long as the
weights they need stay within LOCAL_BYTES: a client of a model too large for that computes
nothing here, and says so once.
"""

from __future__ import annotations

import logging
import threading

import torch
from torch import nn

from p2pfusion.models.source import ModelSource
from p2pfusion.models.stage import Stage, load_stage

log = logging.getLogger(__name__)

LOCAL_BYTES = 2 << 30  # the most weight bytes the client loads to compute layers itself


class Recomputer:
    def __init__(self, source: ModelSource, head: nn.Module, num_layers: int):
        self.source = source
        self.head = head
        self.num_layers = num_layers
        self._stages: dict[tuple[int, int], Stage] = {}
        self._lock = threading.Lock()  # stages load on worker threads
        self._warned = False

    @property
    def vocab_size(self) -> int:
        return self.head.get_input_embeddings().num_embeddings

    def fits(self, start: int, end: int) -> bool:
        weights = sum(f.stat().st_size for f in self.source.folder.glob("*.safetensors"))
        fits = weights * (end - start) / self.num_layers <= LOCAL_BYTES
        if not fits and not self._warned:
            self._warned = True
            log.warning("this model is too large to compute its layers here: disputes and canaries go unchecked")
        return fits

    def stage(self, start: int, end: int) -> Stage | None:
        """Layers [start, end) in float32, or None when they are too large to hold here."""
        with self._lock:
            if (start, end) not in self._stages:
                if not self.fits(start, end):
                    return None
                log.info("computing layers %d:%d here to check peers' results", start, end)
                self._stages[(start, end)] = load_stage(self.source, start, end)
            return self._stages[(start, end)]

    def forward(self, start: int, end: int, hidden: torch.Tensor, positions=None, mask=None) -> torch.Tensor | None:
        stage = self.stage(start, end)
        if stage is None:
            return None
        with torch.inference_mode():
            return stage.forward(hidden.float(), 0, None, mask, positions).to(hidden.dtype)

    def states(self, tokens: list[int], boundaries: list[int]) -> dict[int, torch.Tensor] | None:
        """The float32 hidden states [1, len(tokens), hidden] at each layer of `boundaries` (0: the
        embeddings), computed as one prefill; None when the layers are too large to hold here."""
        with torch.inference_mode():
            hidden = self.head.get_input_embeddings()(torch.tensor([tokens])).float()
        return self.through(hidden, 0, boundaries)

    def through(
        self, hidden: torch.Tensor, start: int, boundaries: list[int], positions=None, mask=None,
    ) -> dict[int, torch.Tensor] | None:
        """The float32 states at each layer of `boundaries` from `hidden`, the input of layer
        `start`, as one prefill; None when the layers are too large to hold here."""
        if not self.fits(start, max(boundaries)):
            return None
        states, at = {start: hidden.float()}, start
        for layer in sorted(set(boundaries) - {start}):
            states[layer] = self.forward(at, layer, states[at], positions, mask)
            if states[layer] is None:
                return None
            at = layer
        return states
