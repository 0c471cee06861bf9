"""Speculative decoding: what to draft, how many drafts to send, and which the swarm's step accepts.

A one-token step costs a whole trip around the route, so a client that sends k drafted tokens
behind the last one (k+1 positions in one step) gets up to k+1 tokens for little more than one
trip's time: the model's own choice at each position says which drafts stand. Drafts come from
prompt lookup (`lookup`): the latest earlier place where the text's last n tokens occurred, and
what followed it there; no second model. Text that repeats its context (a summary, a quote, an
edit of code) drafts well; free chat rarely does.

`Speculation` decides k from what it measured in this session: the share of drafts accepted, and
what each extra position adds to a step's time, seen from here (network, peers' compute, the
client's head): it sends the k with the most tokens per second expected, and none when drafting
does not pay, trying one draft now and then so that it notices when the text turns repetitive.

Which drafts stand: greedily, those equal to the model's choice at the position before (`accept_greedy`),
so the text is the one plain greedy decoding gives. Sampled, the standard rule for a drafter that
proposes one token with certainty (`accept_sampled`): draft d at a position with distribution p
stands with probability p(d); the first that falls is replaced by a token drawn from p without d.
Each token then has exactly the model's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_NGRAM = 3  # the longest tail looked up
MIN_NGRAM = 1
MAX_DRAFTS = 8  # drafts in one step at most
EXPLORE_EVERY = 16  # steps without drafts after which one draft is tried anyway
ACCEPT_PRIOR = (1.0, 1.0)  # (accepted, drafted) counted before any draft: a rate of one half...
ACCEPT_DECAY = 0.9  # ...as old counts fade, so the rate follows the text
COST_PRIOR = 0.3  # an extra position's share of a one-token step's time, until measured
EMA = 0.2


def lookup(tokens: Sequence[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of
    `tokens`, for the longest n from `max_ngram` down to `min_ngram` that occurred before."""
    if k <= 0:
        return []
    tokens = list(tokens)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a step of k drafts yields on average (the model's own token included), when each
    draft stands with probability `rate` given those before it stood."""
    return float(sum(rate ** i for i in range(k + 1)))


def best_drafts(rate: float, extra: float, available: int, limit: int = MAX_DRAFTS) -> int:
    """The number of drafts (0 to `available`, at most `limit`) with the most tokens per unit of
    time, a step of k drafts taking 1 + k * `extra` one-token steps."""
    best, best_k = 1.0, 0
    for k in range(1, min(available, limit) + 1):
        speed = expected_tokens(rate, k) / (1.0 + k * extra)
        if speed > best * 1.0001:
            best, best_k = speed, k
    return best_k


@dataclass
class Speculation:
    """One session's drafting policy and what it has measured."""

    accepted: float = ACCEPT_PRIOR[0]
    drafted: float = ACCEPT_PRIOR[1]
    one_step: float | None = None  # seconds of a step without drafts, from here
    extra: float | None = None  # seconds each draft adds to a step
    since_draft: int = 0  # steps since the last that carried drafts
    steps: int = 0  # swarm steps the generation under way took (`Conversation` counts its prefill)
    sent: int = 0  # drafts sent in this session
    stood: int = 0  # and accepted

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted

    def drafts(self, sequence: Sequence[int], room: int) -> list[int]:
        """The drafts to send behind the last token of `sequence`, at most `room`."""
        if room <= 0:
            return []
        candidates = lookup(sequence, min(room, MAX_DRAFTS))
        if not candidates:
            return []
        share = COST_PRIOR if self.extra is None or not self.one_step else self.extra / self.one_step
        k = best_drafts(self.rate, share, len(candidates))
        if k == 0 and self.since_draft >= EXPLORE_EVERY:
            k = 1
        return candidates[:k]

    def took(self, drafts: int, accepted: int, seconds: float) -> None:
        """A step with `drafts` drafts, of which `accepted` stood, took `seconds` (its head included)."""
        self.steps += 1
        if drafts == 0:
            self.since_draft += 1
            self.one_step = seconds if self.one_step is None else (1 - EMA) * self.one_step + EMA * seconds
            return
        self.since_draft = 0
        self.sent, self.stood = self.sent + drafts, self.stood + accepted
        self.accepted = ACCEPT_DECAY * self.accepted + accepted
        self.drafted = ACCEPT_DECAY * self.drafted + drafts
        if self.one_step is not None:
            per = max(seconds - self.one_step, 0.0) / drafts
            self.extra = per if self.extra is None else (1 - EMA) * self.extra + EMA * per


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
