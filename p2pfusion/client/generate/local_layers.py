"""The model's first layers on the client's own machine (`--local-layers K`).

The peer serving layer 0 sees that layer's input, the token embeddings, and a nearest-neighbour
lookup in the embedding table turns those back into the tokens. With local layers, the client
runs layers [0, b) itself and the swarm gets only the hidden states after them. Peers serve
fixed ranges and each hop of a route starts where the one before it ended, so b is the first
layer at or after K where an online peer's stage starts and from which a route covers the rest.
A session keeps its b for life: its failovers and verification checks route from b too, and the
hidden states its replay history holds are those after the local layers.

`LocalLayers` is what all sessions of one RemoteCausalLM share: a stage per b, built from
transformers' own layers as peers build theirs (models/stage.py), loaded once. `LocalRun` is one
session's pass through it, with its own KV cache. An adapter's parameters for layers before b
(LoRA, deep prompts) are applied here with the hooks peers use, and the swarm gets the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

import torch

from p2pfusion.client.core import ClientCore
from p2pfusion.client.route.failover import cut
from p2pfusion.client.route.params import SessionParams
from p2pfusion.client.route.planner import find_route, usable
from p2pfusion.client.tune.adapter import Adapter
from p2pfusion.dht.records import PeerRecord
from p2pfusion.errors import RequestError, RouteError
from p2pfusion.models.kv_cache import SessionCache
from p2pfusion.models.stage import Stage, load_stage
from p2pfusion.models.threads import SMALL_STEP_ROWS, in_fresh_thread
from p2pfusion.models.tuning import StageParams, stage_params

log = logging.getLogger(__name__)


def stage_starts(records: list[PeerRecord], num_layers: int, avoid: Collection[str] = ()) -> list[int]:
    """The layers where the stages of online peers (but those in `avoid`) start."""
    return sorted({r.start for r in usable(records, avoid) if r.end <= num_layers})


def local_boundary(records: list[PeerRecord], num_layers: int, wanted: int, avoid: Collection[str] = ()) -> int:
    """The layer a session's routes start at when the client runs at least `wanted` layers itself:
    the first stage start at or after `wanted` from which online peers chain to the last layer.
    No stage starting there is a RequestError naming the stage starts; a gap after each of them,
    the RouteError of the first."""
    starts = stage_starts(records, num_layers, avoid)
    if not starts:
        find_route(records, num_layers, banned=avoid)  # the RouteError naming the layers nobody serves
    later = [start for start in starts if start >= wanted]
    if not later:
        raise RequestError(
            f"--local-layers {wanted}: no stage of the swarm starts at layer {wanted} or later (the model has "
            f"{num_layers} layers; the swarm's stages start at {', '.join(map(str, starts))})"
        )
    error: RouteError | None = None
    for start in later:
        try:
            find_route(records, num_layers, banned=avoid, first=start)
            return start
        except RouteError as exc:
            error = error or exc
    raise error


class LocalRun:
    """One session's pass through the local layers: its KV cache and the inputs it holds (a cache
    that a rewind or an interrupted step dropped is rebuilt from them, as peers rebuild a failed
    over session's). Without local layers, the embeddings go to the swarm as they are."""

    def __init__(self, stage: Stage | None = None, params: SessionParams | None = None):
        self.stage = stage
        self.first = 0 if stage is None else stage.end  # the layer the swarm starts at
        self.params = None if stage is None or params is None else _local_params(stage, params)
        self._inputs: list[torch.Tensor] = []
        self._cache = None

    @property
    def position(self) -> int:
        return sum(inputs.shape[1] for inputs in self._inputs)

    async def step(self, embeds: torch.Tensor) -> torch.Tensor:
        """The hidden states after the local layers of `embeds` [batch, tokens, hidden], the
        sequence's next positions."""
        if self.stage is None:
            return embeds
        cache, self._cache = self._cache, None  # a step cut short leaves no half-filled cache behind
        if cache is None:
            cache, inputs, offset = self.stage.new_cache(), torch.cat([*self._inputs, embeds], dim=1), 0
        else:
            inputs, offset = embeds, self.position
        args = (inputs, offset, cache, None, None, self.params)
        if inputs.shape[0] * inputs.shape[1] <= SMALL_STEP_ROWS:
            # a decode step runs on the loop's thread, as the head does: a thread of its own would
            # make a new OpenMP pool every step (a 3-layer step took 6.6-7.7 ms so, 5.6-5.9 ms here)
            out = self.stage.forward(*args)
        else:
            # a prompt's prefill must not stall the other sessions' network, nor its pool outlive it
            out = await in_fresh_thread(self.stage.forward, *args)
        self._cache = cache
        self._inputs.append(embeds)
        return out[:, -embeds.shape[1]:].to(embeds.dtype)

    def rewind(self, length: int) -> None:
        """Keep the first `length` positions only (a verifier found the outputs after them wrong)."""
        self._inputs, self._cache = cut(self._inputs, length), None

    def keep(self, length: int) -> None:
        """Keep the first `length` positions (a speculative step's drafts were rejected): a cache
        that can drop positions keeps the rest, others are rebuilt on the next step."""
        self._inputs = cut(self._inputs, length)
        if isinstance(self._cache, SessionCache):
            self._cache.keep(length)
        else:
            self._cache = None


def _local_params(stage: Stage, params: SessionParams) -> StageParams | None:
    """The session's parameters for the local layers, hooked as a peer hooks its own."""
    part = params.layers(0, stage.end)
    if part is None:
        return None
    entries = {name: value.to(stage.dtype) for name, value in part.named().items()}
    return stage_params(stage.module, 0, stage.end, entries, part.message.scaling, part.digest)


class LocalLayers:
    """The local layers of one RemoteCausalLM, shared by its sessions: at least the first
    `local_layers` of the client's options (0: none, the swarm runs every layer), up to the next
    stage boundary."""

    def __init__(self, core: ClientCore):
        self.core = core
        self.wanted = core.options.local_layers
        self._stages: dict[int, asyncio.Future[Stage]] = {}  # boundary -> its stage, loaded or loading

    async def run(self, adapter: Adapter | None) -> LocalRun:
        """A new session's pass through the local layers (with `adapter`'s parameters for them), up
        to the boundary the swarm offers now."""
        if self.wanted == 0:
            return LocalRun()
        access = self.core.access()
        records = await access.records(self.wanted)
        avoid = access.health.banned(records) | access.distrusted
        end = local_boundary(records, access.num_layers, self.wanted, avoid)
        task = self._stages.get(end)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)) or (
            not task.done() and task.get_loop() is not asyncio.get_running_loop()
        ):
            starts = ", ".join(map(str, stage_starts(records, access.num_layers, avoid)))
            task = self._stages[end] = asyncio.ensure_future(in_fresh_thread(self._load, end, starts))
        return LocalRun(await asyncio.shield(task), None if adapter is None else adapter.session_params())

    def _load(self, end: int, starts: str) -> Stage:
        log.info(
            "running layers 0:%d on this machine (--local-layers %d; the swarm's stages start at %s)",
            end, self.wanted, starts,
        )
        return load_stage(self.core.source, 0, end, self.core.options.dtype)
