"""A client's decoding sessions in lockstep (client/generate/lockstep.py): the pure policy, and the cohorts'
behaviour on an event loop, with sessions whose steps take their own times."""

import asyncio

import pytest

from p2pfusion.client.generate import lockstep as lockstep_module
from p2pfusion.client.generate.lockstep import Lockstep, arrived, cohort_for, named
from p2pfusion.net import messages as m


def test_cohort_policy():
    assert cohort_for([], 2) is None and cohort_for([2], 2) is None  # a second cohort once the first is a pair
    assert cohort_for([1], 2) == 0  # two sessions step together
    assert cohort_for([3, 2], 2) == 1 and cohort_for([2, 2], 2) == 0  # then the smallest
    assert arrived(4, 4) == "go" and arrived(1, 1) == "go"
    assert arrived(4, 3) == "straggler"  # most are back: the rest come from the same batch
    assert arrived(4, 2) == "cycle" and arrived(4, 1) == "cycle"  # out of step: wait for them to come round


def test_a_release_names_its_steps_as_the_wire_allows():
    assert named(1) is None  # a step alone
    assert named(2).size == 2 and named(m.MAX_COHORT).size == m.MAX_COHORT
    assert named(m.MAX_COHORT + 1) is None  # more than a name counts: a peer would refuse the step
    assert len({named(8).tag for _ in range(100)}) == 100
    for size in (2, m.MAX_COHORT):  # what a peer decodes
        assert m.from_header(m.to_header(m.Step(step=1, cohort=named(size)))).cohort.size == size


TOGETHER = 0.004  # seconds: turns this close were released together (tasks resume one by one)


async def _run(lockstep: Lockstep, swarm_times: dict[str, list[float]], start: dict[str, float], log: list) -> int:
    """Each session takes its turns; between turns its step takes the next of its times. Each
    turn's step names the steps sent with it as a cohort: all of them, and only them. Returns how
    many steps named one."""
    loop = asyncio.get_running_loop()
    tagged: dict[int, list[float]] = {}

    async def session(name: str):
        await asyncio.sleep(start.get(name, 0.0))
        with lockstep.member() as member:
            for seconds in swarm_times[name]:
                together = await member.turn()
                log.append((round(loop.time(), 3), name, together and together.tag))
                if together is not None:
                    tagged.setdefault(together.tag, []).append(loop.time())
                    assert 2 <= together.size <= len(swarm_times)
                    sizes.setdefault(together.tag, together.size)
                    assert sizes[together.tag] == together.size
                await asyncio.sleep(seconds)

    sizes: dict[int, int] = {}
    await asyncio.gather(*(session(name) for name in swarm_times))
    for tag, moments in tagged.items():  # a tag per release, on each step it let go
        assert len(moments) == sizes[tag] and max(moments) - min(moments) < TOGETHER, (tag, moments)
    return sum(map(len, tagged.values()))


def _moments(log: list, names: set[str]) -> list[float]:
    return [t for t, name, _ in log if name in names]


def test_sessions_fall_in_step_and_a_late_one_is_not_waited_for_long():
    lockstep = Lockstep(cohorts=2)
    log = []
    # a, c and e start at once; b, d and f a moment apart; all steps take 40 ms, but f's third
    # step takes 200 ms (a failover, say)
    times = {name: [0.04] * 12 for name in "abcdef"}
    times["f"][2] = 0.2
    start = {"b": 0.01, "d": 0.025, "f": 0.03}
    asyncio.run(_run(lockstep, times, start, log))
    turns = {name: _moments(log, {name}) for name in "abcdef"}
    tags = {name: [tag for _, who, tag in log if who == name] for name in "abcdef"}
    # by their sixth turn, everyone is in one of two cohorts, whose members go in one release (the
    # release's tag says which, where moments on a loaded machine could be pulled apart)
    sixth: dict = {}
    for name in "abcde":
        sixth.setdefault(tags[name][5], set()).add(name)
    groups = list(sixth.values())
    assert None not in sixth and sorted(map(len, groups)) == [2, 3], sixth
    next(group for group in groups if len(group) == 2).add("f")  # f is late: see below
    # f's cohort-mates went on without it after a short wait, not the 200 ms of its slow step...
    mates = next(group for group in groups if "f" in group) - {"f"}
    for name in mates:
        gaps = [b - a for a, b in zip(turns[name], turns[name][1:])]
        assert max(gaps[5:]) < 0.15, (name, gaps)
    # ...and f fell in step with them again once back (one turn behind: it ends alone)
    theirs = {tag for name in mates for tag in tags[name]}
    back = [tag for tag in tags["f"][3:] if tag is not None]
    assert len(back) >= 4 and set(back) <= theirs, (tags["f"], theirs)
    assert not lockstep._cohorts  # all left


def test_a_session_alone_never_waits_and_a_pair_steps_together(monkeypatch):
    # timers that would show: a wait for anyone would cost a second
    monkeypatch.setattr(lockstep_module, "STRAGGLER", 1.0)
    monkeypatch.setattr(lockstep_module, "FIRST_CYCLE", 1.0)
    log = []
    assert asyncio.run(_run(Lockstep(cohorts=2), {"a": [0.0] * 20}, {}, log)) == 0  # a step alone names no cohort
    assert log[-1][0] - log[0][0] < 0.2
    log = []
    asyncio.run(_run(Lockstep(cohorts=2), {"a": [0.0] * 10, "b": [0.01] * 10}, {}, log))
    # one cohort: from b's first turn on, each of b's turns went in one release with one of a's (a
    # took its first alone, so b ends a turn after a, alone); the tags say so, not moments that a
    # loaded machine can pull apart
    tags = {name: [tag for _, who, tag in log if who == name] for name in "ab"}
    assert None not in tags["b"][:-1] and tags["b"][-1] is None, tags
    assert len(set(tags["b"][:-1])) == 9 and set(tags["b"][:-1]) <= set(tags["a"]), tags
    a = _moments(log, {"a"})
    assert a[-1] - a[0] > 7 * 0.01  # its own steps take no time: it went at b's pace


