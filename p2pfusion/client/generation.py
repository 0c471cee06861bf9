"""Private inference: tokenizer, embeddings, final norm, LM head and sampling stay on the client.

`RemoteCausalLM` holds the model's local parts; `Conversation` owns one swarm session and the
tokens its peers hold, so a chat's later turns send only their new tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer

from p2pfusion.client.adapters import Adapter
from p2pfusion.client.catalog import model_records
from p2pfusion.client.failover import ResilientSession, SwarmAccess
from p2pfusion.client.head import screened_head
from p2pfusion.client.head_batch import HeadBatcher
from p2pfusion.client.health import PeerHealth, load_observed, save_observed
from p2pfusion.client.routing import find_route, session_limit
from p2pfusion.client.sampling import choose_token
from p2pfusion.client.session import InferenceSession
from p2pfusion.client.verifier import Trust, Verifier
from p2pfusion.client.verify import DEFAULT_RATE, check_rate
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.errors import ModelError, PromptTooLong, RequestError, RouteError
from p2pfusion.models.source import ModelSource
from p2pfusion.models.stage import load_config, load_head
from p2pfusion.net.compression import AUTO, Purpose
from p2pfusion.net.links import LinkBook

log = logging.getLogger(__name__)

MAX_REWINDS = 8  # wrong results caught in one generation before it gives up


def load_tokenizer(source: ModelSource):
    try:
        return AutoTokenizer.from_pretrained(source.folder)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer of {source.name}: {exc}") from exc


def new_tokens_within(prompt: int, wanted: int, limit: int) -> int:
    """How many of the `wanted` new tokens fit after a `prompt` of that many tokens in the swarm's
    `limit`: a prompt that fills it is refused, and a generation that would pass it is cut there,
    with a warning, as transformers stops at max_length."""
    if prompt >= limit:
        raise PromptTooLong(f"prompt too long: {prompt} tokens, the swarm accepts {limit}")
    if prompt + wanted > limit:
        log.warning("the swarm accepts %d tokens: generating %d new tokens, not %d", limit, limit - prompt, wanted)
        return limit - prompt
    return wanted


async def length_limit(access: SwarmAccess, positions: int) -> int:
    """The longest sequence a session can hold now (soft prompt included): the model's `positions`,
    or less where the peers of every route accept less."""
    records = await model_records(access.swarm, access.model, access.name)
    return session_limit(records, access.num_layers, positions, access.health.banned(records))


@dataclass
class Generated:
    token_ids: list[int]
    text: str
    prefill_seconds: float
    decode_seconds: float
    recoveries: int = 0  # times the session moved around a failed peer
    rewinds: int = 0  # times verification caught wrong results and the generation went back
    token_times: list[float] = field(default_factory=list)  # seconds from the call's start to each token

    @property
    def latencies(self) -> list[float]:
        """Each token's own wait: the first token's from the call's start (prefill included), each
        later one's from the token before it."""
        return [t - previous for previous, t in zip([0.0, *self.token_times], self.token_times)]


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
    ):
        self.source = source
        self.verify = check_rate(verify)
        self.swarm = swarm
        self.compression = compression
        self.config = load_config(source)
        self.head = load_head(source, dtype)
        self.dtype = dtype
        self.health = PeerHealth(observed=load_observed(source.key))
        self.adapter: Adapter | None = None  # trained parameters to generate with
        self._tokenizer = None
        self._swarm_access: SwarmAccess | None = None
        self._trust: Trust | None = None
        self._reads: dict[str, asyncio.Task] = {}  # swarm reads in flight, shared by sessions opening together
        # greedy tokens through bounds on the head's logits (client/head.py); False: not built yet
        self._heads: HeadBatcher | None | bool = False if screen_head else None

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

    async def length_limit(self) -> int:
        return await self._shared("limit", lambda: length_limit(self._access(), self.max_positions()))

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
                self.compression,
            )
            self._trust = Trust(self._swarm_access)
        return self._swarm_access

    async def open_session(self, max_length: int, adapter: Adapter | None = None) -> ResilientSession:
        """A session with `adapter` (None: the model's own, `self.adapter`)."""
        adapter = self.adapter if adapter is None else adapter
        params = None if adapter is None else adapter.remote_parameters()
        access = self._access()
        await self._shared("trust", self._trust.refresh)  # other clients' fault reports, before routing
        return await access.session(max_length, params).open()

    def verifier(self, session: ResilientSession) -> Verifier | None:
        """What checks a session's results (None with verification off)."""
        if self.verify <= 0:
            return None
        return Verifier(session, self._trust, self.source, self.verify, self.dtype)

    async def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward and backward pass through the swarm: the loss (as transformers computes it from
        `labels`) and its gradient with respect to the input embeddings. Peers' weights stay frozen."""
        access = self._access()
        records = await model_records(self.swarm, self.source.key, self.source.name)
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

    async def next_token(
        self, hidden: torch.Tensor, temperature: float, generator: torch.Generator | None, top_p: float = 1.0
    ) -> int:
        """The token after the last position of `hidden` [1, tokens, hidden]. Greedy choices of
        sessions asking at the same moment are made together (client/head_batch.py), through
        bounds that give the float32 head's own token (client/head.py)."""
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
        client/sampling.py and `Conversation.generate`."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        conversation = Conversation(self, keep=False, adapter=adapter)
        try:
            return await conversation.generate(
                input_ids, max_new_tokens, temperature, generator, on_token, stop_at_eos, stop,
                decode=decode, top_p=top_p,
            )
        finally:
            await conversation.close()


