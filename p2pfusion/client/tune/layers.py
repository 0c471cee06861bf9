"""The swarm's layers as a differentiable function, for synchronous torch code.

`SwarmClient` owns a background asyncio loop with the client's swarm node in it. `RemoteLayers`
is the autograd function: its forward sends hidden states through a training session, its
backward sends the output's gradient back through the same peers, and returns the gradients of
the input and of the adapter's parameters, which the peers computed on their frozen layers.
"""

from __future__ import annotations

import torch

from p2pfusion.client.tune.adapter import Adapter, RemoteParameters
from p2pfusion.client.route.failover import ResilientSession, SwarmAccess
from p2pfusion.client.generate.causal_lm import length_limit
from p2pfusion.client.route.health import PeerHealth, load_observed, save_observed
from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.client.tune.steps import TrainingSession, split_batch
from p2pfusion.client.checks.verifier import Trust, Verifier
from p2pfusion.client.checks.policy import DEFAULT_RATE
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.errors import RequestError
from p2pfusion.models.source import ModelSource
from p2pfusion.net import messages as m
from p2pfusion.models.formats import WeightFormat
from p2pfusion.net.compression import Purpose
from p2pfusion.net.links import LinkBook


class SwarmClient:
    def __init__(
        self, loop: BackgroundLoop, swarm: SwarmNode, source: ModelSource, num_layers: int, max_positions: int,
        compression: str,
        verify: float = DEFAULT_RATE,
        dtype: torch.dtype = torch.float32,
        trusted: frozenset[str] | None = None,
        minimum: WeightFormat = WeightFormat.INT4,
    ):
        self.loop = loop
        self.source = source
        health = PeerHealth(observed=load_observed(source.key))
        links = LinkBook(swarm.transport)
        self.access = SwarmAccess(swarm, source.key, source.name, num_layers, health, links, compression, trusted=trusted, minimum=minimum)
        self.trust = Trust(self.access)
        self.verify = verify
        self.dtype = dtype
        self.max_positions = max_positions  # the model's; a session's length also follows the swarm's peers
        self._training: TrainingSession | None = None

    @property
    def model(self) -> str:
        return self.access.model

    def run(self, coro):
        return self.loop.run(coro)

    def connection(self, purpose: Purpose, params: RemoteParameters | None, max_length: int) -> ResilientSession:
        return self.access.session(max_length, params, purpose)

    async def opened(self, purpose: Purpose, params: RemoteParameters | None, max_length: int) -> ResilientSession:
        """An open session, routed around the peers this client distrusts (other clients' reports read first)."""
        await self.trust.refresh()
        return await self.connection(purpose, params, max_length).open()

    def verifier(self, session: ResilientSession) -> Verifier | None:
        """What checks an inference session's results (None with verification off)."""
        return None if self.verify <= 0 else Verifier(session, self.trust, self.source, self.verify, self.dtype)

    async def length_limit(self) -> int:
        return await length_limit(self.access, self.max_positions)

    @property
    def training(self) -> TrainingSession:
        """One training session for all of this client's steps: a route and its adapter are set
        up once, and the adapter is sent again only when its values change."""
        if self._training is None:
            self._training = TrainingSession(self.connection(Purpose.TRAINING, None, self.run(self.length_limit())))
        return self._training

    def forward_once(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, params: RemoteParameters | None
    ) -> torch.Tensor:
        """A forward pass without gradients: an inference session of one step per chunk of rows."""
        rows = max(1, m.MAX_STEP_TOKENS // hidden.shape[1])

        async def go() -> torch.Tensor:
            outputs = []
            for i in range(0, hidden.shape[0], rows):  # each chunk of rows is a batch with its own caches
                part = slice(i, i + rows)
                session = await self.opened(Purpose.INFERENCE, params, hidden.shape[1])
                try:
                    outputs.append(await session.step(hidden[part], None if mask is None else mask[part], positions[part]))
                finally:
                    await session.close()
            return torch.cat(outputs, dim=0)

        return self.run(go())

    def close(self) -> None:
        async def go():
            if self._training is not None:
                await self._training.close()
            save_observed(self.model, self.access.health.observed)
            await self.access.swarm.shutdown()

        if not self.loop.loop.is_closed():
            self.run(go())
            self.loop.close()


class RemoteLayers(torch.autograd.Function):
    """hidden -> the last stage's output, differentiable in `hidden` and in the adapter's remote
    parameters (passed as trailing arguments so autograd tracks them)."""

    @staticmethod
    def forward(ctx, hidden, client: SwarmClient, mask, positions, adapter: Adapter | None, *params):
        chunks = split_batch(hidden.detach(), mask, positions)
        remote = None if adapter is None else adapter.remote_parameters()
        ctx.client, ctx.chunks, ctx.dtype = client, chunks, hidden.dtype
        ctx.names = [] if adapter is None else [name for name, _ in adapter.named_remote()]
        return client.run(client.training.forward(chunks, remote)).to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad):
        client: SwarmClient = ctx.client
        grad_input, grads = client.run(client.training.backward(ctx.chunks, grad.contiguous().to(ctx.dtype)))
        missing = [name for name in ctx.names if name not in grads]
        if missing:
            raise RequestError(f"the swarm returned no gradient for {missing[0]}")
        return (grad_input.to(ctx.dtype), None, None, None, None, *[grads[name] for name in ctx.names])