@pytest.mark.parametrize("leaving", [True, False])
def test_a_member_that_leaves_does_not_hold_its_cohort(monkeypatch, leaving):
    # a member still counted after it left would hold the others a second at each turn
    monkeypatch.setattr(lockstep_module, "STRAGGLER", 1.0)
    monkeypatch.setattr(lockstep_module, "FIRST_CYCLE", 1.0)
    lockstep = Lockstep(cohorts=1)
    log = []
    # c stops after two turns (its generation ended, or raised); the others go on at their pace
    times = {"a": [0.02] * 10, "b": [0.02] * 10, "c": [0.02] * (2 if leaving else 10)}
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_run(lockstep, times, {}, log))
    finally:
        loop.close()
    moments = _moments(log, {"a"})
    assert moments[-1] - moments[0] < 9 * 0.02 + 0.1
    assert not lockstep._cohorts


def test_cohort_counts_take_turns_then_keep_the_faster_and_revisit_the_other():
    counts = lockstep_module.CohortCounts((1, 2))
    rates = {1: 100.0, 2: 60.0}
    seen = []
    count = None
    for _ in range(4 * lockstep_module.REVISIT_WINDOWS):
        count = counts.count(8, count)
        seen.append(count)
        counts.measured(8, count, rates[count])
    assert seen[:4] == [1, 1, 2, 2]  # each in turn until it has WINDOWS windows, changing as little as can be
    assert counts.count(8) == 1 and counts.count(12) == 1  # 8 or more sessions are one size
    assert seen[4:].count(2) <= len(seen[4:]) // lockstep_module.REVISIT_WINDOWS + 1  # the other, now and then
    assert counts.count(4) == 1  # 4-7 sessions are measured apart, from the start
    counts.measured(4, 1, 50.0)
    assert counts.count(5) == 2
    rates[2] = 200.0  # the machine changes (its peers got cores of their own): the revisits notice
    for _ in range(4 * lockstep_module.REVISIT_WINDOWS):
        count = counts.count(8)
        counts.measured(8, count, rates[count])
    assert counts.count(8) == 2


@pytest.mark.parametrize("faster", [1, 2])
def test_a_group_of_sessions_settles_on_the_cohort_count_that_steps_faster(monkeypatch, faster):
    """Eight sessions whose steps take 10 ms in the faster count's cohorts and 40 ms in the other's
    (as where peers share the client's cores, or have their own): the group measures both counts
    and ends in the faster."""
    monkeypatch.setattr(lockstep_module, "WINDOW", 0.06)
    lockstep = Lockstep()
    counts_seen = []

    async def session():
        with lockstep.member() as member:
            end = asyncio.get_running_loop().time() + 1.5
            while asyncio.get_running_loop().time() < end:
                await member.turn()
                count = len(lockstep._cohorts[member.cohort.key])
                counts_seen.append(count)
                await asyncio.sleep(0.01 if count == faster else 0.04)

    async def main():
        await asyncio.gather(*(session() for _ in range(8)))

    asyncio.run(main())
    assert set(counts_seen[:len(counts_seen) // 4]) == {1, 2}  # both were measured
    late = counts_seen[-len(counts_seen) // 4:]
    assert late.count(faster) >= 0.8 * len(late), (faster, late)
    assert not lockstep._cohorts


def test_a_client_starts_from_the_cohort_counts_it_measured_last(tmp_path, monkeypatch):
    monkeypatch.setenv("P2PFUSION_CACHE", str(tmp_path))
    counts = lockstep_module.CohortCounts((1, 2))
    for count, rate in [(1, 100.0), (1, 96.0), (2, 80.0), (2, 85.0)]:
        counts.measured(8, count, rate)
    lockstep_module.save_counts("some-model", counts)
    again = lockstep_module.load_counts("some-model")
    assert again.count(8, 2) == 1 and again.to_json() == counts.to_json()
    assert lockstep_module.load_counts("another-model").count(8) == 1  # nothing measured: turns, from one
    path = tmp_path / "cohorts" / "some-model.json"
    path.write_text('{"8": {"1": [1e400, -3, "x", 50.0], "9": [1.0]}, "7": {"1": [1.0]}, "x": 3}')
    assert lockstep_module.load_counts("some-model").to_json() == {"8": {"1": [50.0], "2": []}}  # the rest left out
    path.write_text("not json")
    assert lockstep_module.load_counts("some-model").to_json() == {}


def test_a_group_runs_the_count_measured_for_its_size_as_soon_as_it_forms(monkeypatch):
    monkeypatch.setattr(lockstep_module, "WINDOW", 60.0)  # no window ends: only the group's forming decides
    counts = lockstep_module.CohortCounts((1, 2))
    for count, rate in [(1, 50.0), (1, 50.0), (2, 100.0), (2, 100.0)]:
        counts.measured(8, count, rate)
    lockstep = Lockstep(counts=counts)
    seen = []

    async def session():
        with lockstep.member() as member:
            for _ in range(20):
                await member.turn()
                seen.append(len(lockstep._cohorts[member.cohort.key]))
                await asyncio.sleep(0.01)

    async def main():
        await asyncio.gather(*(session() for _ in range(8)))

    asyncio.run(main())
    assert seen[-80:].count(2) == 80, seen
