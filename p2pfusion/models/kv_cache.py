"""KV caches that let steps of different sessions run as one batched forward.

Each session keeps its own cache (`SessionCache`): per layer, keys and values in a buffer that
grows by doubling, so a step appends in place instead of copying the whole history as
transformers' DynamicCache does. For a batched step, a cache stands in front of the members'
(`batched_step`): the attention sees the members' histories left-padded to the longest, with the
padding masked out, the layout transformers' own batched `generate` uses, so the layers are
transformers' modules, unchanged. The padded buffer (`_Group`) outlives the step: each member's
own buffer becomes a view of its rows in it, so the next step of the same members (a client's
cohort, step after step) appends one column for all of them and copies no history; members that
change, or fall out of line (a step alone, drafts dropped), are copied into a new one, and those
left out into buffers of their own, so each session's positions are held once. Where the
padding would outweigh the positions held (one long session among short ones), the buffer would
hold more memory than the sessions' own caches, and is made for the step only.

Only stages whose layers all attend to the full history use these (`batchable`); sliding-window
and hybrid layers keep DynamicCache, and their sessions' steps run one at a time.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

MIN_CAPACITY = 64  # positions a session's buffers first hold
# positions a batch buffer holds past its members' longest: it is copied anew this often, a
# 32nd of the padded copy at every step (8 sessions' steps of 500 positions through 10 layers:
# 26.8 ms against 34.2, scripts/bench_batch_cache.py)
GROUP_ROOM = 32


def batchable(config: PretrainedConfig) -> bool:
    """Whether every layer of this (sliced) config keeps a plain, full-history cache."""
    layers = DynamicCache(config=config).layers
    return len(layers) == config.num_hidden_layers and all(type(layer) is DynamicLayer for layer in layers)


class _SessionLayer(DynamicLayer):
    """One layer of a session's cache: `keys[:, :, :length]` are the positions seen so far, in a
    buffer of its own or in its rows of a batch's `_Group`."""

    def __init__(self):
        super().__init__()
        self.length = 0
        self.group: _Group | None = None  # the batch buffer whose view `keys` and `values` are

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = self._buffer(key_states, MIN_CAPACITY)
        self.values = self._buffer(value_states, MIN_CAPACITY)
        self.is_initialized = True

    @staticmethod
    def _buffer(like: torch.Tensor, capacity: int) -> torch.Tensor:
        batch, heads, _, dim = like.shape
        return torch.empty(batch, heads, capacity, dim, dtype=like.dtype, device=like.device)

    def _reserve(self, length: int) -> None:
        capacity = self.keys.shape[2]
        if length > capacity:
            self._move(length)

    def _move(self, length: int) -> None:
        """Its positions into a buffer of its own with room for `length`."""
        capacity = MIN_CAPACITY
        while capacity < length:
            capacity *= 2
        keys, values = self._buffer(self.keys, capacity), self._buffer(self.values, capacity)
        keys[:, :, :self.length] = self.keys[:, :, :self.length]
        values[:, :, :self.length] = self.values[:, :, :self.length]
        self.keys, self.values, self.group = keys, values, None

    def leave_group(self) -> None:
        """Its group is given up: its positions go into a buffer of its own."""
        if self.group is not None:
            self._move(self.length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[2]
        self._reserve(end)
        self.keys[:, :, self.length:end] = key_states
        self.values[:, :, self.length:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def keep(self, length: int) -> None:
        """Forget the positions past `length`; the next update writes over them."""
        self.length = min(self.length, length)

    def reset(self) -> None:
        self.keys = self.values = self.group = None
        self.is_initialized = False
        self.length = 0

    def adopt(self, group: _Group, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold the positions in `group` from now on: `keys` and `values` are views of its rows."""
        self.group, self.keys, self.values = group, keys, values

    def appended(self, tokens: int) -> None:
        """Its group wrote `tokens` more positions into its rows."""
        self.length += tokens


class SessionCache(Cache):
    """A session's KV cache on a batchable stage; alone, it serves a forward like DynamicCache."""

    def __init__(self, layers: int):
        super().__init__(layers=[_SessionLayer() for _ in range(layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length

    def keep(self, length: int) -> None:
        """Forget the positions past `length` in every layer (a speculative step's rejected drafts)."""
        for layer in self.layers:
            layer.keep(length)

    @property
    def grouped(self) -> bool:
        """Whether some layer's positions live in a batch buffer shared with other sessions."""
        return any(layer.group is not None for layer in self.layers)

    @property
    def rows(self) -> int:
        """Sequences the cache holds (0 before its first step)."""
        return 0 if self.layers[0].keys is None else self.layers[0].keys.shape[0]


class _Group:
    """One layer of several sessions' caches in one buffer [rows, heads, capacity, dim], each
    member's rows left-padded with zeros so that all end at the same column; each member's own
    `keys` and `values` are views of its rows from where its positions begin."""

    def __init__(self, members: list[_SessionLayer], rows: list[int], capacity: int):
        earlier = {id(member.group): member.group for member in members if member.group is not None}
        end = max(member.length for member in members)
        like = members[0].keys
        self.keys = like.new_zeros(sum(rows), like.shape[1], capacity, like.shape[3])
        self.values = torch.zeros_like(self.keys)
        # weak: a session that ends frees its rows' view at once, and no cycle keeps the buffer
        self.members = [weakref.ref(member) for member in members]
        self.starts: list[int] = []
        row = 0
        for member, count in zip(members, rows):
            start = end - member.length
            self.keys[row:row + count, :, start:end] = member.keys[:, :, :member.length]
            self.values[row:row + count, :, start:end] = member.values[:, :, :member.length]
            member.adopt(self, self.keys[row:row + count, :, start:], self.values[row:row + count, :, start:])
            self.starts.append(start)
            row += count
        # the sessions still in the groups given up copy their positions out, so that each
        # session's positions are held once: no stale buffer lives on in a view
        for group in earlier.values():
            for ref in group.members:
                member = ref()
                if member is not None and member.group is group:
                    member.leave_group()

    def holds(self, members: list[_SessionLayer], past: int, tokens: int) -> bool:
        """Whether these members, in this order, still hold their positions here, all ending at
        column `past` (the longest's length), with room for `tokens` more."""
        return (
            len(members) == len(self.members)
            and all(a is b() and a.group is self for a, b in zip(members, self.members))
            and all(start + member.length == past for start, member in zip(self.starts, members))
            and past + tokens <= self.keys.shape[2]
        )


class _BatchLayer(CacheLayerMixin):
    """One layer of a batched step: rows of the members, in order, left-padded to `past`."""

    is_sliding = False

    def __init__(self, members: list[_SessionLayer], rows: list[int], past: int, kept: bool):
        super().__init__()
        self.members = members
        self.rows = rows
        self.past = past
        self.kept = kept  # the padded buffer is kept for the members' next steps
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # the members' own buffers hold the states

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        tokens = key_states.shape[2]
        group = self.members[0].group
        if group is None or not group.holds(self.members, self.past, tokens):
            if not self.kept:
                return self._padded(key_states, value_states)
            group = _Group(self.members, self.rows, self.past + tokens + GROUP_ROOM)
        end = self.past + tokens
        group.keys[:, :, self.past:end] = key_states
        group.values[:, :, self.past:end] = value_states
        for member in self.members:
            member.appended(tokens)
        return group.keys[:, :, :end], group.values[:, :, :end]

    def _padded(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The members' states after this step's, in a padded buffer for this step alone."""
        total = self.past + key_states.shape[2]
        keys = key_states.new_zeros(*key_states.shape[:2], total, key_states.shape[3])
        values = torch.zeros_like(keys)
        row = 0
        for member, rows in zip(self.members, self.rows):
            own_keys, own_values = member.update(key_states[row:row + rows], value_states[row:row + rows])
            keys[row:row + rows, :, total - own_keys.shape[2]:] = own_keys
            values[row:row + rows, :, total - own_values.shape[2]:] = own_values
            row += rows
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.past + query_length, 0

    def get_seq_length(self) -> int:
        return self.past

    def get_max_length(self) -> int:
        return -1


@dataclass
class BatchedStep:
    """What a batched forward needs beyond the hidden states: the cache in front of the members',
    the padding mask and each row's positions."""

    cache: Cache
    attention_mask: torch.Tensor  # [rows, past + tokens]: 0 where a row has no position
    position_ids: torch.Tensor  # [rows, tokens]


def batched_step(
    caches: list[SessionCache],
    rows: list[int],
    tokens: int,
    masks: list[torch.Tensor | None],
    positions: list[torch.Tensor | None],
) -> BatchedStep:
    """Members' caches (each with `rows[i]` sequences) seen as one batch for a step of `tokens`.
    `masks[i]` [rows, length + tokens] marks a member's own padding; `positions[i]` [rows, tokens]
    its positions (None: its sequence positions)."""
    past = max(cache.length for cache in caches)
    held = sum(cache.length * count for cache, count in zip(caches, rows))
    kept = sum((past - cache.length) * count for cache, count in zip(caches, rows)) <= held
    layers = len(caches[0].layers)
    cache = Cache(layers=[_BatchLayer([c.layers[i] for c in caches], rows, past, kept) for i in range(layers)])
    mask = torch.zeros(sum(rows), past + tokens, dtype=torch.long)
    position_ids = torch.empty(sum(rows), tokens, dtype=torch.long)
    row = 0
    for member, count, own_mask, own_positions in zip(caches, rows, masks, positions):
        span = member.length + tokens
        mask[row:row + count, past + tokens - span:] = 1 if own_mask is None else own_mask[:, -span:]
        if own_positions is None:
            own_positions = torch.arange(member.length, span).expand(count, tokens)
        position_ids[row:row + count] = own_positions
        row += count
    return BatchedStep(cache, mask, position_ids)
