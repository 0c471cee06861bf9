"""The swarm's layers as a differentiable function, for synchronous torch code.

`SwarmLayers` runs a client's sessions (client/core.py) on a background asyncio loop, so a torch
module can call the swarm. `RemoteLayers` is the autograd function: its forward sends hidden
states through a fine-tuning session, its backward sends the output's gradient back through the
same peers, and returns the gradients of the input and of the adapter's parameters, which the peers
computed on their frozen layers.
"""

from __future__ import annotations

import torch

from p2pfusion.client.core import ClientCore
from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.client.route.params import SessionParams
from p2pfusion.client.route.pieces import split_batch
from p2pfusion.client.tune.adapter import Adapter
from p2pfusion.client.tune.steps import TuningSession
from p2pfusion.errors import RequestError
from p2pfusion.net import messages as m
from p2pfusion.net.compression import Purpose


class SwarmLayers:
    def __init__(self, core: ClientCore, loop: BackgroundLoop):
        self.core = core
        self.loop = loop  # the swarm node lives on it
        self._tuning: TuningSession | None = None

    def run(self, coro):
        return self.loop.run(coro)

    @property
    def tuning(self) -> TuningSession:
        """One fine-tuning session for all of this client's steps: a route and its parameters are set
        up once, and the parameters are sent again only when their values change."""
        if self._tuning is None:
            length = self.run(self.core.longest_session())
            self._tuning = TuningSession(self.core.session(length, purpose=Purpose.TRAINING), self.core.forward_check())
        return self._tuning

    def forward_once(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, params: SessionParams | None
    ) -> torch.Tensor:
        """A forward pass without gradients: an inference session of one step per chunk of rows."""
        rows = max(1, m.MAX_STEP_TOKENS // hidden.shape[1])
        core = self.core

        async def go() -> torch.Tensor:
            outputs = []
            for i in range(0, hidden.shape[0], rows):  # each chunk of rows is a batch with its own caches
                part = slice(i, i + rows)
                session = await core.open_session(hidden.shape[1], params, batch=hidden[part].shape[0])
                try:
                    outputs.append(await session.step(hidden[part], None if mask is None else mask[part], positions[part]))
                finally:
                    await session.close()
            return torch.cat(outputs, dim=0)

        return self.run(go())

    def close(self) -> None:
        async def go():
            if self._tuning is not None:
                await self._tuning.close()
            await self.core.leave()

        if not self.loop.loop.is_closed():
            self.run(go())
            self.loop.close()


class RemoteLayers(torch.autograd.Function):
    """hidden -> the last stage's output, differentiable in `hidden` and in the adapter's remote
    parameters (passed as trailing arguments so autograd tracks them)."""

    @staticmethod
    def forward(ctx, hidden, layers: SwarmLayers, mask, positions, adapter: Adapter | None, *params):
        chunks = split_batch(hidden.detach(), mask, positions)
        remote = None if adapter is None else adapter.session_params()
        ctx.layers, ctx.chunks, ctx.dtype = layers, chunks, hidden.dtype
        ctx.names = [] if adapter is None else [name for name, _ in adapter.named_remote()]
        return layers.run(layers.tuning.forward(chunks, remote)).to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad):
        layers: SwarmLayers = ctx.layers
        grad_input, grads = layers.run(layers.tuning.backward(ctx.chunks, grad.contiguous().to(ctx.dtype)))
        missing = [name for name in ctx.names if name not in grads]
        if missing:
            raise RequestError(f"the swarm returned no gradient for {missing[0]}")
        return (grad_input.to(ctx.dtype), None, None, None, None, *[grads[name] for name in ctx.names])