class Conversation:
    """A session kept open across generations: the peers keep the KV caches of the tokens so far,
    and each call sends only the tokens after those. It owns the session (a ResilientSession, which
    replays them on failover) and the list of those tokens."""

    def __init__(self, model: RemoteCausalLM, keep: bool = True, adapter: Adapter | None = None):
        self.model = model
        self._adapter = adapter  # None: the model's own, whatever it is when a call starts
        self._opened_with: Adapter | None = None  # the adapter of the open session
        # True: open sessions as long as the swarm accepts, for the calls to come; False: as long
        # as this call needs, so that peers accepting less may serve it
        self.keep = keep
        self.session: ResilientSession | None = None
        self.verifier: Verifier | None = None
        self.tokens: list[int] = []  # what the peers' caches hold (after the soft prompt), in order
        self.limit = 0  # the longest sequence of tokens the open session takes

    def _unsent(self, input_ids: list[int]) -> list[int] | None:
        """The tokens after those the session holds; None when it holds other tokens, or all of them."""
        held = len(self.tokens)
        if len(input_ids) > held and input_ids[:held] == self.tokens:
            return input_ids[held:]
        same = next((i for i, (a, b) in enumerate(zip(input_ids, self.tokens)) if a != b), min(held, len(input_ids)))
        log.debug("the sequence differs from the session's %d tokens at position %d: a fresh session", held, same)
        return None

    async def generate(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        on_token: Callable[[int], None] | None = None,
        stop_at_eos: bool = True,
        stop: Callable[[], bool] | None = None,
        decode: bool = True,
        top_p: float = 1.0,
    ) -> Generated:
        """Continue `input_ids` (the whole sequence, earlier calls' tokens included) with up to
        `max_new_tokens` tokens; `stop()`, asked after each token, ends the generation early and
        leaves the session ready for the next call. With verification on, `on_token` gets tokens
        once the results they came from are checked (see client/verifier.py)."""
        started = time.perf_counter()
        model = self.model
        if not input_ids:
            raise RequestError("the prompt is empty")
        adapter = model.adapter if self._adapter is None else self._adapter
        new = None if self.session is None or adapter is not self._opened_with else self._unsent(input_ids)
        if new is None:
            await self.close()
        soft = None if adapter is None else adapter.soft_prompt
        reserved = 0 if soft is None else soft.shape[0]  # positions the soft prompt takes
        limit = self.limit if self.session is not None else await model.length_limit() - reserved
        total = len(input_ids) + new_tokens_within(len(input_ids), max_new_tokens, limit)
        if self.session is None:
            self.session = await model.open_session((limit if self.keep else total) + reserved, adapter)
            self._opened_with = adapter
            self.verifier = model.verifier(self.session)
            self.limit, new = limit, input_ids
            route = self.session.session.route
            log.info("route found: %s", ", ".join(f"{r.start}:{r.end} on {r.peer_id[-8:]}" for r in route))
        eos = model.config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        out: list[int] = []
        times: list[float] = []  # beside `out`: when each token was chosen
        shown = rewinds = 0
        try:
            t0 = time.perf_counter()
            embeds = model.embed(new)
            if soft is not None and not self.tokens:  # soft prompt tokens sit before the text, at positions 0..n-1
                embeds = torch.cat([soft.detach().to(model.dtype)[None], embeds], dim=1)
            hidden = await self._step(embeds)
            self.tokens += new
            t1 = time.perf_counter()
            while True:
                token = await model.next_token(hidden, temperature, generator, top_p)
                out.append(token)
                times.append(time.perf_counter() - started)
                done = (stop_at_eos and token in eos_ids) or len(input_ids) + len(out) >= total
                wrong = await self._check(done)
                if wrong is None:
                    shown = self._show(out, shown, len(input_ids) + reserved, on_token)
                    if not done and stop is not None and stop():
                        done, wrong = True, await self._check(True)  # the rest is checked before the reply ends
                        shown = self._show(out, shown, len(input_ids) + reserved, on_token) if wrong is None else shown
                if wrong is not None:
                    rewinds += 1
                    if rewinds > MAX_REWINDS:
                        raise RouteError(f"results failed verification {rewinds} times in one generation")
                    hidden = await self._rewind(wrong, input_ids, out, reserved, soft)
                    del times[len(out):]
                    continue
                if done:
                    break
                hidden = await self._step(model.embed([token]))
                self.tokens.append(token)
            t2 = time.perf_counter()
        except BaseException:
            await self.close()  # a step may be half done: the peers' caches are no longer known
            raise
        text = model.tokenizer.decode(out, skip_special_tokens=True) if decode else ""
        return Generated(out, text, t1 - t0, t2 - t1, self.session.recoveries, rewinds, times)

    async def _check(self, final: bool) -> int | None:
        """The first wrong position found (None: none, or verification is off); at random, or
        over every unchecked position when `final`."""
        if self.verifier is None:
            return None
        return await (self.verifier.check() if final else self.verifier.maybe_check())

    def _show(self, out: list[int], shown: int, prompt: int, on_token: Callable[[int], None] | None) -> int:
        """Give `on_token` the tokens not shown yet whose results are checked (the token after
        position p is sure once p's output is); returns how many are shown now."""
        sure = len(out) if self.verifier is None else min(max(self.verifier.checked - prompt + 1, 0), len(out))
        if on_token is not None:
            for token in out[shown:sure]:
                on_token(token)
        return max(shown, sure)

    async def _step(self, embeds: torch.Tensor) -> torch.Tensor:
        if self.verifier is None:
            return await self.session.step(embeds)
        return await self.verifier.step(embeds)

    async def _rewind(
        self, position: int, input_ids: list[int], out: list[int], reserved: int, soft: torch.Tensor | None
    ) -> torch.Tensor:
        """Go back to the session's first `position` positions, whose outputs were checked, drop the
        tokens that came after them, and compute that position's output again (on a new route)."""
        await self.verifier.rewind(position)
        del out[max(position - reserved - len(input_ids) + 1, 0):]
        sequence = input_ids + out
        first = max(position - reserved, 0)  # the first token whose input goes again
        embeds = self.model.embed(sequence[first:])
        if position < reserved:
            embeds = torch.cat([soft.detach().to(self.model.dtype)[None, position:], embeds], dim=1)
        self.tokens = sequence[:first]
        hidden = await self.verifier.step(embeds)
        self.tokens = sequence
        return hidden

    async def close(self) -> None:
        session, self.session, self.tokens, self.limit = self.session, None, [], 0
        verifier, self.verifier = self.verifier, None
        if verifier is not None:
            await verifier.close()
        if session is not None:
            await session.close()
            save_observed(self.model.source.key, self.model.health.observed)
