"""Fine-tuning steps through the swarm's frozen layers: forward passes whose inputs the peers keep,
and backward passes that return the gradients of those inputs and of the client's adapter
parameters (the session's `Params`).

A batch goes as chunks of at most MAX_STEP_TOKENS tokens, all sent before any result is awaited,
so the hops work on different chunks at once and each peer holds a bounded amount per step.

The client also keeps each chunk's inputs until its backward pass is done. If a peer fails before
that, a new route computes those chunks' forward again and the backward goes on there: the loss
and gradients are the ones the old route would have given.
"""

from __future__ import annotations

import logging

import torch

from p2pfusion.client.checks.forward import ForwardCheck
from p2pfusion.client.checks.policy import MAX_REWINDS
from p2pfusion.client.route.failover import ResilientSession
from p2pfusion.client.route.params import SessionParams
from p2pfusion.client.route.pieces import Chunk
from p2pfusion.errors import PeerFailed, RouteError

log = logging.getLogger(__name__)

STEP_TIMEOUT = 300.0  # a whole batch's pass on slow peers


class TuningSession:
    def __init__(self, connection: ResilientSession, check: ForwardCheck | None = None):
        self.connection = connection  # a training session (backward passes); it finds routes and fails over
        self.check = check  # checks a sample of forwards against another route (None: none)
        self.recoveries = 0

    async def forward(self, chunks: list[Chunk], params: SessionParams | None) -> torch.Tensor:
        """The last stage's output for the chunks' sequences, in order, as one batch; computed
        again on another route when a check finds it wrong."""
        for _ in range(MAX_REWINDS):
            try:
                await self._ready(params)
                outputs = await self._forward(chunks)
                if self.check is None or await self.check.holds(self.connection, chunks, outputs):
                    return torch.cat(outputs, dim=0)
                await self.connection.drop()  # the liar is avoided now: the next route goes without it
            except PeerFailed as exc:
                await self._recover(exc)
        raise RouteError(f"a fine-tuning forward failed verification or its route {MAX_REWINDS} times")

    async def backward(
        self, chunks: list[Chunk], grad: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The gradients of the chunks' inputs (as one batch) and of the session's parameters
        (summed over the chunks), given the gradient of their output."""
        grads = grad.split([c.hidden.shape[0] for c in chunks])
        while True:
            try:
                await self._ready(self.connection.params)
                session = self.connection.session
                if any(c.session is not session for c in chunks):  # a new route: it needs the inputs again
                    await self._forward(chunks)
                for chunk, g in zip(chunks, grads):
                    await session.submit_backward(chunk.step, g.contiguous())
                inputs, params = [], {}
                for chunk in chunks:
                    grad_input, grad_params = await session.backward_result(chunk.step, STEP_TIMEOUT)
                    inputs.append(grad_input)
                    for name, value in grad_params.items():
                        params[name] = params[name] + value if name in params else value
                return torch.cat(inputs, dim=0), params
            except PeerFailed as exc:
                await self._recover(exc)

    async def _ready(self, params: SessionParams | None) -> None:
        if self.connection.session is None:
            self.connection.params = params
            await self.connection.connect(recovering=self.recoveries > 0)
        else:
            await self.connection.update_params(params)

    async def _forward(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        session = self.connection.session
        for chunk in chunks:
            chunk.step = await session.submit(chunk.hidden, chunk.mask, chunk.positions)
            chunk.session = session
        return [await session.result(chunk.step, STEP_TIMEOUT) for chunk in chunks]

    async def _recover(self, exc: PeerFailed) -> None:
        log.warning("a fine-tuning step failed on its route (%s); retrying on another", exc)
        self.connection.failed(exc)
        self.recoveries += 1
        await self.connection.drop()

    async def close(self) -> None:
        await self.connection.close()
