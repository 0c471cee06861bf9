"""A training replica of a stage: trainable weights, the inner optimizer that steps them on the
micro-batches routed here, and the outer step the stage's replicas take together (DiLoCo,
arXiv 2311.08105).

Peers serving the same layers of one run are replicas of one stage. Each accumulates the weight
gradients of the micro-batches it ran (their forward and backward both ran here, between two
steps, so against one weight version) and takes an AdamW step when the run's driver says the
step is complete. Every H inner steps the driver starts an outer step: each replica's
pseudo-gradient is the outer weights (where the window started) minus its weights now; the
replicas average it (net/averaging.py), and each applies the same Nesterov step to the outer
weights and continues from them. With one replica, outer lr 1 and momentum 0, the outer step
leaves the weights where the inner steps took them, so training equals local training.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from p2pfusion.errors import RequestError
from p2pfusion.models.formats import LAYER_PREFIX, WeightFormat
from p2pfusion.models.stage import Stage


@dataclass(frozen=True)
class InnerHyper:
    """The inner optimizer's settings for one step: the driver's, so a run's schedule is its own."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def check(self) -> None:
        values = (self.lr, *self.betas, self.eps, self.weight_decay)
        if not all(math.isfinite(v) and v >= 0 for v in values) or not all(b < 1 for b in self.betas):
            raise RequestError(f"inner optimizer settings out of range: {self}")


@dataclass(frozen=True)
class OuterHyper:
    """The outer step's Nesterov settings (DiLoCo's defaults: lr 0.7, momentum 0.9)."""

    lr: float = 0.7
    momentum: float = 0.9

    def check(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0 and math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            raise RequestError(f"outer step settings out of range: {self}")


def weights_digest(tensors: list[torch.Tensor]) -> bytes:
    """sha256 of tensors' float32 values, in order: replicas whose outer weights agree share it."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.digest()


def global_name(stage: Stage, local: str) -> str:
    """`layers.3.mlp.up_proj.weight` of a stage starting at layer 10 -> `model.layers.13.mlp.up_proj.weight`."""
    index, rest = local[len("layers."):].split(".", 1)
    return f"{LAYER_PREFIX}{stage.start + int(index)}.{rest}"


class Replica:
    def __init__(self, stage: Stage, run: str):
        if stage.format != WeightFormat.FLOAT32:
            raise RequestError(f"a training replica holds float32 weights, not {stage.format.value}")
        self.stage = stage
        self.run = run
        self.names = [global_name(stage, n) for n, _ in stage.module.named_parameters()]
        self.weights = [p for _, p in stage.module.named_parameters()]
        for weight in self.weights:
            weight.requires_grad_(True)
        self.outer = [w.detach().clone() for w in self.weights]  # where this window started
        self.momentum = [torch.zeros_like(w) for w in self.weights]
        self.optimizer = torch.optim.AdamW(self.weights, lr=0.0)
        self.step = 0  # inner steps taken
        self.round = 0  # outer steps taken
        self.micro = 0  # backward passes whose gradients wait for the next inner step
        # of the outer weights, which change only at an outer step or a load (on the compute thread)
        self.digest = weights_digest(self.outer)

    def shapes(self) -> dict[str, list[int]]:
        return {name: list(w.shape) for name, w in zip(self.names, self.weights)}

    def ran_backward(self) -> None:
        self.micro += 1

    def apply(self, round_: int, step: int, passes: int, chains: int, hyper: InnerHyper) -> None:
        """The inner step `step` of the window after outer step `round_`, over the `chains`
        micro-batches the driver routed here in `passes` backward passes (their gradients
        averaged). Refused, with the weights untouched, when anything disagrees. A replica that
        joined mid-window skips the steps before it joined."""
        hyper.check()
        if round_ != self.round:
            raise RequestError(f"inner step {step} follows outer step {round_}, but this replica has taken {self.round}")
        if step < self.step:
            raise RequestError(f"inner step {step} asked, but this replica has taken {self.step}")
        if passes != self.micro or not 1 <= chains <= passes:
            raise RequestError(f"step {step}: the driver counts {passes} backward passes here, this replica ran {self.micro}")
        grads = [w.grad for w in self.weights]
        if any(g is None for g in grads):
            self.discard()
            raise RequestError(f"step {step}: some weights got no gradient; step refused")
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            self.discard()
            raise RequestError(f"step {step}: the gradients hold NaN or infinity; step refused, weights untouched")
        for g in grads:
            g.div_(chains)
        for group in self.optimizer.param_groups:
            group.update(lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay)
        self.optimizer.step()
        self.discard()
        self.step = step + 1

    def discard(self) -> None:
        """Drop the gradients gathered since the last step (a step the driver redoes elsewhere)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.micro = 0

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """On the CPU, where the all-reduce serializes it."""
        return [(o - w.detach()).cpu() for o, w in zip(self.outer, self.weights)]

    def outer_step(self, averaged: list[torch.Tensor], hyper: OuterHyper) -> None:
        """Nesterov on the outer weights with the replicas' averaged pseudo-gradient; the inner
        weights start the next window from the result."""
        hyper.check()
        with torch.no_grad():
            for outer, buf, delta, weight in zip(self.outer, self.momentum, averaged, self.weights):
                delta = delta.to(outer.device)
                buf.mul_(hyper.momentum).add_(delta)
                outer.sub_(delta.add(buf, alpha=hyper.momentum), alpha=hyper.lr)
                weight.copy_(outer)
        self.round += 1
        self.digest = weights_digest(self.outer)

    def state(self) -> dict[str, list[torch.Tensor]]:
        """What a joining replica needs to go on from here: the outer weights, the outer momentum
        and the inner optimizer's moments (a joiner starts the window from the outer weights)."""
        moments = [self.optimizer.state.get(w, {}) for w in self.weights]
        zeros = [torch.zeros_like(w) for w in self.weights]
        return {
            "outer": self.outer,
            "momentum": self.momentum,
            "exp_avg": [s.get("exp_avg", z) for s, z in zip(moments, zeros)],
            "exp_avg_sq": [s.get("exp_avg_sq", z) for s, z in zip(moments, zeros)],
        }

    def load(self, state: dict[str, list[torch.Tensor]], step: int, round_: int, adam_steps: int) -> None:
        """Take another replica's `state()` (checked against this stage's shapes by the caller)."""
        with torch.no_grad():
            for outer, weight, value in zip(self.outer, self.weights, state["outer"]):
                outer.copy_(value)
                weight.copy_(value)
            for buf, value in zip(self.momentum, state["momentum"]):
                buf.copy_(value)
        if adam_steps > 0:
            for weight, avg, avg_sq in zip(self.weights, state["exp_avg"], state["exp_avg_sq"]):
                self.optimizer.state[weight] = {
                    "step": torch.tensor(float(adam_steps)), "exp_avg": avg.to(weight.device, copy=True),
                    "exp_avg_sq": avg_sq.to(weight.device, copy=True),
                }
        self.discard()
        self.step, self.round = step, round_
        self.digest = weights_digest(self.outer)

    @property
    def adam_steps(self) -> int:
        states = [self.optimizer.state.get(w) for w in self.weights]
        return int(states[0]["step"]) if states and states[0] else 0
