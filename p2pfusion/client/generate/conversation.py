"""A session kept open across generations (`Conversation`), and what a generation returns.

The peers keep the KV caches of the tokens a conversation sent, so a chat's later turns send only
their new tokens; the session's replay history and the local layers' cache (client/generate/local_layers.py)
belong to it too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from p2pfusion.client.checks.policy import MAX_REWINDS
from p2pfusion.client.checks.verifier import Verifier
from p2pfusion.client.generate.draft import MAX_DRAFTS, Speculation, accept_greedy, accept_sampled
from p2pfusion.client.generate.local_layers import LocalRun
from p2pfusion.client.route.failover import ResilientSession
from p2pfusion.client.route.planner import new_tokens_within
from p2pfusion.client.tune.adapter import Adapter
from p2pfusion.errors import RequestError, RouteError
from p2pfusion.models.threads import in_fresh_thread
from p2pfusion.net import messages as m

if TYPE_CHECKING:
    from p2pfusion.client.generate.causal_lm import RemoteCausalLM
    from p2pfusion.client.generate.draft_model import Drafter

log = logging.getLogger(__name__)

@dataclass
class Generated:
    token_ids: list[int]
    text: str
    prefill_seconds: float
    decode_seconds: float
    recoveries: int = 0  # times the session moved around a failed peer
    rewinds: int = 0  # times verification caught wrong results and the generation went back
    token_times: list[float] = field(default_factory=list)  # seconds from the call's start to each token
    steps: int | None = None  # swarm steps the new tokens took, prefill included, when drafting was on (speculative decoding)

    @property
    def latencies(self) -> list[float]:
        """Each token's own wait: the first token's from the call's start (prefill included), each
        later one's from the token before it."""
        return [t - previous for previous, t in zip([0.0, *self.token_times], self.token_times)]


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
        self.local = LocalRun()  # the session's pass through the layers run here, before the swarm's
        self.verifier: Verifier | None = None
        self.tokens: list[int] = []  # what the peers' caches hold (after the soft prompt), in order
        self.limit = 0  # the longest sequence of tokens the open session takes
        self.speculation: Speculation | None = None  # drafting, as measured on this session
        self.drafter: Drafter | None = None  # the draft model's cache for this session, with a draft model

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
        on_rewind: Callable[[int], None] | None = None,
        hold: bool = False,
    ) -> Generated:
        """Continue `input_ids` (the whole sequence, earlier calls' tokens included) with up to
        `max_new_tokens` tokens; `stop()`, asked before each token is shown and after, ends the generation early and
        leaves the session ready for the next call. With verification on, checks run beside the
        generation (client/checks/verifier.py): `on_token` gets each token as it comes, and when a
        check finds the results behind some of them wrong, `on_rewind(n)` says that only the first
        n tokens given stand; the corrected ones follow through `on_token`. With `hold`, `on_token`
        gets tokens only once their results are checked, and none is ever withdrawn."""
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
        if self.session is None:
            self.local = await model.local.run(adapter)
        limit = self.limit if self.session is not None else await model.core.longest_session(self.local.first) - reserved
        total = len(input_ids) + new_tokens_within(len(input_ids), max_new_tokens, limit)
        if self.session is None:
            self.session = await model.open_session((limit if self.keep else total) + reserved, adapter, self.local.first)
            self._opened_with = adapter
            self.verifier = model.core.verifier(self.session)
            self.limit, new = limit, input_ids
            route = self.session.session.route
            log.info("route found: %s", ", ".join(f"{r.start}:{r.end} on {r.peer_id[-8:]}" for r in route))
        eos = model.config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        out: list[int] = []
        times: list[float] = []  # beside `out`: when each token was chosen
        shown = rewinds = 0
        try:
            spec = await self._speculation()
            t0 = time.perf_counter()
            embeds = model.embed(new)
            if soft is not None and not self.tokens:  # soft prompt tokens sit before the text, at positions 0..n-1
                embeds = torch.cat([soft.detach().to(model.core.options.dtype)[None], embeds], dim=1)
            # a draft model reads the prompt while the swarm does: its first drafts then cost a step
            drafter = self.drafter
            warming = None if drafter is None else asyncio.ensure_future(in_fresh_thread(drafter.warm, input_ids))
            try:
                hidden = await self._step(embeds)
            finally:
                if warming is not None:
                    await warming
            self.tokens += new
            t1 = time.perf_counter()
            queued: list[int] = []  # accepted drafts: in the peers' caches already, not in `out` yet
            after: int | None = None  # the token the last speculative step chose after them
            with model.lockstep.member(adapter) as member:  # in step with the client's other sessions
                while True:
                    cached, together = bool(queued), None
                    if cached:
                        token = queued.pop(0)
                    elif after is not None:
                        together = await member.turn()
                        token, after = after, None
                    else:
                        together = await member.turn()
                        token = await model.next_token(hidden, temperature, generator, top_p)
                    # a stop that came while this token was computed (a user's Ctrl-C) ends the reply
                    # before it: nothing appears after the stop
                    interrupted = stop is not None and stop()
                    if not interrupted:
                        out.append(token)
                        times.append(time.perf_counter() - started)
                    done = interrupted or (stop_at_eos and token in eos_ids) or len(input_ids) + len(out) >= total
                    if done and not hold:  # the last token shows as the others did, before the check of the rest
                        shown = self._show(out, shown, len(input_ids) + reserved, on_token, hold)
                    wrong = await self._check(done, hold)
                    if wrong is None:
                        shown = self._show(out, shown, len(input_ids) + reserved, on_token, hold)
                        if not done and stop is not None and stop():
                            done, wrong = True, await self._check(True, hold)  # the rest is checked before the reply ends
                            shown = self._show(out, shown, len(input_ids) + reserved, on_token, hold) if wrong is None else shown
                    if wrong is not None:
                        rewinds += 1
                        if rewinds > MAX_REWINDS:
                            raise RouteError(f"results failed verification {rewinds} times in one generation")
                        queued, after = [], None
                        hidden = await self._rewind(wrong, input_ids, out, reserved, soft)
                        del times[len(out):]
                        if shown > len(out):
                            shown = len(out)
                            if on_rewind is not None:
                                on_rewind(shown)
                        continue
                    if done:
                        unused = len(queued) + (cached and interrupted)  # cached positions no token of `out` stands on
                        if unused:
                            await self._keep(self.session.position - unused)
                            del self.tokens[-unused:]
                        break
                    if cached:
                        continue
                    room = total - len(input_ids) - len(out) - 1  # drafts past the last token allowed are wasted
                    # beside other sessions the peers' compute is shared: a draft's positions would
                    # take it from their tokens (docs/benchmarks.md), so only a lone session drafts
                    began = time.perf_counter()  # a step's time counts its drafting
                    drafts = [] if spec is None or not member.alone else await self._drafts(spec, input_ids + out, room)
                    reading = self._read_ahead(spec, input_ids + out) if member.alone and not drafts else None
                    try:
                        hidden = await self._step(model.embed([token, *drafts]), together)
                    finally:
                        if reading is not None:
                            await reading
                    self.tokens.append(token)
                    if drafts:  # `hidden` is not read again: the next token is chosen here, the step after computes anew
                        queued, after = await self._judge(drafts, hidden, temperature, generator, top_p)
                        self.tokens += queued
                    if spec is not None:
                        drafting = None if self.drafter is None else self.drafter.cost
                        # reading what plain steps chose is the price of having stopped, not of a draft
                        lag = self.drafter.catch_up if self.drafter is not None and drafts else 0.0
                        spec.took(len(drafts), len(queued), time.perf_counter() - began - lag, drafting)
            t2 = time.perf_counter()
        except BaseException:
            await self.close()  # a step may be half done: the peers' caches are no longer known
            raise
        text = model.tokenizer.decode(out, skip_special_tokens=True) if decode else ""
        model.canaries.after_generation()
        steps = None if spec is None else spec.steps
        return Generated(out, text, t1 - t0, t2 - t1, self.session.recoveries, rewinds, times, steps)

    async def _speculation(self) -> Speculation | None:
        """This generation's drafting policy (None: no drafts), kept across the session's calls."""
        if not self.model.speculates():
            return None
        if self.speculation is None:
            draft = await self.model.draft_model()
            self.speculation = Speculation()
            self.drafter = None if draft is None else draft.drafter()
        self.speculation.begin()
        return self.speculation

    def _read_ahead(self, spec: Speculation | None, sequence: list[int]) -> asyncio.Future | None:
        """Before a plain step after which the policy tries a draft again, the draft model reads the
        tokens chosen since it last drafted beside the step, not in front of that try (a draft
        model that drafts badly cost up to 8 % at 50 ms when each try began with that catch-up)."""
        if self.drafter is None or spec is None or not spec.explores_next():
            return None
        return asyncio.ensure_future(in_fresh_thread(self.drafter.warm, sequence))

    async def _drafts(self, spec: Speculation, sequence: list[int], room: int) -> list[int]:
        """The drafts to send after `sequence`: the draft model's, if the client has one, else
        prompt lookup's."""
        if self.drafter is None:
            return spec.drafts(sequence, room)
        k = spec.size(min(room, MAX_DRAFTS))
        return await in_fresh_thread(self.drafter.propose, sequence, k) if k else []

    async def _judge(
        self, drafts: list[int], hidden: torch.Tensor, temperature: float, generator: torch.Generator | None, top_p: float
    ) -> tuple[list[int], int]:
        """The drafts that stand after a step of [token, *drafts] whose final states are `hidden`,
        and the token chosen after them; the positions of the drafts that fell leave the caches."""
        model = self.model
        if temperature <= 0:  # asked together: the head answers them as one batch (generate/greedy.py)
            positions = range(hidden.shape[1])
            choices = await asyncio.gather(*(model.next_token(hidden[:, i:i + 1], 0.0, None) for i in positions))
            accepted = accept_greedy(drafts, choices)
            after = choices[accepted]
        else:
            probs = await in_fresh_thread(model.distributions, hidden, temperature, top_p)
            accepted, after = accept_sampled(drafts, probs, generator)
        fell = len(drafts) - accepted
        if fell:
            await self._keep(self.session.position - fell)
        return drafts[:accepted], after

    async def _keep(self, length: int) -> None:
        """Drop the positions past `length` from every cache of the session (rejected drafts)."""
        self.local.keep(length)
        if self.verifier is not None:
            await self.verifier.keep(length)
        else:
            self.session.keep(length)

    async def _check(self, final: bool, hold: bool) -> int | None:
        """The first wrong position found (None: none, or verification is off): by a check that
        ended in the background, or, when `final`, over every position not checked yet."""
        if self.verifier is None:
            return None
        return await (self.verifier.finish() if final else self.verifier.poll(continuous=hold))

    def _show(
        self, out: list[int], shown: int, prompt: int, on_token: Callable[[int], None] | None, hold: bool
    ) -> int:
        """Give `on_token` the tokens not shown yet (with `hold`, only those whose results are
        checked: the token after position p is sure once p's output is); returns how many are
        shown now."""
        checked = len(out) if self.verifier is None else self.verifier.checked - prompt + 1
        sure = min(max(checked, 0), len(out)) if hold else len(out)
        if on_token is not None:
            for token in out[shown:sure]:
                on_token(token)
        return max(shown, sure)

    async def _step(self, embeds: torch.Tensor, together: m.Cohort | None = None) -> torch.Tensor:
        """The swarm's output for the next positions; `together`: the steps of the client's other
        sessions sent with this one (client/generate/lockstep.py)."""
        hidden = await self.local.step(embeds)
        if self.verifier is None:
            return await self.session.step(hidden, together=together)
        return await self.verifier.step(hidden, together=together)

    async def _rewind(
        self, position: int, input_ids: list[int], out: list[int], reserved: int, soft: torch.Tensor | None
    ) -> torch.Tensor:
        """Go back to the session's first `position` positions, whose outputs were checked, drop the
        tokens that came after them, and compute that position's output again (on a new route)."""
        await self.verifier.rewind(position)
        self.local.rewind(position)
        del out[max(position - reserved - len(input_ids) + 1, 0):]
        sequence = input_ids + out
        first = max(position - reserved, 0)  # the first token whose input goes again
        embeds = self.model.embed(sequence[first:])
        if position < reserved:
            embeds = torch.cat([soft.detach().to(self.model.core.options.dtype)[None, position:], embeds], dim=1)
        self.tokens = sequence[:first]
        hidden = await self._step(embeds)
        self.tokens = sequence
        return hidden

    async def close(self) -> None:
        session, self.session, self.tokens, self.limit, self.local = self.session, None, [], 0, LocalRun()
        verifier, self.verifier = self.verifier, None
        if verifier is not None:
            await verifier.close()
        if session is not None:
            await session.close()
            self.model.save_measured()
