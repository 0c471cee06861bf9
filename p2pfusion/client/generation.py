"""Private inference: tokenizer, embeddings, final norm, LM head and sampling stay on the client."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from p2pfusion.client.adapters import Adapter
from p2pfusion.client.failover import ResilientSession, SwarmAccess
from p2pfusion.client.head import ScreenedHead, screened_head
from p2pfusion.client.health import PeerHealth, load_observed, save_observed
from p2pfusion.client.routing import find_route
from p2pfusion.client.session import InferenceSession
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.errors import ModelError, RequestError
from p2pfusion.models.source import ModelSource
from p2pfusion.models.stage import load_config, load_head
from p2pfusion.net.compression import AUTO, Purpose
from p2pfusion.net.links import LinkBook


@dataclass
class Generated:
    token_ids: list[int]
    text: str
    prefill_seconds: float
    decode_seconds: float
    recoveries: int = 0  # times the session moved around a failed peer


def choose_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Temperature 0 is greedy; otherwise sample from the softened distribution."""
    if temperature <= 0:
        return int(logits.argmax(-1))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class RemoteCausalLM:
    """A causal LM whose decoder layers run in the swarm."""

    def __init__(
        self,
        source: ModelSource,
        swarm: SwarmNode | None = None,
        dtype: torch.dtype = torch.float32,
        compression: str = AUTO,
        screen_head: bool = True,
    ):
        self.source = source
        self.swarm = swarm
        self.compression = compression
        self.config = load_config(source)
        self.head = load_head(source, dtype)
        self.dtype = dtype
        self.health = PeerHealth(observed=load_observed(source.name))
        self.adapter: Adapter | None = None  # trained parameters to generate with
        self._tokenizer = None
        self._swarm_access: SwarmAccess | None = None
        # greedy tokens through a float16 screen of the head (client/head.py); False: not built yet
        self._screen: ScreenedHead | None | bool = False if screen_head else None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.source.folder)
            except (OSError, ValueError) as exc:
                raise ModelError(f"cannot load the tokenizer of {self.source.name}: {exc}") from exc
        return self._tokenizer

    def max_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    def check_prompt(self, input_ids: list[int]) -> None:
        if not input_ids:
            raise RequestError("the prompt is empty")
        limit = self.max_length()
        if len(input_ids) >= limit:
            raise RequestError(f"the prompt is {len(input_ids)} tokens, longer than the maximum length {limit - 1}")

    def encode(self, prompt: str, chat: bool) -> list[int]:
        """Tokenize and validate a prompt (before any network traffic, so bad input fails fast)."""
        if not prompt.strip():
            raise RequestError("the prompt is empty")
        ids = self._tokenize(prompt, chat)
        self.check_prompt(ids)
        return ids

    def _tokenize(self, prompt: str, chat: bool) -> list[int]:
        if chat:
            return list(self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
            ))
        return list(self.tokenizer(prompt)["input_ids"])

    def _access(self) -> SwarmAccess:
        if self.swarm is None:
            raise RequestError("this model is not attached to a swarm")
        if self._swarm_access is None or self._swarm_access.swarm is not self.swarm:
            links = LinkBook(self.swarm.transport)
            self._swarm_access = SwarmAccess(
                self.swarm, self.source.name, self.config.num_hidden_layers, self.health, links, self.compression
            )
        return self._swarm_access

    async def open_session(self, max_length: int) -> ResilientSession:
        params = None if self.adapter is None else self.adapter.remote_parameters()
        return await self._access().session(max_length, params).open()

    async def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward and backward pass through the swarm: the loss (as transformers computes it from
        `labels`) and its gradient with respect to the input embeddings. Peers' weights stay frozen."""
        access = self._access()
        records = await self.swarm.lookup(self.source.name)
        route = find_route(records, self.config.num_hidden_layers, self.health.observed, self.health.banned())
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
        session = await self.open_session(input_ids.shape[1])
        try:
            with torch.inference_mode():
                hidden = self.head.get_input_embeddings()(input_ids).to(self.dtype)
            return self.logits(await session.step(hidden))
        finally:
            await session.close()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(inputs_embeds=hidden).logits

    @torch.inference_mode()
    def next_token(self, hidden: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
        """The token after the last position of `hidden` [1, tokens, hidden]; greedy choices go
        through the float16 screen (client/head.py), which gives the float32 head's own token."""
        if temperature <= 0:
            if self._screen is False:
                self._screen = screened_head(self.head)
            if self._screen is not None:
                normed = self.head.base_model(inputs_embeds=hidden[:, -1:]).last_hidden_state
                token = self._screen.next_token(normed[0, -1])
                if token is not None:
                    return token
        return choose_token(self.logits(hidden[:, -1:])[0, -1], temperature, generator)

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
    ) -> Generated:
        self.check_prompt(input_ids)
        total = min(len(input_ids) + max_new_tokens, self.max_length())
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        eos = self.config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        prompt = None if self.adapter is None else self.adapter.soft_prompt
        session = await self.open_session(total + (0 if prompt is None else prompt.shape[0]))
        new: list[int] = []
        try:
            t0 = time.perf_counter()
            embeds = self.embed(input_ids)
            if prompt is not None:  # soft prompt tokens sit before the text, at positions 0..n-1
                embeds = torch.cat([prompt.detach().to(self.dtype)[None], embeds], dim=1)
            hidden = await session.step(embeds)
            t1 = time.perf_counter()
            while True:
                token = self.next_token(hidden, temperature, generator)
                new.append(token)
                if on_token is not None:
                    on_token(token)
                if (stop_at_eos and token in eos_ids) or len(input_ids) + len(new) >= total:
                    break
                hidden = await session.step(self.embed([token]))
            t2 = time.perf_counter()
        finally:
            await session.close()
            save_observed(self.source.name, self.health.observed)
        text = self.tokenizer.decode(new, skip_special_tokens=True) if decode else ""
        return Generated(new, text, t1 - t0, t2 - t1, session.recoveries)
