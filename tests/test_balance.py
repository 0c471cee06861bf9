"""Load balancing, rebalancing and backup promotion: pure functions, on many swarm shapes."""

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from p2pfusion.dht.coverage import with_span
from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.peer.backup import lost_servers, promotion_rank, replaced
from p2pfusion.peer.balance import (
    Capacity, Placement, backup_stage, bottleneck, choose_model, closing_rank, choose_range, layer_replicas, layer_throughputs, place_peer,
    reclaim, unguarded_gap, yields_to,
)
from p2pfusion.peer.rebalance import new_layers, plan_move
from tests.policy_records import rec

L = 12
spans = st.lists(
    st.tuples(st.integers(0, L - 1), st.integers(1, L), st.floats(0.5, 20.0)), min_size=0, max_size=7
)
capacities = st.builds(Capacity, st.floats(1.0, 200.0), st.none(), st.integers(1, L))


def with_peer(records, peer_id, start, end, me):
    """The records as they would be with this peer serving [start, end)."""
    others = [r for r in records if r.peer_id != peer_id]
    return others + [PeerRecord("", peer_id, [], start, end, PeerState.ONLINE, me.compute_rate, me.network_rate, "")]


def records_of(raw):
    return [rec(a, b, throughput=t, name=f"p{i}") for i, (a, b, t) in enumerate(raw) if a < b]


def covered(records):
    return {i for i, t in enumerate(layer_throughputs(records, L)) if t > 0}


def log_sum(records):
    return sum(map(math.log, layer_throughputs(records, L)))


def test_first_peers_tile_an_empty_swarm():
    me = Capacity(compute_rate=10.0, network_rate=None, max_layers=10)
    records = []
    for i in range(3):
        start, end = choose_range(records, 30, me)
        records.append(rec(start, end, throughput=me.throughput(end - start), name=f"p{i}"))
    assert [(r.start, r.end) for r in records] == [(0, 10), (10, 20), (20, 30)]


