"""Inference through the swarm: tokenizer, embeddings, final norm, LM head and sampling stay on the client.

`RemoteCausalLM` is what a client's generations share, on top of its core (client/core.py): the
greedy head, the cohorts its decoding sessions step in, its local layers, and the adapter to
generate with. Each generation runs in a `Conversation` (generate/conversation.py), which owns one
swarm session and the tokens its peers hold.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import torch

from p2pfusion.client.checks.policy import MAX_REWINDS
from p2pfusion.client.checks.verifier import Verifier
from p2pfusion.client.generate.canary import Canaries
from p2pfusion.client.core import ClientCore, connect
from p2pfusion.client.generate import template
from p2pfusion.client.generate.conversation import Conversation, Generated
from p2pfusion.client.generate.draft_model import DraftModel
from p2pfusion.client.generate.greedy import HeadBatcher
from p2pfusion.client.generate.local_layers import LocalLayers
from p2pfusion.client.generate.lockstep import Lockstep, load_counts, save_counts
from p2pfusion.client.generate.sampling import choose_token, nucleus
from p2pfusion.client.generate.screen import final_norm, screened_head
from p2pfusion.client.options import ClientOptions
from p2pfusion.client.route.failover import ResilientSession
from p2pfusion.client.route.pieces import split_batch
from p2pfusion.client.tune.adapter import Adapter
from p2pfusion.client.tune.steps import TuningSession
from p2pfusion.errors import PromptTooLong, RequestError, RouteError
from p2pfusion.models.kv_cache import batchable
from p2pfusion.models.source import ModelSource
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.models.threads import in_fresh_thread
from p2pfusion.net.compression import Purpose

log = logging.getLogger(__name__)


class RemoteCausalLM:
    """A causal LM whose decoder layers run in the swarm."""

    def __init__(self, core: ClientCore):
        self.core = core
        self.adapter: Adapter | None = None  # trained parameters to generate with
        self.local = LocalLayers(core)  # at least the first options.local_layers layers run here
        # greedy tokens through bounds on the head's logits (generate/screen.py); False: not built yet
        self._heads: HeadBatcher | None | bool = False if core.options.screen_head else None
        # decoding sessions step together (generate/lockstep.py), in as many cohorts as measured here last
        self.lockstep = Lockstep(counts=load_counts(core.source.key))
        self.canaries = Canaries(core, self.speculates)  # sessions of its own, sent after generations (generate/canary.py)
        self._markers: list[str] | None = None  # the tokenizer's added tokens' texts (generate/template.py)
        self._longest_token: int | None = None
        self._speculates: bool | None = None  # whether generations draft (`speculates`); None: not known yet
        self._draft: asyncio.Future[DraftModel] | None = None  # options.draft_model, loading or loaded

    @classmethod
    def build(
        cls, source: ModelSource, swarm: SwarmNode | None = None, options: ClientOptions | None = None, **settings
    ) -> RemoteCausalLM:
        """An engine on a new core of `source` (attached to `swarm`, if given), with `options` or the
        settings they are made of (client/options.py)."""
        return cls(ClientCore(source, ClientOptions.of(options, settings), swarm))

    @classmethod
    async def connect(
        cls, initial_peers: Sequence[str], model: str | ModelSource | None, options: ClientOptions
    ) -> RemoteCausalLM:
        """An engine on a client of `model` joined to the swarm of `initial_peers` (client/core.py's
        `connect`), its draft model loaded: a bad one is said before any generation."""
        engine = cls(await connect(initial_peers, model, options))
        try:
            await engine.draft_model()
        except BaseException:
            await engine.core.leave()
            raise
        return engine

    @property
    def source(self) -> ModelSource:
        return self.core.source

    @property
    def config(self):
        return self.core.config

    @property
    def head(self) -> torch.nn.Module:
        return self.core.head

    @property
    def tokenizer(self):
        return self.core.tokenizer

    def check_prompt(self, input_ids: list[int]) -> None:
        """What can be checked without the network: the length the swarm accepted when last asked
        (callers that can ask first, the CLI and the HTTP API, do), else the model's own."""
        if not input_ids:
            raise RequestError("the prompt is empty")
        limit, whose = self.core.length_limit()
        if len(input_ids) >= limit:
            raise PromptTooLong(f"prompt too long: {len(input_ids)} tokens, {whose} accepts {limit}")

    def encode(self, prompt: str, chat: bool) -> list[int]:
        """Tokenize and validate a prompt (before any network traffic, so bad input fails fast)."""
        if not prompt.strip():
            raise RequestError("the prompt is empty")
        if chat:
            ids = self.chat_ids([{"role": "user", "content": prompt}])
        else:
            self._check_chars(len(prompt))
            ids = list(self.tokenizer(prompt)["input_ids"])
        self.check_prompt(ids)
        return ids

    def _check_chars(self, chars: int) -> None:
        if self._longest_token is None:
            self._longest_token = template.longest_token(self.tokenizer)
        template.check_text_length(chars, *self.core.length_limit(), self._longest_token)

    def require_chat_template(self) -> None:
        """A chat with a model that has no chat template is a request it cannot serve."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(f"{self.source.name} has no chat template (its tokenizer_config.json names none)")

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation rendered with the model's chat template, ready for the assistant's turn."""
        self.require_chat_template()
        self._check_chars(sum(len(m["content"]) for m in messages))
        if self._markers is None:
            self._markers = template.markers(self.tokenizer)
        return template.chat_ids(self.tokenizer, messages, self._markers)

    async def open_session(
        self, length: int, adapter: Adapter | None = None, first: int = 0, batch: int = 1
    ) -> ResilientSession:
        """A session of `batch` sequences with `adapter` (None: the model's own, `self.adapter`)
        through the layers from `first` on (the client runs those before it: `LocalRun.first`)."""
        adapter = self.adapter if adapter is None else adapter
        params = None if adapter is None else adapter.session_params()
        if params is not None:
            params = params.layers(first, self.core.num_layers)  # a hop refuses parameters of layers before its own
        return await self.core.open_session(length, params, batch=batch, first=first)

    async def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward and backward pass through the swarm: the loss (as transformers computes it from
        `labels`) and its gradient with respect to the input embeddings. Peers' weights stay frozen;
        a peer that fails costs a replay of the step's forward, as in fine-tuning (tune/steps.py)."""
        if self.local.wanted:
            raise RequestError("train_step runs every layer in the swarm: a model with local_layers cannot train")
        batch, tokens = input_ids.shape
        embeds = self.head.get_input_embeddings()(input_ids).detach().to(self.core.options.dtype)
        chunks = split_batch(embeds, None, torch.arange(tokens).expand(batch, -1))
        session = TuningSession(self.core.session(tokens, purpose=Purpose.TRAINING), self.core.forward_check())
        try:
            out = (await session.forward(chunks, None)).requires_grad_(True)
            loss = self.head(inputs_embeds=out, labels=labels).loss
            loss.backward()
            grad, _ = await session.backward(chunks, out.grad)
            return loss.detach(), grad
        finally:
            await session.close()

    async def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of a batch of sequences [batch, tokens], as the local model's forward gives them;
        checked against another route at the client's verification rate."""
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise RequestError(f"input_ids must have shape [batch, tokens], got {list(input_ids.shape)}")
        local = await self.local.run(self.adapter)
        # opened for the whole batch: a session opened for fewer sequences would open again at its first step
        session = await self.open_session(input_ids.shape[1], first=local.first, batch=input_ids.shape[0])
        verifier = self.core.verifier(session)
        try:
            with torch.inference_mode():
                hidden = self.head.get_input_embeddings()(input_ids).to(self.core.options.dtype)
            return self.logits(await self._checked_pass(session, verifier, await local.step(hidden)))
        finally:
            if verifier is not None:
                await verifier.close()
            await session.close()

    @staticmethod
    async def _checked_pass(session: ResilientSession, verifier: Verifier | None, hidden: torch.Tensor) -> torch.Tensor:
        """One pass of `hidden` through the session, checked against another route at the
        verifier's rate, and computed again on a route without the liar when a check fails."""
        if verifier is None:
            return await session.step(hidden)
        checked = verifier.drawn()
        for _ in range(MAX_REWINDS):
            out = await verifier.step(hidden)
            if not checked or await verifier.finish() is None:
                return out
            await verifier.rewind(0)
        raise RouteError(f"results failed verification {MAX_REWINDS} times in one forward pass")

    def save_measured(self) -> None:
        """Keep what this client measured for its next run: the peers' speeds, the cohort counts."""
        self.core.save_observed()
        if self.lockstep.counts is not None:
            save_counts(self.core.source.key, self.lockstep.counts)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(inputs_embeds=hidden).logits

    def speculates(self) -> bool:
        """Whether generations send drafts (client/generate/draft.py): unless the options say
        "off", where every layer keeps a cache that can drop positions (no sliding windows)."""
        if self._speculates is None:
            self._speculates = self.core.options.speculate == "auto" and batchable(self.config)
        return self._speculates

    async def draft_model(self) -> DraftModel | None:
        """The model that drafts (options.draft_model; None: prompt lookup drafts), loaded on a
        worker thread when first asked for; generations that ask meanwhile wait for that load."""
        name = self.core.options.draft_model
        if name is None or not self.speculates():
            return None
        if self._draft is None:
            self._draft = asyncio.ensure_future(in_fresh_thread(DraftModel.load, name, self.source, self.config))
        return await asyncio.shield(self._draft)

    @torch.inference_mode()
    def distributions(self, hidden: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
        """What sampling draws from at each position of `hidden` [1, tokens, hidden]: [tokens, vocab]."""
        probs = torch.softmax(self.logits(hidden.to(self.core.options.dtype))[0].float() / temperature, dim=-1)
        return nucleus(probs, top_p) if top_p < 1 else probs

    async def next_token(
        self, hidden: torch.Tensor, temperature: float, generator: torch.Generator | None, top_p: float = 1.0
    ) -> int:
        """The token after the last position of `hidden` [1, tokens, hidden]. Greedy choices of
        sessions asking at the same moment are made together (generate/greedy.py), through
        bounds that give the float32 head's own token (generate/screen.py)."""
        if temperature <= 0:
            if self._heads is False:
                screen = screened_head(self.head)
                self._heads = None if screen is None else HeadBatcher(screen, final_norm(self.head), self._exact_token)
            if self._heads is not None:
                return await self._heads.next_token(hidden[:, -1:])
        return choose_token(self.logits(hidden[:, -1:])[0, -1], temperature, generator, top_p)

    def _exact_token(self, last: torch.Tensor) -> int:
        return choose_token(self.logits(last)[0, -1], 0.0, None)

    @torch.inference_mode()
    def embed(self, ids: list[int]) -> torch.Tensor:
        return self.head.get_input_embeddings()(torch.tensor([ids])).to(self.core.options.dtype)

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
        on_rewind: Callable[[int], None] | None = None,
        hold: bool = False,
    ) -> Generated:
        """One generation in a session of its own, with `adapter` (None: the model's own). Many may
        run at once on one event loop: they share the swarm node, the head and what is known of
        peers, and each has its own session, generator and adapter. `top_p`: see
        generate/sampling.py; `stop`, `on_rewind` and `hold`: `Conversation.generate`."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        conversation = Conversation(self, keep=False, adapter=adapter)
        try:
            return await conversation.generate(
                input_ids, max_new_tokens, temperature, generator, on_token, stop_at_eos, stop,
                decode=decode, top_p=top_p, on_rewind=on_rewind, hold=hold,
            )
        finally:
            await conversation.close()
