"""A small local model that drafts tokens for speculative decoding (`--draft-model`).

Prompt lookup (generate/draft.py) drafts only text that repeats; a small model with the same
tokenizer drafts any text, at the cost of running it here. Its drafts are its greedy tokens, so
the drafter proposes each with certainty, and the acceptance rules of draft.py hold as they are:
greedy text stays transformers' own, sampled text keeps the target model's distribution.

`DraftModel` is the loaded weights, shared by a client's generations; each conversation has a
`Drafter` of its own, which keeps the draft model's KV cache of the tokens it has seen, so that a
step drafts from where the last one stopped (its cache cut back where the text went another way).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PretrainedConfig

from p2pfusion.client.generate.draft import EMA
from p2pfusion.errors import ModelError
from p2pfusion.models.kv_cache import batchable
from p2pfusion.models.source import ModelSource, resolve_model
from p2pfusion.models.stage import load_config, max_positions

log = logging.getLogger(__name__)

# tokens a proposal reads while drafting goes on: the last draft of the step before (never read)
# and the token the swarm chose; more is a catch-up after steps without drafts
STEADY_FEED = 2


class DraftModel:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.positions = max_positions(model.config)

    @classmethod
    def load(cls, name: str, target: ModelSource, target_config: PretrainedConfig) -> DraftModel:
        """The model `name` (a folder, a .gguf file or a Hub id), checked to draft for `target`:
        the same vocabulary, and layers whose caches can drop positions."""
        source = resolve_model(name)
        config = load_config(source)
        if config.vocab_size != target_config.vocab_size:
            raise ModelError(
                f"the draft model {source.name} has {config.vocab_size} tokens, {target.name} has "
                f"{target_config.vocab_size}: a draft model needs the same tokenizer"
            )
        if not _same_vocabulary(source, target):
            raise ModelError(f"the draft model {source.name} has another tokenizer than {target.name}")
        if not batchable(config):
            raise ModelError(
                f"the draft model {source.name} keeps sliding-window caches, which cannot drop the drafts that fell"
            )
        try:
            model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load the draft model {source.name}: {exc}") from exc
        model.requires_grad_(False)
        log.info("drafting with %s (%d layers)", source.name, config.num_hidden_layers)
        return cls(model)

    def drafter(self) -> Drafter:
        return Drafter(self)


class Drafter:
    """One conversation's drafts: the draft model's cache holds `_tokens`, in order."""

    def __init__(self, model: DraftModel):
        self._model = model
        self._cache: DynamicCache | None = None
        self._tokens: list[int] = []
        self._per_token: float | None = None  # seconds of a one-token step of the draft model, as measured
        self._last: float = 0.0  # seconds per draft of the last proposal, catch-up included
        # seconds the last proposal spent reading tokens chosen while it did not draft, beyond a step
        self.catch_up = 0.0
        # a generation cancelled mid-proposal leaves its worker thread running: the next waits for it
        self._busy = threading.Lock()

    def propose(self, sequence: Sequence[int], k: int) -> list[int]:
        """The draft model's `k` greedy tokens after `sequence` (fewer near its last position).
        Runs on a worker thread, one call at a time."""
        with self._busy:
            return self._propose(sequence, k)

    def warm(self, sequence: Sequence[int]) -> None:
        """Read `sequence` into the cache (a prompt, or the tokens plain steps chose, while the
        swarm computes), so that the drafts after it cost a step of the draft model, not a
        catch-up. Runs on a worker thread."""
        with self._busy:
            self._read(sequence)

    @torch.inference_mode()
    def _read(self, sequence: Sequence[int]) -> None:
        if not sequence or len(sequence) > self._model.positions:
            return
        held = self._cut(sequence, len(sequence))
        if held < len(sequence):
            self._model.model(
                input_ids=torch.tensor([list(sequence[held:])]), cache=self._cache, use_cache=True, logits_to_keep=1
            )
        self._tokens = list(sequence)

    def _cut(self, sequence: Sequence[int], most: int) -> int:
        """Cut the cache back to what it shares with `sequence`, at most `most` tokens; how many it keeps."""
        held = min(_common_prefix(self._tokens, sequence), most)
        if self._cache is None:
            self._cache, held = DynamicCache(config=self._model.model.config), 0
        self._cache.crop(held - self._cache.get_seq_length())  # how many to drop, as a negative count
        self._tokens = list(sequence[:held])  # all that is sure of the cache, should a step after fail
        return held

    @torch.inference_mode()
    def _propose(self, sequence: Sequence[int], k: int) -> list[int]:
        k = min(k, self._model.positions - len(sequence))
        if k <= 0 or not sequence:
            return []
        # at least the last token goes in: its output is the first draft
        held = self._cut(sequence, len(sequence) - 1)
        feed = list(sequence[held:])
        drafts: list[int] = []
        started = time.perf_counter()
        self.catch_up = 0.0
        for _ in range(k):
            began = time.perf_counter()
            logits = self._model.model(
                input_ids=torch.tensor([feed]), cache=self._cache, use_cache=True, logits_to_keep=1
            ).logits
            took = time.perf_counter() - began
            if len(feed) == 1:  # a catch-up over many tokens says little of a one-token step
                self._per_token = took if self._per_token is None else (1 - EMA) * self._per_token + EMA * took
            elif len(feed) > STEADY_FEED:
                self.catch_up = max(took - (self._per_token or 0.0), 0.0)
            feed = [int(logits[0, -1].argmax())]
            drafts.append(feed[0])
        self._tokens = [*sequence, *drafts[:-1]]  # the last draft was never fed
        self._last = (time.perf_counter() - started) / k
        return drafts

    @property
    def cost(self) -> float:
        """Seconds one draft costs here: a one-token step of the draft model, or until one was
        timed, the last proposal's time per draft (a catch-up included: an overestimate)."""
        return self._per_token if self._per_token is not None else self._last


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _same_vocabulary(draft: ModelSource, target: ModelSource) -> bool:
    """Whether the two tokenizers map the same texts to the same ids; True when either folder has
    no tokenizer to compare (the vocabulary sizes matched)."""
    try:
        ours = AutoTokenizer.from_pretrained(draft.folder).get_vocab()
        theirs = AutoTokenizer.from_pretrained(target.folder).get_vocab()
    except (OSError, ValueError, TypeError):
        return True
    return ours == theirs