@given(st.integers(1, 4), st.sampled_from([(30, 3), (12, 4), (12, 2)]))
def test_equal_peers_spread_evenly(per_stage, shape):
    num_layers, stages = shape
    me = Capacity(compute_rate=10.0, network_rate=None, max_layers=num_layers // stages)
    records = []
    for i in range(per_stage * stages):
        start, end = choose_range(records, num_layers, me)
        records.append(rec(start, end, throughput=me.throughput(end - start), name=f"p{i}"))
    ranges = [(r.start, r.end) for r in records]
    assert sorted(set(ranges)) == [(s * num_layers // stages, (s + 1) * num_layers // stages) for s in range(stages)]
    assert all(ranges.count(r) == per_stage for r in set(ranges))


def test_a_new_peer_picks_the_weak_stage():
    records = [rec(0, 10, throughput=8.0), rec(10, 20, throughput=1.0), rec(20, 30, throughput=8.0)]
    me = Capacity(compute_rate=40.0, network_rate=None, max_layers=10)
    assert choose_range(records, 30, me) == (10, 20)
    assert not place_peer(records, 30, me, "new").backup


def test_a_peer_capped_by_its_link_holds_all_it_can_starting_inside_another_range():
    # routes leave 0:12 at 10 for it (client/route/planner.py), so its first layers add throughput
    records = [rec(0, 12, throughput=10.0, name="long")]
    me = Capacity(compute_rate=1000.0, network_rate=10.0, max_layers=20)
    assert choose_range(records, 30, me) == (10, 30)


def test_slow_links_cap_what_a_peer_adds():
    me = Capacity(compute_rate=1000.0, network_rate=5.0, max_layers=30)
    assert me.throughput(10) == 5.0 and me.throughput(1) == 5.0


@settings(max_examples=300)
@given(spans, capacities)
def test_joining_never_uncovers_a_layer_nor_lowers_the_bottleneck(raw, me):
    records = records_of(raw)
    start, end = choose_range(records, L, me)
    assert 0 <= start < end <= L and end - start <= me.max_layers
    after = with_peer(records, "new", start, end, me)
    assert covered(after) >= covered(records)
    assert bottleneck(after, L) >= bottleneck(records, L)


@settings(max_examples=300)
@given(spans, st.integers(0, 6), st.floats(0.01, 5.0), st.floats(0.0, 7200.0), capacities)
def test_rebalancing_never_uncovers_repeats_or_worsens(raw, index, reload, uptime, cap):
    records = records_of(raw)
    if not records:
        return
    me = records[index % len(records)]
    cap = Capacity(me.compute_rate, None, max(cap.max_layers, me.span))
    move = plan_move(records, L, me, cap, reload, uptime)
    if move is None:
        return
    assert (move.start, move.end) != (me.start, me.end)
    after = with_peer(records, me.peer_id, move.start, move.end, cap)
    assert covered(after) >= covered(records)
    # what routes carry never drops; it rises, or layers' throughputs even out (their logarithms'
    # sum rises, so no sequence of moves comes back where it started)
    assert bottleneck(after, L) >= bottleneck(records, L) * (1 - 1e-9)
    flows_more = bottleneck(after, L) > bottleneck(records, L) * (1 + 1e-9)
    assert flows_more or log_sum(after) > log_sum(records)
    assert move.benefit > move.cost


def test_a_move_pays_only_if_the_reload_is_short_against_the_expected_stay():
    records = [rec(0, 6, throughput=4.0, name="p0", load=1.0), rec(0, 6, throughput=4.0, name="p1"), rec(6, 12)]
    me = records[0]
    tight = Capacity(me.compute_rate, None, max_layers=6)  # cannot hold both ranges: a gap while reloading
    roomy = Capacity(me.compute_rate, None, max_layers=2 * L)  # holds its range and any other at once
    overlapped = plan_move(records, L, me, roomy, reload_seconds_per_layer=1.0, uptime=60.0)
    assert overlapped is not None and overlapped.overlap and overlapped.cost == 0
    assert plan_move(records, L, me, tight, reload_seconds_per_layer=100.0, uptime=60.0) is None
    fast = plan_move(records, L, me, tight, reload_seconds_per_layer=0.1, uptime=600.0)
    assert fast is not None and not fast.overlap and 0 < fast.cost < fast.benefit


def test_a_move_prices_only_the_layers_it_must_read():
    # 3:7 moves to 6:10; its memory cannot hold both, so it stops serving while it loads, but it
    # keeps layer 6: three layers to read, not four
    records = [rec(3, 7, throughput=4.0, name="me", load=4.0), rec(7, 12), rec(4, 6, throughput=4.0), rec(0, 6, throughput=2.0)]
    me = records[0]
    move = plan_move(records, L, me, Capacity(me.compute_rate, None, max_layers=4), 1.0, 120.0)
    assert (move.start, move.end, move.overlap) == (6, 10, False)
    assert new_layers((3, 7), (6, 10)) == 3 and new_layers((0, 0), (6, 10)) == 4 and new_layers((5, 12), (6, 10)) == 0
    lost = bottleneck(records, L) - bottleneck(records[1:], L) + me.load  # tokens/s while it reloads
    assert move.cost == lost * 3 * 1.0


def test_a_balanced_swarm_stays_put():
    records = [rec(0, 6, throughput=2.0, name="a"), rec(6, 12, throughput=2.0, name="b")]
    cap = Capacity(records[0].compute_rate, None, 12)
    assert plan_move(records, L, records[0], cap, 1.0, 3600.0) is None


def test_peers_moving_count_where_they_are_going():
    records = [rec(0, 6, name="a", moving_to=(6, 12)), rec(0, 6, name="b")]
    assert layer_throughputs(records, L) == [1.0] * L
    # without the move, a joiner would see 6:12 empty and take it; with it, the swarm is balanced
    me = Capacity(compute_rate=6.0, network_rate=None, max_layers=6)
    assert place_peer(records, L, me, "new").backup


def test_backups_go_to_the_stage_most_at_risk_when_throughput_suffices():
    records = [
        rec(0, 6, throughput=2.0, name="a"), rec(0, 6, throughput=2.0, name="a2"),
        rec(6, 12, throughput=2.0, name="b"), rec(6, 12, throughput=2.0, name="b2"),
    ]
    me = Capacity(compute_rate=6.0, network_rate=None, max_layers=6)
    first = place_peer(records, L, me, "new")
    assert first.backup and (first.start, first.end) == (0, 6)
    records.append(rec(0, 6, PeerState.BACKUP, name="new"))
    second = place_peer(records, L, me, "newer")
    assert second.backup and (second.start, second.end) == (6, 12)


def test_backups_that_piled_onto_one_stage_spread_as_many_as_even_it():
    """Joiners that came at once all kept 0:6 warm. Of its five backups, the two that would promote
    last move to 6:12 (5 + 1 replicas against 1 + 1); once one has announced its move, one more."""
    records = [rec(0, 6, name="a"), rec(6, 12, name="b")]
    backups = [rec(0, 6, PeerState.BACKUP, throughput=t, name=n) for n, t in (("k1", 3.0), ("k2", 1.0), ("k3", 2.0), ("k4", 1.0), ("k5", 5.0))]
    records += backups
    moving = {r.peer_id: backup_stage(records, L, r, 6) for r in backups}
    assert moving == {"k1": None, "k2": (6, 12), "k3": None, "k4": (6, 12), "k5": None}
    # k2 then k4 are last in promotion order: slowest first, then the higher peer id
    assert [promotion_rank(backups, r) for r in backups] == [1, 3, 2, 4, 0]
    records = [r if r.peer_id != "k4" else replace(r, moving_to=(6, 12)) for r in records]
    assert {r.peer_id: backup_stage(records, L, r, 6) for r in backups if r.peer_id != "k4"} == {
        "k1": None, "k2": (6, 12), "k3": None, "k5": None,
    }
    # a backup of the stage most at risk, or of a stage one replica ahead, stays
    assert backup_stage([rec(0, 6), rec(6, 12), rec(0, 6, PeerState.BACKUP, name="x")], L,
                        rec(0, 6, PeerState.BACKUP, name="x"), 6) is None


@given(spans, st.lists(st.tuples(st.integers(0, L - 1), st.integers(1, 6), st.floats(0.5, 5.0)), max_size=8))
def test_backups_moving_never_widen_the_spread_of_replicas(raw, raw_backups):
    serving = records_of(raw)
    backups = [rec(a, min(a + k, L), PeerState.BACKUP, throughput=t, name=f"k{i}") for i, (a, k, t) in enumerate(raw_backups)]
    records = serving + backups
    states = (PeerState.ONLINE, PeerState.JOINING, PeerState.BACKUP)
    for me in backups:
        target = backup_stage(records, L, me, L)
        if target is None:
            continue
        moved = [r if r.peer_id != me.peer_id else replace(r, start=target[0], end=target[1]) for r in records]
        before, after = layer_replicas(records, L, states), layer_replicas(moved, L, states)
        # its own stage keeps more replicas than the stage it goes to had
        assert min(after[me.start:me.end]) > min(before[target[0]:target[1]])
        assert min(after[target[0]:target[1]]) == min(before[target[0]:target[1]]) + 1


def test_demand_makes_a_joining_peer_serve_instead_of_waiting():
    busy = [rec(0, 6, throughput=2.0, name="a", load=1.5), rec(6, 12, throughput=2.0, name="b", load=1.5)]
    me = Capacity(compute_rate=6.0, network_rate=None, max_layers=6)
    assert not place_peer(busy, L, me, "new").backup


def test_one_backup_promotes_per_loss():
    stage = [rec(0, 6, PeerState.BACKUP, throughput=t, name=n) for n, t in (("b1", 1.0), ("b2", 3.0), ("b3", 1.0))]
    ranks = {r.peer_id: promotion_rank(stage, r) for r in stage}
    assert ranks == {"b2": 0, "b1": 1, "b3": 2}
    before = {"a"}
    after_loss = [rec(0, 6, PeerState.OFFLINE, name="a"), *stage]
    assert lost_servers(before, after_loss, 0, 6, gone=set()) == {"a"}
    assert not replaced(before, after_loss, 0, 6, gone=set())
    promoted = [rec(0, 6, PeerState.ONLINE, throughput=3.0, name="b2"), stage[0], stage[2]]
    assert replaced(before, promoted, 0, 6, gone=set())
    # a peer reported unreachable and confirmed gone counts as lost, even while its record lives on
    assert lost_servers(before, [rec(0, 6, name="a")], 0, 6, gone={"a"}) == {"a"}


def test_a_joiner_to_a_covered_swarm_keeps_a_stage_warm_unless_it_adds_much():
    # three equal stages; a newcomer that holds all 30 layers would add a duplicate 0:30 worth a third more
    pipeline = [rec(0, 10, throughput=1.0, name="a"), rec(10, 20, throughput=1.0, name="b"), rec(20, 30, throughput=1.0, name="c")]
    whole = Capacity(compute_rate=10.0, network_rate=None, max_layers=30)
    assert place_peer(pipeline, 30, whole, "new").backup
    # ten times the weak stage's speed is worth serving
    weak = [rec(0, 10, throughput=10.0, name="a"), rec(10, 20, throughput=1.0, name="b"), rec(20, 30, throughput=10.0, name="c")]
    fast = Capacity(compute_rate=100.0, network_rate=None, max_layers=10)
    assert place_peer(weak, 30, fast, "new") == Placement(10, 20)


def test_simultaneous_joiners_agree_on_who_chooses_again():
    first = rec(10, 30, PeerState.JOINING, name="x", since=100.0)
    second = rec(10, 30, PeerState.JOINING, name="y", since=100.5)
    assert yields_to([first, second], second) and not yields_to([first, second], first)
    tie_a, tie_b = rec(10, 30, PeerState.JOINING, name="a", since=5.0), rec(10, 20, PeerState.JOINING, name="b", since=5.0)
    assert yields_to([tie_a, tie_b], tie_b) != yields_to([tie_a, tie_b], tie_a)
    # the earlier claimant may have loaded its layers by the time the later one looks again
    assert yields_to([rec(10, 30, name="x", since=100.0), second], second)
    # a backup, or a peer whose layers do not overlap, is no rival
    assert not yields_to([rec(10, 30, PeerState.BACKUP, name="x", since=1.0), second], second)
    assert not yields_to([rec(0, 10, name="x", since=1.0), second], second)
    # the loser's new choice takes the winner's claim into account
    me = Capacity(compute_rate=20.0, network_rate=None, max_layers=20)
    others = [rec(0, 10, throughput=1.0, name="a"), first]
    again = place_peer(others, 30, me, "y")
    assert (again.start, again.end) != (10, 30)


def test_a_restarted_peer_takes_back_its_layers_only_while_uncovered():
    me = Capacity(compute_rate=10.0, network_rate=None, max_layers=10)
    records = [rec(0, 10, name="a"), rec(10, 20, name="me"), rec(20, 30, name="c")]
    assert reclaim(records, 30, me, "me", (10, 20))
    assert not reclaim([*records, rec(10, 20, name="other")], 30, me, "me", (10, 20))
    assert not reclaim(records, 30, Capacity(10.0, None, 5), "me", (10, 20))  # no longer fits
    assert not reclaim(records, 20, me, "me", (10, 30))  # not a range of this model


def test_a_gap_with_a_warm_backup_is_left_to_the_backup():
    gap = [rec(10, 20, name="b"), rec(20, 30, name="c")]
    assert unguarded_gap(gap, 30)
    assert not unguarded_gap([*gap, rec(0, 10, PeerState.BACKUP, name="spare")], 30)


def test_the_peers_that_may_close_a_gap_rank_alike_and_only_those_that_may_leave_count():
    # 20:30 lost its only peer; a and b serve 0:20, c 0:10: each may leave, the fastest goes first
    swarm = [rec(0, 20, throughput=1.0, name="a"), rec(0, 20, throughput=2.0, name="b"), rec(0, 10, throughput=5.0, name="c")]
    assert [closing_rank(swarm, 30, r) for r in swarm] == [2, 1, 0]
    # a peer whose layers nobody else serves is not waited for
    lone = [rec(0, 20, throughput=9.0, name="lone"), rec(20, 25, throughput=1.0, name="a"), rec(20, 25, throughput=2.0, name="b")]
    assert closing_rank(lone, 30, lone[2]) == 0 and closing_rank(lone, 30, lone[1]) == 1
    # a peer already moving, or a backup, is not a candidate either
    moving = [rec(0, 20, throughput=9.0, name="m", moving_to=(20, 30)), *swarm[:2]]
    assert closing_rank(moving, 30, moving[2]) == 0


@given(spans)
def test_closing_ranks_are_a_permutation_of_the_candidates(raw):
    records = records_of(raw)
    ranks = sorted(closing_rank(records, L, r) for r in records)
    candidates = [r for r in records if all(layer_replicas(records, L, (PeerState.ONLINE,))[i] >= 2 for i in range(r.start, r.end))]
    # each candidate has its own place among the candidates; a non-candidate ranks among them as if it were one
    assert sorted(closing_rank(records, L, r) for r in candidates) == list(range(len(candidates)))
    assert all(0 <= rank <= len(candidates) for rank in ranks)


def test_a_peer_offered_several_models_serves_the_one_the_swarm_needs_most():
    full = [rec(0, 4, throughput=10, name="a")]
    half = [rec(0, 2, throughput=10, name="b")]
    assert choose_model({"full": (full, 4), "half": (half, 4)}) == "half"  # layers nobody serves come first
    assert choose_model({"full": (full, 4), "new": ([], 6)}) == "new"
    busy = [rec(0, 4, throughput=10, name="c", load=9.0)]
    assert choose_model({"full": (full, 4), "busy": (busy, 4)}) == "busy"  # then demand over capacity
    crowded = [rec(0, 4, throughput=5, name=f"d{i}") for i in range(3)]
    assert choose_model({"crowded": (crowded, 4), "full": (full, 4)}) == "full"  # then the fewest peers
    assert choose_model({"x": (full, 4), "y": (list(full), 4)}) == "x"  # the first listed on a tie


@given(spans, st.integers(0, L - 1), st.integers(1, L), st.floats(0.5, 20.0))
def test_with_span_sums_as_a_record_listed_last(raw, start, end, rate):
    """A look sums the others once and adds the peer itself: the same floats, bit for bit."""
    records = records_of(raw)
    end = max(end, start + 1)
    added = rec(start, end, throughput=rate, name="me")
    assert with_span(layer_throughputs(records, L), start, end, added.throughput) == layer_throughputs([*records, added], L)
