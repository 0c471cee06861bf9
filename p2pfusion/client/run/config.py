"""A training run's settings, as its driver is given them (docs/training.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2pfusion.dht.records import is_peer_id
from p2pfusion.errors import RequestError
from p2pfusion.net import run_messages as t


@dataclass(frozen=True)
class RunConfig:
    run: str
    sync_every: int = 20  # H: inner steps between outer steps
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    outer_lr: float = 0.7  # DiLoCo's Nesterov settings; 1.0 and 0.0 make the outer step a plain average
    outer_momentum: float = 0.9
    averaging: str = "none"  # or "float16": the pseudo-gradients' precision on the wire
    averaging_timeout: float = 60.0  # a member silent this long is left out of a round
    wait: float = 300.0  # how long a step waits for a stage that has no replica
    # the run's charter (dht/records.py): the largest inner learning rate any step may use (None:
    # `lr`), and the replicas admitted (None: every replica that announces the run)
    max_lr: float | None = None
    replicas: tuple[str, ...] | None = None
    identity: str | None = None  # the driver's key file (made if missing); None: one kept per model and run

    def check(self) -> None:
        t.check_run_name(self.run)
        if self.sync_every < 1:
            raise RequestError(f"sync_every must be at least 1, got {self.sync_every}")
        if self.max_lr is not None and not (math.isfinite(self.max_lr) and self.max_lr >= self.lr):
            raise RequestError(f"max_lr must be a finite number at least lr ({self.lr}), got {self.max_lr}")
        if self.replicas is not None and not all(is_peer_id(p) for p in self.replicas):
            raise RequestError("replicas must be peer ids")
        if self.averaging not in ("none", "float16"):
            raise RequestError(f"averaging must be 'none' or 'float16', got {self.averaging!r}")
        if not 0 < self.outer_lr <= 10 or not 0 <= self.outer_momentum < 1 or self.lr < 0:
            raise RequestError("outer_lr must be in (0, 10], outer_momentum in [0, 1), lr >= 0")
