"""Continuous batching: the pure policy of what runs next (hypothesis), and a batched forward of
sessions with their own caches against each session run alone on transformers' own DynamicCache."""

import asyncio
import gc
import os
import threading
import time
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from p2pfusion.models.stage import load_stage
from p2pfusion.peer import scheduler as scheduler_module
from p2pfusion.peer.batching import (
    MAX_BATCH_ROWS,
    SOURCE_ROWS,
    Pending,
    charged,
    connection_of,
    fairness_unit,
    next_batch,
    served,
    unready,
    within,
)

# clients of their own connections, and two clients one connection names (claims not vouched for)
SOURCES = ["ip:a", "ip:b/key:c", fairness_unit("peer:d", "ip:x"), fairness_unit("peer:d", "ip:y")]
USED_KEYS = SOURCES + ["peer:d"]
TOLERANCE = 1e-5  # relative L2, per session: float32 sums in another order in a padded batch

jobs = st.lists(
    st.builds(
        lambda source, prefill, rows, key: (source, prefill, rows, key),
        st.sampled_from(SOURCES),
        st.booleans(),
        st.integers(1, 512),
        st.sampled_from([None, "stage-1", "stage-2"]),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(jobs, st.dictionaries(st.sampled_from(USED_KEYS), st.floats(0, 5)), st.booleans())
def test_next_batch_is_fair_and_bounded(raw, used, after_prefill):
    # batched jobs are decode steps (a few rows: one position of a few sequences); prefills run alone
    pending = [
        Pending(s, rows, order, None, True) if prefill else Pending(s, min(rows, 4), order, key)
        for order, (s, prefill, rows, key) in enumerate(raw)
    ]
    chosen = next_batch(pending, used, after_prefill)
    assert chosen and len(set(chosen)) == len(chosen)
    lead = pending[chosen[0]]
    decode = [job for job in pending if not job.prefill]
    least = min(served(job.source, used) for job in pending)
    if after_prefill and decode and min(served(job.source, used) for job in decode) <= least:
        assert not lead.prefill  # a decode step waits for at most one prefill chunk of a unit not served less
        assert served(lead.source, used) == least
    else:  # the least-served connection leads, and within it the least-served unit
        assert served(lead.source, used) == least
    # of equally served units' jobs, decode steps go first: a client's own new sessions' prefill
    # chunks do not hold up its sessions that are decoding
    assert not lead.prefill or not [job for job in decode if served(job.source, used) == served(lead.source, used)]
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


def test_decoding_is_charged_less_than_prefilling():
    """Between a client decoding and one flooding prefills, both wanting more than half the peer,
    the decoding one gets more: its steps count half their time."""
    decode, prefill = Pending("ip:a", 4, 0, "s"), Pending("ip:b", 256, 1, prefill=True)
    assert charged(decode, 1.0) == 0.5 and charged(prefill, 1.0) == 1.0
    used = {"ip:a": charged(decode, 1.2), "ip:b": charged(prefill, 0.8)}  # a ran longer, b is charged more
    assert next_batch([decode, prefill], used, after_prefill=False) == [0]


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
    prefill = [Pending("ip:a", 256, 0, prefill=True), Pending("ip:b", 1, 1, "s")]
    assert next_batch(prefill, {"ip:b": 1.0}, after_prefill=False) == [0]  # the less served goes first,
    assert next_batch(prefill, {"ip:b": 1.0}, after_prefill=True) == [0]  # and goes on while it is served less
    assert next_batch(prefill, {"ip:a": 1.0}, after_prefill=False) == [1]
    # equally served: a decode step waits for one chunk, not two
    assert next_batch(prefill, {"ip:a": 1.0, "ip:b": 1.0}, after_prefill=False) == [1]
    assert next_batch(prefill[:1] + [Pending("ip:a", 1, 1, "s")], {"ip:a": 1.0}, after_prefill=True) == [1]
    # the clients a connection names share its one share: the heavy one among them falls behind
    relayed = [Pending(fairness_unit("peer:p", "ip:heavy"), 1, 0, "s"), Pending(fairness_unit("peer:p", "ip:light"), 1, 1, "s")]
    used = {"peer:p": 3.0, fairness_unit("peer:p", "ip:heavy"): 2.9, fairness_unit("peer:p", "ip:light"): 0.1}
    assert next_batch(relayed, used, False) == [1]
    assert next_batch(relayed + [Pending("ip:direct", 1, 2, "s")], used, False)[0] == 2  # a less-served connection


@settings(max_examples=150, deadline=None)
@given(st.lists(
    st.tuples(st.sampled_from(SOURCES), st.sampled_from([None, 1, 2]), st.integers(2, 40), st.integers(1, 6)),
    max_size=24,
))
def test_a_cohort_is_unready_until_all_its_steps_or_a_batchs_share_are_in(jobs):
    pending = [
        Pending(source, rows, i, "stage", cohort=None if tag is None else (tag, size))
        for i, (source, tag, size, rows) in enumerate(jobs)
    ]
    held = unready(pending)
    for i, job in enumerate(pending):
        if job.cohort is None:
            assert i not in held  # a step sent alone waits for no one
            continue
        # another connection's steps with the same tag are not this cohort's; the units one
        # connection names (an API's users) share its cohorts
        sent = [other for other in pending if (connection_of(other.source), other.cohort) == (connection_of(job.source), job.cohort)]
        own = [other for other in sent if other.source == job.source]
        # a cohort bigger than a unit's share of a batch runs in parts, each as soon as it is in
        assert (i in held) == (len(sent) < job.cohort[1] and sum(o.rows for o in own) < SOURCE_ROWS)


def test_the_scheduler_runs_a_cohort_once_in_and_keeps_it_whole(monkeypatch):
    """A cohort's batch starts as its last step arrives, and a cohort half in neither joins another's
    batch nor splits; a step sent alone, or a cohort whose last step never comes, waits the
    gathering moment."""
    monkeypatch.setattr(scheduler_module, "MAX_GATHER", 0.4)
    batches = []

    def runner(items):
        batches.append(items)
        return items

    async def main():
        scheduler = scheduler_module.Scheduler()
        scheduler._batch_seconds = 10.0  # a gathering moment of MAX_GATHER
        loop = asyncio.get_running_loop()

        async def step(name, cohort=None, delay=0.0):
            await asyncio.sleep(delay)
            await scheduler.run_batched("ip:a", 1, "stage", runner, name, cohort)
            return loop.time() - t

        try:
            t = loop.time()
            whole = await asyncio.gather(step("a", (1, 2)), step("b", (1, 2), 0.05))
            t = loop.time()
            two = await asyncio.gather(  # e's cohort is half in when c and d complete theirs
                step("e", (3, 2)), step("c", (2, 2)), step("d", (2, 2)), step("f", (3, 2), 0.1)
            )
            t = loop.time()
            short = await asyncio.gather(step("g", (4, 3)), step("h", (4, 3)))
            t = loop.time()
            stranger = await step("i")
        finally:
            scheduler.shutdown()
        return whole, two, short, stranger

    whole, two, short, stranger = asyncio.run(main())
    assert batches == [["a", "b"], ["c", "d"], ["e", "f"], ["g", "h"], ["i"]]
    assert max(whole) < 0.3 and max(two[1:3]) < 0.09 and 0.1 <= two[0] < 0.3 and two[3] < 0.3, (whole, two)
    assert min(short) >= 0.35 and stranger >= 0.35  # the gathering moment


def test_bulk_work_runs_at_a_lower_os_priority_than_decode_steps():
    """Where processes share cores (peers on one host, a volunteer's own work), a prefill chunk or a
    training step yields the CPU to latency-bound work; the steps still run one at a time."""

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def main():
        scheduler = scheduler_module.Scheduler()
        try:
            return await asyncio.gather(
                scheduler.run("ip:a", 1, False, priority), scheduler.run("ip:a", 64, True, priority),
                scheduler.run("ip:b", 1, False, priority),
            )
        finally:
            scheduler.shutdown()

    decode, bulk, again = asyncio.run(main())
    assert decode == again == priority()
    assert bulk == min(19, decode + scheduler_module.BULK_NICE)


@pytest.mark.parametrize("alone", [False, True])
def test_decode_steps_run_beside_a_bulk_job_only_when_it_allows(alone):
    """A prefill chunk that lets others run beside it does not hold up decode steps, batched or
    not; one that must run alone (training, an adapter on the shared module) does, and a second
    bulk job waits for the first either way."""
    chunk_may_end = threading.Event()
    ran = []

    def chunk(name):
        ran.append(f"{name} starts")
        chunk_may_end.wait(10)
        ran.append(f"{name} ends")

    def decode(name):
        ran.append(name)
        return name

    async def main():
        scheduler = scheduler_module.Scheduler()
        try:
            first = asyncio.ensure_future(scheduler.run("ip:a", 256, True, chunk, "chunk", alone=alone))
            await asyncio.sleep(0.05)
            second = asyncio.ensure_future(scheduler.run("ip:a", 256, True, chunk, "chunk 2", alone=False))
            steps = asyncio.gather(
                scheduler.run("ip:b", 1, False, decode, "step", alone=False),
                scheduler.run_batched("ip:b", 1, "stage", lambda items: [decode(i) for i in items], "batched"),
            )
            await asyncio.sleep(0.3)
            beside = list(ran)
            chunk_may_end.set()
            await asyncio.gather(first, second, steps)
            return beside
        finally:
            scheduler.shutdown()

    beside = asyncio.run(main())
    if alone:
        assert beside == ["chunk starts"]
    else:
        assert beside == ["chunk starts", "step", "batched"]
    assert ran.index("chunk 2 starts") > ran.index("chunk ends")


def test_a_returning_users_prompt_runs_before_a_busy_units_next_chunks():
    """A unit prefilling chunk after chunk, and a user that comes back with a two-chunk prompt:
    the user's chunks run next, one after the other, after the chunk running when it came; not
    each behind another of the busy unit's."""
    ran = []

    def chunk(name):
        ran.append(name)
        time.sleep(0.02)

    async def main():
        scheduler = scheduler_module.Scheduler()
        flooding = True

        async def flood():
            while flooding:
                await scheduler.run("ip:b", 64, True, chunk, "flood", alone=False)

        try:
            busy = asyncio.ensure_future(flood())
            await scheduler.run("ip:a", 8, True, chunk, "user earlier", alone=False)
            await asyncio.sleep(0.3)
            came = len(ran)
            for name in ("prompt 1", "prompt 2"):
                await scheduler.run("ip:a", 24, True, chunk, name, alone=False)
            flooding = False
            await busy
            return came
        finally:
            scheduler.shutdown()

    came = asyncio.run(main())
    assert ran[came:came + 2] == ["prompt 1", "prompt 2"] or ran[came + 1:came + 3] == ["prompt 1", "prompt 2"], ran[came - 2:]


def test_a_busier_units_decode_steps_neither_cut_nor_run_beside_a_returning_users_prompt():
    """A unit decoding and prefilling at once (an API user's streams, opened one after another)
    and a user that comes back with a two-chunk prompt: the user's chunks run one after the other,
    and none of the busy unit's decode steps starts while they run."""
    ran = []

    def job(name, seconds):
        ran.append(f"{name} starts")
        time.sleep(seconds)
        ran.append(f"{name} ends")

    async def main():
        scheduler = scheduler_module.Scheduler()
        busy = True

        async def loop(prefill, name, seconds):
            while busy:
                await scheduler.run("ip:b", 64 if prefill else 1, prefill, job, name, seconds, alone=False)

        try:
            others = [asyncio.ensure_future(loop(True, "flood", 0.02)), asyncio.ensure_future(loop(False, "step", 0.005))]
            await asyncio.sleep(0.3)
            for name in ("prompt 1", "prompt 2"):
                await scheduler.run("ip:a", 24, True, job, name, 0.02, alone=False)
            busy = False
            await asyncio.gather(*others)
        finally:
            scheduler.shutdown()

    asyncio.run(main())
    prompt = ran[ran.index("prompt 1 starts"):ran.index("prompt 2 ends") + 1]
    assert prompt == ["prompt 1 starts", "prompt 1 ends", "prompt 2 starts", "prompt 2 ends"], prompt


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


def test_a_cohort_appends_to_one_padded_buffer_and_stays_exact_as_it_changes(tiny_models):
    """The same members step after step share one padded buffer and copy no history; a step
    alone, dropped positions (rejected drafts) and a change of members re-form it; padding that
    would outweigh the positions held is made for one step only; every output matches each session
    alone on transformers' DynamicCache."""
    stage = load_stage(tiny_models["llama"], 1, 3)
    torch.manual_seed(2)
    lengths = [3, 7, 12]
    caches = [stage.new_cache() for _ in lengths]
    alone = [DynamicCache(config=stage.module.config) for _ in lengths]
    for i, length in enumerate(lengths):
        x = torch.randn(1, length, stage.hidden_size)
        for cache in (caches[i], alone[i]):
            stage.forward(x, 0, cache)

    def batch(members: list[int]):
        xs = [torch.randn(1, 1, stage.hidden_size) for _ in members]
        outs = stage.forward_batch(xs, [caches[i] for i in members], [None] * len(members), [None] * len(members))
        for i, x, out in zip(members, xs, outs):
            assert _rel(out, stage.forward(x, alone[i].get_seq_length(), alone[i])) < TOLERANCE
        return caches[members[0]].layers[0].group

    first = batch([0, 1, 2])
    assert batch([2, 0, 1]) is first  # the same members, in line, in any order: the same buffer, a column more
    x = torch.randn(1, 1, stage.hidden_size)
    assert _rel(stage.forward(x, caches[1].length, caches[1]), stage.forward(x, alone[1].get_seq_length(), alone[1])) < TOLERANCE
    second = batch([0, 1, 2])  # session 1 stepped alone: out of line
    assert second is not first
    third = batch([2, 0])  # other members; the one left out holds its positions in a buffer of its own
    assert third is not second and caches[1].layers[0].group is None
    caches[2].keep(caches[2].length - 1)  # a rejected draft's position
    alone[2].crop(-1)
    assert batch([2, 0]) is not third
    for _ in range(40):  # past the buffer's room: a bigger one
        batch([0, 1, 2])
    assert [c.length for c in caches] == [alone[i].get_seq_length() for i in range(3)]
    # a long session among short ones: padded for the step only, each keeping its own buffer
    for length in (2, 2, 90):
        x = torch.randn(1, length, stage.hidden_size)
        caches.append(stage.new_cache())
        alone.append(DynamicCache(config=stage.module.config))
        for cache in (caches[-1], alone[-1]):
            stage.forward(x, 0, cache)
    for _ in range(3):
        assert batch([3, 4, 5]) is None
    # sessions that end free their rows at once: no reference cycle keeps a buffer for the collector
    gc.disable()
    try:
        old = weakref.ref(caches[0].layers[0].group)
        ended = [weakref.ref(caches[i].layers[0]) for i in (1, 2)]
        caches[1] = caches[2] = None
        assert all(layer() is None for layer in ended)  # at once, not at the buffer's next change
        assert batch([0, 4]) is not None and old() is None
    finally:
        gc.enable()


def test_sliding_window_stages_keep_their_own_caches(tiny_models):
    stage = load_stage(tiny_models["mistral"], 0, 2)
    assert not stage.batchable  # its sessions' steps run one at a time, on transformers' DynamicCache
