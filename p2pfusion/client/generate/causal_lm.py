"""Inference through the swarm: tokenizer, embeddings, final norm, LM head and sampling stay on the client.

`RemoteCausalLM` holds the model's local parts and what its sessions share; each generation runs in
a `Conversation` (client/generate/conversation.py), which owns one swarm session and the tokens its peers hold.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import torch
from transformers import AutoTokenizer

from p2pfusion.client.tune.adapter import Adapter
from p2pfusion.client.generate.conversation import Conversation, Generated
from p2pfusion.client.route.failover import ResilientSession, SwarmAccess
from p2pfusion.client.generate.screen import screened_head
from p2pfusion.client.generate.greedy import HeadBatcher
from p2pfusion.client.route.health import PeerHealth, load_observed
from p2pfusion.client.generate.local_layers import LocalLayers, swarm_part
from p2pfusion.client.generate.lockstep import Lockstep
from p2pfusion.client.route.planner import find_route, session_limit
from p2pfusion.client.generate.sampling import choose_token
from p2pfusion.client.route.session import InferenceSession
from p2pfusion.models.formats import WeightFormat, minimum_format
from p2pfusion.client.route.allowlist import TrustedPeers, trusted_peers as trusted_set
from p2pfusion.client.checks.verifier import Trust, Verifier
from p2pfusion.client.checks.policy import DEFAULT_RATE, check_rate
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.errors import ModelError, PromptTooLong, RequestError
from p2pfusion.models.source import ModelSource
from p2pfusion.models.stage import load_config, load_head
from p2pfusion.net.compression import AUTO, Purpose
from p2pfusion.net.links import LinkBook

log = logging.getLogger(__name__)



def load_tokenizer(source: ModelSource):
    try:
        return AutoTokenizer.from_pretrained(source.folder)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer of {source.name}: {exc}") from exc


async def length_limit(access: SwarmAccess, positions: int, first: int = 0) -> int:
    """The longest sequence a session can hold now (soft prompt included): the model's `positions`,
    or less where the peers of every route from layer `first` accept less."""
    records = await access.records(first)
    return session_limit(records, access.num_layers, positions, access.health.banned(records), first)


class RemoteCausalLM:
    """A causal LM whose decoder layers run in the swarm."""

    def __init__(
        self,
        source: ModelSource,
        swarm: SwarmNode | None = None,
        dtype: torch.dtype = torch.float32,
        compression: str = AUTO,
        screen_head: bool = True,
        verify: float = DEFAULT_RATE,
        trusted_peers: TrustedPeers = None,
        local_layers: int = 0,
        min_precision: str = WeightFormat.INT4.value,
    ):
        self.source = source
        self.minimum = minimum_format(min_precision)
        self.verify = check_rate(verify)
        self.trusted = trusted_set(trusted_peers)  # None: route through any peer
        self.swarm = swarm
        self.compression = compression
        self.config = load_config(source)
        self.head = load_head(source, dtype)
        self.dtype = dtype
        self.health = PeerHealth(observed=load_observed(source.key))
        self.adapter: Adapter | None = None  # trained parameters to generate with
        self.local = LocalLayers(source, local_layers, dtype, self._access)  # at least the first K layers run here
        self._tokenizer = None
        self._swarm_access: SwarmAccess | None = None
        self._trust: Trust | None = None
        self._reads: dict[str, asyncio.Task] = {}  # swarm reads in flight, shared by sessions opening together
        # greedy tokens through bounds on the head's logits (client/generate/screen.py); False: not built yet
        self._heads: HeadBatcher | None | bool = False if screen_head else None
        self.lockstep = Lockstep()  # decoding sessions step together (client/generate/lockstep.py)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.source)
        return self._tokenizer

    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    def check_prompt(self, input_ids: list[int]) -> None:
        """What can be checked before joining the swarm: the model's own positions."""
        if not input_ids:
            raise RequestError("the prompt is empty")
        limit = self.max_positions()
        if len(input_ids) >= limit:
            raise PromptTooLong(f"prompt too long: {len(input_ids)} tokens, the model accepts {limit}")

    async def length_limit(self, first: int = 0) -> int:
        return await self._shared(f"limit {first}", lambda: length_limit(self._access(), self.max_positions(), first))

    async def _shared(self, kind: str, read: Callable[[], Awaitable]):
        """`read()`, or the answer of the one of its kind in flight: a burst of sessions costs the
        DHT one read, and sessions opening beside the first fault reports' read wait for it (Trust
        marks a read done when it starts it) rather than route through peers it would distrust."""
        task = self._reads.get(kind)
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            task = self._reads[kind] = asyncio.ensure_future(read())
        return await asyncio.shield(task)

    def encode(self, prompt: str, chat: bool) -> list[int]:
        """Tokenize and validate a prompt (before any network traffic, so bad input fails fast)."""
        if not prompt.strip():
            raise RequestError("the prompt is empty")
        ids = self._tokenize(prompt, chat)
        self.check_prompt(ids)
        return ids

    def _tokenize(self, prompt: str, chat: bool) -> list[int]:
        if chat:
            return self.chat_ids([{"role": "user", "content": prompt}])
        return list(self.tokenizer(prompt)["input_ids"])

    def require_chat_template(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ModelError(f"{self.source.name} has no chat template (its tokenizer_config.json names none)")

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation rendered with the model's chat template, ready for the assistant's turn."""
        self.require_chat_template()
        return list(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        ))

    def _access(self) -> SwarmAccess:
        if self.swarm is None:
            raise RequestError("this model is not attached to a swarm")
        if self._swarm_access is None or self._swarm_access.swarm is not self.swarm:
            links = LinkBook(self.swarm.transport)
            self._swarm_access = SwarmAccess(
                self.swarm, self.source.key, self.source.name, self.config.num_hidden_layers, self.health, links,
                self.compression, trusted=self.trusted, minimum=self.minimum,
            )
            self._trust = Trust(self._swarm_access)
        return self._swarm_access

    async def open_session(self, max_length: int, adapter: Adapter | None = None, first: int = 0) -> ResilientSession:
        """A session with `adapter` (None: the model's own, `self.adapter`) through the layers from
        `first` on (the client runs those before it: `LocalRun.first`)."""
        adapter = self.adapter if adapter is None else adapter
        params = None if adapter is None else swarm_part(adapter.remote_parameters(), first, self.config.num_hidden_layers)
        access = self._access()
        await self._shared("trust", self._trust.refresh)  # other clients' fault reports, before routing
        return await access.session(max_length, params, first=first).open()

    def verifier(self, session: ResilientSession) -> Verifier | None:
        """What checks a session's results (None with verification off)."""
        if self.verify <= 0:
            return None
        return Verifier(session, self._trust, self.source, self.verify, self.dtype)

    async def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward and backward pass through the swarm: the loss (as transformers computes it from
        `labels`) and its gradient with respect to the input embeddings. Peers' weights stay frozen."""
        if self.local.wanted:
            raise RequestError("train_step runs every layer in the swarm: a model with local_layers cannot train")
        access = self._access()
        records = await access.records()
        route = find_route(
            records, self.config.num_hidden_layers, self.health.observed, self.health.banned(records),
            length=input_ids.shape[1],
        )
        session = await InferenceSession(
            self.swarm.transport, route, input_ids.shape[1], self.compression, access.links, Purpose.TRAINING
        ).open()
        try:
            embeds = self.head.get_input_embeddings()(input_ids).detach().to(self.dtype)
            out = (await session.step(embeds)).requires_grad_(True)
            loss = self.head(inputs_embeds=out, labels=labels).loss
            loss.backward()
            grad, _ = await session.backward(out.grad)
            return loss.detach(), grad
        finally:
            await session.close()

    async def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of a batch of sequences [batch, tokens], as the local model's forward gives them."""
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise RequestError(f"input_ids must have shape [batch, tokens], got {list(input_ids.shape)}")
        local = await self.local.run(self.adapter)
        session = await self.open_session(input_ids.shape[1], first=local.first)
        try:
            with torch.inference_mode():
                hidden = self.head.get_input_embeddings()(input_ids).to(self.dtype)
            return self.logits(await session.step(await local.step(hidden)))
        finally:
            await session.close()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(inputs_embeds=hidden).logits

    async def next_token(
        self, hidden: torch.Tensor, temperature: float, generator: torch.Generator | None, top_p: float = 1.0
    ) -> int:
        """The token after the last position of `hidden` [1, tokens, hidden]. Greedy choices of
        sessions asking at the same moment are made together (client/generate/greedy.py), through
        bounds that give the float32 head's own token (client/generate/screen.py)."""
        if temperature <= 0:
            if self._heads is False:
                screen = screened_head(self.head)
                self._heads = None if screen is None else HeadBatcher(screen, self._normed, self._exact_token)
            if self._heads is not None:
                return await self._heads.next_token(hidden[:, -1:])
        return choose_token(self.logits(hidden[:, -1:])[0, -1], temperature, generator, top_p)

    def _normed(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.base_model(inputs_embeds=hidden).last_hidden_state

    def _exact_token(self, last: torch.Tensor) -> int:
        return choose_token(self.logits(last)[0, -1], 0.0, None)

    @torch.inference_mode()
    def embed(self, ids: list[int]) -> torch.Tensor:
        return self.head.get_input_embeddings()(torch.tensor([ids])).to(self.dtype)

    async def generate(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        on_token: Callable[[int], None] | None = None,
        stop_at_eos: bool = True,
        decode: bool = True,
        adapter: Adapter | None = None,
        top_p: float = 1.0,
        stop: Callable[[], bool] | None = None,
    ) -> Generated:
        """One generation in a session of its own, with `adapter` (None: the model's own). Many may
        run at once on one event loop: they share the swarm node, the head and what is known of
        peers, and each has its own session, generator and adapter. `top_p` and `stop`: see
        client/generate/sampling.py and `Conversation.generate`."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        conversation = Conversation(self, keep=False, adapter=adapter)
        try:
            return await conversation.generate(
                input_ids, max_new_tokens, temperature, generator, on_token, stop_at_eos, stop,
                decode=decode, top_p=top_p,
            )
        finally:
            await conversation.close()
