"""Continuous batching: the pure policy of what runs next (hypothesis), and a batched forward of
sessions with their own caches against each session run alone on transformers' own DynamicCache."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from p2pfusion.models.stage import load_stage
from p2pfusion.peer.batching import (
    MAX_BATCH_ROWS,
    SOURCE_ROWS,
    URGENT_ROWS,
    Pending,
    fairness_unit,
    next_batch,
    served,
    within,
)

# clients of their own connections, and two clients that an upstream peer relays
SOURCES = ["ip:a", "ip:b/key:c", fairness_unit("peer:d", "ip:x"), fairness_unit("peer:d", "ip:y")]
USED_KEYS = SOURCES + ["peer:d"]
TOLERANCE = 1e-5  # relative L2, per session: float32 sums in another order in a padded batch

jobs = st.lists(
    st.builds(
        lambda source, rows, key: (source, rows, key),
        st.sampled_from(SOURCES),
        st.one_of(st.integers(1, 4), st.integers(URGENT_ROWS + 1, 512)),
        st.sampled_from([None, "stage-1", "stage-2"]),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(jobs, st.dictionaries(st.sampled_from(USED_KEYS), st.floats(0, 5)), st.booleans())
def test_next_batch_is_fair_and_bounded(raw, used, after_big):
    # batched jobs are decode steps (small); big ones run alone
    pending = [Pending(s, rows, order, key if rows <= URGENT_ROWS else None) for order, (s, rows, key) in enumerate(raw)]
    chosen = next_batch(pending, used, after_big)
    assert chosen and len(set(chosen)) == len(chosen)
    lead = pending[chosen[0]]
    urgent = [job for job in pending if job.rows <= URGENT_ROWS]
    if after_big and urgent:
        assert lead.rows <= URGENT_ROWS  # a decode step waits for at most one big job
        assert served(lead.source, used) == min(served(job.source, used) for job in urgent)
    else:  # the least-served connection leads, and within it the least-served unit
        assert served(lead.source, used) == min(served(job.source, used) for job in pending)
    if lead.key is None:
        assert len(chosen) == 1
        return
    batch = [pending[i] for i in chosen]
    assert all(job.key == lead.key for job in batch)
    assert sum(job.rows for job in batch) <= MAX_BATCH_ROWS
    for source in {job.source for job in batch[1:]}:
        assert sum(job.rows for job in batch if job.source == source) <= max(SOURCE_ROWS, lead.rows)
        assert within(source, lead.source, used)  # a heavy unit does not fill others' batches
    # work-conserving: a job left out would break a cap
    rows = sum(job.rows for job in batch)
    for i, job in enumerate(pending):
        if i in chosen or job.key != lead.key or not within(job.source, lead.source, used):
            continue
        own = sum(j.rows for j in batch if j.source == job.source) + job.rows
        assert rows + job.rows > MAX_BATCH_ROWS or own > SOURCE_ROWS


def test_sources_take_turns_and_each_is_capped():
    pending = [Pending("ip:abuser", 1, i, "s") for i in range(40)] + [Pending(f"ip:user{i}", 1, 40 + i, "s") for i in range(4)]
    used = {"ip:abuser": 0.1}
    batch = [pending[i].source for i in next_batch(pending, used, False)]
    assert batch[0] == "ip:user0"  # the least served leads; its turn-mates follow, the abuser within its cap
    assert {f"ip:user{i}" for i in range(4)} <= set(batch)
    assert batch.count("ip:abuser") == SOURCE_ROWS
    far = {"ip:abuser": 10.0}
    batch = [pending[i].source for i in next_batch(pending, far, False)]
    assert "ip:abuser" not in batch  # far ahead: it runs its own batches in between
    prefill = [Pending("ip:a", 256, 0), Pending("ip:b", 1, 1, "s")]
    assert next_batch(prefill, {"ip:b": 1.0}, after_big=False) == [0]  # the less served goes first...
    assert next_batch(prefill, {"ip:b": 1.0}, after_big=True) == [1]  # ...but not twice in a row
    # an upstream peer's relayed clients share its one share: the heavy one among them falls behind
    relayed = [Pending(fairness_unit("peer:p", "ip:heavy"), 1, 0, "s"), Pending(fairness_unit("peer:p", "ip:light"), 1, 1, "s")]
    used = {"peer:p": 3.0, fairness_unit("peer:p", "ip:heavy"): 2.9, fairness_unit("peer:p", "ip:light"): 0.1}
    assert next_batch(relayed, used, False) == [1]
    assert next_batch(relayed + [Pending("ip:direct", 1, 2, "s")], used, False)[0] == 2  # a less-served connection


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_batched_forward_matches_each_session_alone(tiny_models, family):
    stage = load_stage(tiny_models[family], 1, 3)
    assert stage.batchable
    torch.manual_seed(1)
    # sessions of different lengths; one holds 2 sequences, the first left-padded by 2 positions
    shapes = [(1, 3), (2, 7), (1, 12)]
    pad = torch.tensor([[2], [0]])
    masks = [None, (torch.arange(7 + 4) >= pad).long(), None]
    positions = [None, (torch.arange(7 + 4) - pad).clamp(min=0), None]
    batched = [stage.new_cache() for _ in shapes]
    alone = [DynamicCache(config=stage.module.config) for _ in shapes]  # transformers' own cache, one session each
    for i, (rows, length) in enumerate(shapes):
        x = torch.randn(rows, length, stage.hidden_size)
        mask = None if masks[i] is None else masks[i][:, :length]
        pos = None if positions[i] is None else positions[i][:, :length]
        for cache in (batched[i], alone[i]):
            stage.forward(x, 0, cache, mask, pos)
    for step in range(4):
        xs = [torch.randn(rows, 1, stage.hidden_size) for rows, _ in shapes]
        ends = [length + step + 1 for _, length in shapes]
        step_masks = [None if m is None else m[:, :ends[i]] for i, m in enumerate(masks)]
        step_positions = [None if p is None else p[:, ends[i] - 1:ends[i]] for i, p in enumerate(positions)]
        outs = stage.forward_batch(xs, batched, step_masks, step_positions)
        for i, x in enumerate(xs):
            want = stage.forward(x, alone[i].get_seq_length(), alone[i], step_masks[i], step_positions[i])
            assert outs[i].shape == want.shape
            assert _rel(outs[i], want) < TOLERANCE
    assert [c.length for c in batched] == [length + 4 for _, length in shapes]


def test_sliding_window_stages_keep_their_own_caches(tiny_models):
    stage = load_stage(tiny_models["mistral"], 0, 2)
    assert not stage.batchable  # its sessions' steps run one at a time, on transformers' DynamicCache
