"""Speculative decoding: what to draft, how many drafts to send, and which the swarm's step accepts.

A one-token step costs a whole trip around the route, so a client that sends k drafted tokens
behind the last one (k+1 positions in one step) gets up to k+1 tokens for little more than one
trip's time: the model's own choice at each position says which drafts stand. Drafts come from
prompt lookup (`lookup`): the latest earlier place where the text's last n tokens (3, else 2)
occurred, and what followed it there; no second model. Text that repeats its context (a summary, a quote, an
edit of code) drafts well; free chat rarely does.

`Speculation` decides k from what it measured in this session: the share of drafts accepted, and
what each draft adds to a step's time, seen from here (drafting it, the network, the peers'
compute, the client's head): it sends the k with the most tokens per second expected, and none
when drafting does not pay, trying one draft now and then (less often each time one falls) so that
it notices when the text turns repetitive. A session's first step after its prefill carries no
drafts: it times the plain step that the drafts' cost is measured against. A small draft model
(generate/draft_model.py) may draft instead of prompt lookup; its steps, and feeding it the tokens
the swarm chose, are timed as part of the step they draft for, so a draft model that costs more
than it saves stops drafting as a bad guess does.

Which drafts stand: greedily, those equal to the model's choice at the position before (`accept_greedy`),
so the text is the one plain greedy decoding gives. Sampled, the standard rule for a drafter that
proposes one token with certainty (`accept_sampled`): draft d at a position with distribution p
stands with probability p(d); the first that falls is replaced by a token drawn from p without d.
Each token then has exactly the model's distribution.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_NGRAM = 3  # the longest tail looked up
MIN_NGRAM = 2  # one token in common is too weak a sign: such drafts stood rarely (docs/benchmarks.md)
MAX_DRAFTS = 8  # drafts in one step at most
EXPLORE_EVERY = 16  # steps without drafts after which one draft is tried anyway...
EXPLORE_MAX = 128  # ...twice as many after each such try that fell, up to this many
FIRST_PRIOR = (1.0, 2.0)  # (stood, tried) of first drafts counted before any: one half...
REST_PRIOR = (3.0, 4.0)  # ...and of later ones, three quarters...
ACCEPT_DECAY = 0.9  # ...as old counts fade, so the rates follow the text
REST_EVIDENCE = 1.0  # later drafts tried (faded) below which the first drafts' rate stands for theirs
COST_PRIOR = 0.3  # an extra position's share of a one-token step's time, until measured
EMA = 0.2


def lookup(tokens: Sequence[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of
    `tokens`, for the longest n from `max_ngram` down to `min_ngram` that occurred before. It runs
    before every step, so the search is bytes.rfind's, over the ids as 4-byte words."""
    if k <= 0 or len(tokens) < 2:
        return []
    data = array("I", tokens).tobytes()
    last = len(tokens) - 1
    for n in range(min(max_ngram, last), min_ngram - 1, -1):
        tail, end = data[-4 * n:], 4 * last  # a match must end before the text's last token
        while (found := data.rfind(tail, 0, end)) >= 0:
            if found % 4 == 0:  # on a token's boundary, not across two
                start = found // 4 + n
                return list(tokens[start:start + k])
            end = found + 4 * n - 1
    return []


def expected_tokens(first: float, rest: float, k: int) -> float:
    """Tokens a step of k drafts yields on average (the model's own token included), when the
    first draft stands with probability `first`, and each later one with `rest` once those before
    it stood (drafts copied from the text stand or fall in runs, so the two differ)."""
    if k <= 0:
        return 1.0
    return 1.0 + first * float(sum(rest ** i for i in range(k)))


def best_drafts(first: float, rest: float, extra: float, available: int, limit: int = MAX_DRAFTS) -> int:
    """The number of drafts (0 to `available`, at most `limit`) with the most tokens per unit of
    time, a step of k drafts taking 1 + k * `extra` one-token steps."""
    best, best_k = 1.0, 0
    for k in range(1, min(available, limit) + 1):
        speed = expected_tokens(first, rest, k) / (1.0 + k * extra)
        if speed > best * 1.0001:
            best, best_k = speed, k
    return best_k


