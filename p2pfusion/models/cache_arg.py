"""The name of the KV-cache argument of transformers' models: `cache` from transformers 5.24,
`past_key_values` before. Newer releases still take the old name, with a warning, while older ones
would swallow the new name in `**kwargs` and silently run without the cache, so callers look it up."""

from __future__ import annotations

import inspect
from functools import cache

NEW, OLD = "cache", "past_key_values"


@cache
def cache_arg(takes) -> str:
    """The cache argument's name in what `takes` it: a model's `forward`, `generate`, or an
    output class."""
    return NEW if NEW in inspect.signature(takes).parameters else OLD


def given_cache(kwargs: dict):
    """The cache a caller passed under either name, taken out of `kwargs` (None: none)."""
    new, old = kwargs.pop(NEW, None), kwargs.pop(OLD, None)
    return new if new is not None else old
