"""A session's trainable parameters as its hops get them (the client's adapter, client/tune/adapter.py):
the `Params` message naming them, and their values in one float32 tensor.

Parameters are named by their global layer (`layers.{L}....`, models/tuning.py), so the part any
range of layers takes is known without asking the peers: a hop keeps its layers' part and passes
the rest on, a checking route gets the part for the layers it computes, and the client's own local
layers apply theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from p2pfusion.models.tuning import layer_of
from p2pfusion.net import messages as m
from p2pfusion.net.payloads import flatten, unflatten


@dataclass(frozen=True)
class SessionParams:
    message: m.Params
    flat: torch.Tensor = field(repr=False)

    @property
    def digest(self) -> str:
        return self.message.digest

    def named(self) -> dict[str, torch.Tensor]:
        """Each parameter's values, by its global name."""
        values = unflatten(self.flat, [shape for _, shape in self.message.entries])
        return {name: value for (name, _), value in zip(self.message.entries, values)}

    def layers(self, start: int, end: int) -> SessionParams | None:
        """The part that layers [start, end) take (None: no parameter is theirs)."""
        kept = {name: value for name, value in self.named().items() if start <= layer_of(name) < end}
        if len(kept) == len(self.message.entries):
            return self
        if not kept:
            return None
        entries = [(name, list(value.shape)) for name, value in kept.items()]
        return SessionParams(m.Params(self.digest, self.message.scaling, entries), flatten(list(kept.values())))
