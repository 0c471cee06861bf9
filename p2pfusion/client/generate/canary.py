"""Canary sessions: a client's own synthetic chats, sent like a user's, whose every hop it checks.

A canary is a chat prompt in the model's chat template, short (a question from PROMPTS) or long
(a passage of Python's own documentation to summarize, `pydoc_data`, present on every machine),
sent through an ordinary session: a prefill, then greedy decode steps, with drafts found by prompt
lookup where the client's users speculate (client/generate/draft.py, the same policy), and a
session length drawn as a user's client would ask for. Nothing on the wire tells a peer it is a
canary, so a peer that lies only when it believes no one checks lies to canaries as often as to
users. The client computes the canary's every layer itself (client/checks/local.py) and judges
each hop's signed receipts against it (client/checks/evidence.py), at the positions that stand:
those of drafts that fell were fed tokens that are not the canary's. A receipt that its signer's own input rows say
was computed from the canary's true states, and whose output is wrong, is published as a fault
report: it carries only the canary's tokens and the peer's receipts, never a user's data, and
any client can recompute it. Hops that sent no valid receipts, or receipts that contradict the
hop next to them or the format their record announces, are avoided by this client only.

Canaries run after a generation, one after the other: those owed to suspects (peers this client
saw wrong results from, which only evidence can show others: client/checks/distrust.py), and
one more with the `canaries` option's chance.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
import torch

from p2pfusion.client.checks.distrust import REPORT_TIMEOUT
from p2pfusion.client.checks.evidence import Judgement, inconsistent, judge_hop
from p2pfusion.client.core import ClientCore
from p2pfusion.client.generate.draft import Speculation, accept_greedy
from p2pfusion.client.route.failover import ResilientSession
from p2pfusion.dht.records import FaultReport, PeerRecord
from p2pfusion.dht.validation import MAX_FAULT_BYTES
from p2pfusion.errors import ModelError, PeerFailed, RouteError
from p2pfusion.models.threads import in_fresh_thread
from p2pfusion.net.receipts import MAX_CANARY_TOKENS, Evidence, Receipt, ReceiptCert
from p2pfusion.net.wire import encode

log = logging.getLogger(__name__)

PROMPTS = (
    "How do I boil an egg?", "Give me a name for a grey cat.", "What is the capital of Peru?",
    "Write a haiku about rain.", "Why is the sky blue?", "Suggest a quick pasta dinner.",
    "How far is the Moon?", "Translate 'good morning' to French.", "What rhymes with orange?",
    "List three uses for baking soda.", "Explain what a prime number is.", "Tell me a short joke.",
)
NEW_TOKENS = (4, 48)  # a canary's greedy tokens, drawn in this range
MAX_IN_A_ROW = 8  # canaries sent one after the other after a generation, at most
LONG = 0.5  # the share of canaries with a long prompt
LONG_CHARACTERS = (300, 3000)  # of a long prompt's passage, drawn in this range
STORE_TRIES = 3  # stores of a fault report before giving up on it
STORE_RETRY = 5.0  # seconds between them
USER_LENGTHS = (64, 128, 256, 512)  # `max_new_tokens` a one-off generation commonly asks for


@dataclass
class CanaryResult:
    route: list[str]
    tokens: list[int]  # the prompt's, then those generated
    prompt: int
    convicted: dict[str, Judgement] = field(default_factory=dict)  # peers whose receipts convict them
    wrong: dict[str, tuple[Receipt, int]] = field(default_factory=dict)  # the receipt that convicts each, its positions that stand
    receipts: list[Receipt] = field(default_factory=list)  # every hop's, of the session's last route
    certs: dict[str, ReceiptCert] = field(default_factory=dict)
    avoided: set[str] = field(default_factory=set)  # peers with missing or inconsistent receipts
    reported: set[str] = field(default_factory=set)  # convicted peers whose report reached the DHT


class Canaries:
    def __init__(self, core: ClientCore, speculates: Callable[[], bool], seed: int | None = None):
        self.core = core
        self.speculates = speculates  # whether the client's generations send drafts: canaries do as they do
        self._rng = random.Random(seed)
        self._running: asyncio.Task | None = None  # one canary at a time

    def after_generation(self) -> None:
        """Start canaries in the background if any are owed (none while some run): one after the
        other, every one owed to a suspect (MAX_IN_A_ROW at most), then one with the `canaries`
        option's chance."""
        if self._running is not None and not self._running.done():
            return
        random_one = self._rng.random() < self.core.options.canaries
        if random_one or any(owed for owed, _ in self.core.distrust.suspects.values()):
            self._running = self.core.spawn(self._owed(random_one))

    async def wait(self) -> None:
        """Until the canaries under way, if any, have ended."""
        if self._running is not None:
            await asyncio.wait([self._running])

    async def _owed(self, random_one: bool) -> None:
        for _ in range(MAX_IN_A_ROW):
            suspect = self.core.distrust.next_suspect()
            if suspect is None:
                break
            await self._quietly(*suspect)
        if random_one:
            await self._quietly(None, 0)

    async def _quietly(self, through: str | None, reach: int) -> None:
        try:
            await self.run(through, reach)
        except (PeerFailed, RouteError, TimeoutError, OSError) as exc:
            log.info("a canary session did not finish: %s", exc)

    def prompt(self, room: int, least: int = 0) -> list[int]:
        """A chat prompt as users send them, of at least `least` and at most `room` tokens (random
        tokens for a model without a chat template)."""
        core = self.core
        try:
            tokenizer = core.tokenizer
        except ModelError:
            tokenizer = None
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            count = self._rng.randint(min(max(8, least), room), min(max(96, least), room))
            return [self._rng.randrange(core.config.vocab_size) for _ in range(count)]
        long = least > 0 or self._rng.random() < LONG
        text = self._passage() if long else self._rng.choice(PROMPTS)
        while True:
            content = f"Summarize this:\n\n{text}" if long else text
            message = [{"role": "user", "content": content}]
            ids = list(tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True, return_dict=False))
            if long and len(ids) > room:  # a shorter passage, not a prompt cut short
                text = text[:len(text) * room // len(ids) - 1]
            elif long and len(ids) < min(least, room):
                text += self._passage()
            else:
                return ids[-room:]

    def _passage(self) -> str:
        from pydoc_data.topics import topics

        text = topics[self._rng.choice(sorted(topics))]
        size = self._rng.randint(*LONG_CHARACTERS)
        start = self._rng.randrange(max(len(text) - size, 1))
        return text[start:start + size]

    async def run(self, through: str | None = None, reach: int = 0) -> CanaryResult:
        """One canary session, through peer `through` if given, reaching past `reach` positions
        where the swarm and MAX_CANARY_TOKENS allow; its hops judged, and the peers its receipts
        convict reported."""
        core = self.core
        longest = await core.longest_session()
        new = self._rng.randint(*NEW_TOKENS)
        ids = self.prompt(min(longest, MAX_CANARY_TOKENS) - new, reach + 1 - new)
        if self._rng.random() < 0.5:  # a chat keeps its session as long as the swarm allows
            length = longest
        else:
            length = min(len(ids) + self._rng.choice(USER_LENGTHS), longest)
        await core.read_reports()
        session = core.session(length, through=through)
        try:
            tokens = await self._generate(session, ids, new)
            route = list(session.session.route)
            receipts, certs = list(session.session.signed.receipts), dict(session.session.signed.certs)
            session_id = session.session.session_id
        finally:
            await session.close()
        result = CanaryResult([r.peer_id for r in route], tokens, len(ids), receipts=receipts, certs=certs)
        sent = tokens[:-1]  # the last token chosen is never sent
        states = await in_fresh_thread(core.recomputer.states, sent, sorted({r.start for r in route} | {r.end for r in route}))
        if states is None:
            return result
        for i, hop in enumerate(route):
            mine = sorted((r for r in receipts if r.peer_id == hop.peer_id and r.session == session_id), key=lambda r: r.step)
            verdict = judge_hop(hop, mine, certs.get(hop.peer_id), states[hop.start], states[hop.end])
            if not verdict.signed:  # it did not sign, or a hop after it dropped or changed what it signed
                result.avoided |= {r.peer_id for r in route[i:]}
            elif verdict.avoid:
                result.avoided.add(hop.peer_id)
            elif verdict.judgement is not None:
                result.convicted[hop.peer_id], result.wrong[hop.peer_id] = verdict.judgement, (verdict.receipt, verdict.kept)
        result.avoided |= inconsistent(route, receipts, session_id)
        for peer in result.avoided - set(result.convicted):
            log.warning("peer %s sent receipts that do not hold for a canary; avoiding it", peer)
            core.health.failed(peer, 0.0)
        await self._report(result, route, receipts, certs, sent)
        return result

    async def _generate(self, session: ResilientSession, ids: list[int], new: int) -> list[int]:
        """`new` greedy tokens after `ids`, stepped as a user's generation steps (generate/conversation.py):
        drafts behind each token where users send them, the positions of those that fell dropped."""
        spec = Speculation() if self.speculates() else None
        if spec is not None:
            spec.begin()
        out = await session.step(self._embed(ids))
        tokens, choice = list(ids), await self._choices(out[:, -1:])
        while True:
            tokens.append(choice[0])
            room = new - (len(tokens) - len(ids)) - 1
            if room < 0:
                return tokens
            began = time.perf_counter()
            drafts = [] if spec is None else spec.drafts(tokens, room)
            out = await session.step(self._embed([tokens[-1], *drafts]))
            choice = await self._choices(out)
            accepted = accept_greedy(drafts, choice)
            if accepted < len(drafts):
                session.keep(session.position - (len(drafts) - accepted))
            tokens += drafts[:accepted]
            choice = choice[accepted:]
            if spec is not None:
                spec.took(len(drafts), accepted, time.perf_counter() - began)

    def _embed(self, ids: list[int]) -> torch.Tensor:
        core = self.core
        with torch.inference_mode():
            return core.head.get_input_embeddings()(torch.tensor([ids])).to(core.options.dtype)

    async def _choices(self, out: torch.Tensor) -> list[int]:
        return (await in_fresh_thread(self.core.greedy_tokens, out))[0].tolist()

    async def _report(
        self, result: CanaryResult, route: list[PeerRecord], receipts: list[Receipt], certs: dict[str, ReceiptCert],
        tokens: list[int],
    ) -> None:
        """Distrust the convicted peers and publish the evidence against each."""
        core = self.core
        for hop in route:
            judgement = result.convicted.get(hop.peer_id)
            if judgement is None:
                continue
            core.distrust.convict(hop.peer_id)
            log.warning(
                "peer %s signed a wrong result for layers %d:%d in a canary session (relative error %.2g, bar %.2g); "
                "reporting it with the evidence", hop.peer_id, hop.start, hop.end, judgement.output_error, judgement.bar,
            )
            wrong, kept = result.wrong[hop.peer_id]
            earlier = [(r.offset, r.tokens, r.rows) for r in sorted(receipts, key=lambda r: r.step)
                       if r.peer_id == hop.peer_id and r.session == wrong.session and r.step < wrong.step]
            evidence = Evidence(tokens[:wrong.offset + kept], certs[hop.peer_id], wrong, earlier)
            report = FaultReport(hop.peer_id, hop.start, hop.end, judgement.output_error, evidence, time.time())
            size = len(msgpack.packb(encode(report), use_bin_type=True))
            if size > MAX_FAULT_BYTES - 1024:
                log.warning("the evidence against peer %s takes %d bytes, too many for the DHT: not reported", hop.peer_id, size)
                continue
            if await self._publish(report):
                result.reported.add(hop.peer_id)

    async def _publish(self, report: FaultReport) -> bool:
        """Store `report` in the DHT, trying again a few times: a refused store (a node's storage
        full, no node reached) is said, never silent."""
        swarm, model = self.core.swarm, self.core.access().model
        for attempt in range(1, STORE_TRIES + 1):
            try:
                if await asyncio.wait_for(swarm.report_faulty(model, report), REPORT_TIMEOUT):
                    return True
                why = "no DHT node stored it"
            except (TimeoutError, OSError) as exc:
                why = repr(exc)
            log.warning("could not report peer %s (try %d of %d): %s", report.peer_id, attempt, STORE_TRIES, why)
            if attempt < STORE_TRIES:
                await asyncio.sleep(STORE_RETRY)
        return False