@dataclass
class Speculation:
    """One session's drafting policy and what it has measured. Acceptance is counted as
    (stood, tried) with old steps fading by ACCEPT_DECAY: for a step's first draft, and for the
    later ones that were tried (those whose predecessor stood). Later drafts untried for long
    count as likely as first ones, or a policy settled on single drafts would never learn more."""

    first: tuple[float, float] = FIRST_PRIOR
    rest: tuple[float, float] = REST_PRIOR
    one_step: float | None = None  # seconds of a step without drafts, from here
    extra: float | None = None  # seconds each draft adds to a step, drafting it included
    drafting: float = 0.0  # seconds drafting one token takes here (a draft model's step; lookup: nothing)
    since_draft: int = 0  # steps since the last that carried drafts
    explore_gap: int = EXPLORE_EVERY  # steps without drafts before the next try
    steps: int = 0  # swarm steps the generation under way took, its prefill included
    sent: int = 0  # drafts sent in this session
    stood: int = 0  # and accepted

    def rates(self) -> tuple[float, float]:
        first = self.first[0] / self.first[1]
        if self.rest[1] < REST_EVIDENCE:  # only single drafts sent for long: later ones unknown, not bad
            return first, max(first, self.rest[0] / self.rest[1])
        return first, self.rest[0] / self.rest[1]

    def begin(self) -> None:
        """A generation starts: its prefill, which chose its first token, is its first step."""
        self.steps = 1

    def size(self, available: int) -> int:
        """How many drafts to send of the `available` ones: none until a plain step was timed, so
        that what drafts add to a step is measured against it."""
        if available <= 0 or self.one_step is None:
            return 0
        # until a step with drafts was timed: the swarm's share guessed, the drafting as measured
        extra = COST_PRIOR * self.one_step + self.drafting if self.extra is None else self.extra
        share = extra / max(self.one_step, 1e-6)
        k = best_drafts(*self.rates(), share, available)
        if k == 0 and self.since_draft >= self.explore_gap:
            k = 1
        return k

    def explores_next(self) -> bool:
        """Whether the step after a plain one sends a draft however the rates stand (`size`)."""
        return self.since_draft + 1 >= self.explore_gap

    def drafts(self, sequence: Sequence[int], room: int) -> list[int]:
        """The drafts prompt lookup finds behind the last token of `sequence`, as many as pay, at
        most `room`."""
        candidates = lookup(sequence, min(room, MAX_DRAFTS)) if room > 0 and self.one_step is not None else []
        return candidates[:self.size(len(candidates))]

    def took(self, drafts: int, accepted: int, seconds: float, drafting: float | None = None) -> None:
        """A step with `drafts` drafts, of which `accepted` stood, took `seconds` from here, drafting
        them and the head included; `drafting`: what drafting one token costs here, as last measured."""
        if drafting is not None:
            self.drafting = drafting
        self.steps += 1
        if drafts == 0:
            self.since_draft += 1
            self.one_step = seconds if self.one_step is None else (1 - EMA) * self.one_step + EMA * seconds
            return
        explored = self.since_draft >= self.explore_gap
        self.since_draft = 0
        if accepted:
            self.explore_gap = EXPLORE_EVERY
        elif explored:
            self.explore_gap = min(2 * self.explore_gap, EXPLORE_MAX)
        self.sent, self.stood = self.sent + drafts, self.stood + accepted
        self.first = _fade(self.first, accepted >= 1, 1)
        self.rest = _fade(self.rest, max(accepted - 1, 0), min(accepted, drafts - 1))
        if self.one_step is not None:
            per = max(seconds - self.one_step, 0.0) / drafts
            self.extra = per if self.extra is None else (1 - EMA) * self.extra + EMA * per


def _fade(count: tuple[float, float], stood: float, tried: float) -> tuple[float, float]:
    return ACCEPT_DECAY * count[0] + stood, ACCEPT_DECAY * count[1] + tried


def accept_greedy(drafts: Sequence[int], choices: Sequence[int]) -> int:
    """How many drafts stand: `choices[i]` is the model's greedy token after draft i's position
    less one (choices[0] follows the last token before the drafts)."""
    accepted = 0
    for draft, choice in zip(drafts, choices):
        if draft != choice:
            break
        accepted += 1
    return accepted


def accept_sampled(drafts: Sequence[int], probs: torch.Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """How many drafts stand, and the token after them, sampled by the speculative rule. `probs`
    [len(drafts) + 1, vocab]: the model's distribution at each position (the first follows the
    last token before the drafts)."""
    for i, draft in enumerate(drafts):
        p = probs[i]
        if float(torch.rand((), generator=generator)) < float(p[draft]):
            continue
        rest = p.clone()  # the draft fell, so p(draft) < 1 and the rest holds some mass
        rest[draft] = 0.0
        return i, int(torch.multinomial(rest / rest.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(probs[len(drafts)], 1, generator=generator))
