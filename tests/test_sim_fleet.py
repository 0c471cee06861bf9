"""The fleet simulator (p2pfusion/sim/): what a placement carries against a max flow built the
long way, its optimum against trying every placement, and the real balancing policies on
simulated fleets: coverage, and how close they come."""

import random

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from p2pfusion.dht.records import PeerState
from p2pfusion.peer.balance import Capacity, bottleneck, layer_throughputs
from p2pfusion.sim.churn import Timeline
from p2pfusion.sim.fleet import draw_fleet, newcomer
from p2pfusion.sim.optimum import best_placement, carried, enumerated_best, searched
from p2pfusion.sim.profiles import MODELS, ModelShape
from p2pfusion.sim.swarm import built, fewest_hops
from tests.policy_records import rec


def _flow_with_explicit_exits(edges, num_layers):
    """What routes carry, built the long way: a max flow through a node per range, entered at its
    start, left at any boundary it passes or ends at."""
    matrix = np.zeros((num_layers + 1 + len(edges),) * 2, dtype=np.int64)
    for i, (a, b, rate) in enumerate(edges):
        node = num_layers + 1 + i
        matrix[a, node] += rate
        matrix[node, a + 1:b + 1] = 10**7
    return maximum_flow(csr_matrix(matrix.astype(np.int32)), 0, num_layers).flow_value


def test_routes_that_leave_peers_early_carry_the_weakest_layer():
    assert carried([(0, 2, 5), (2, 4, 3), (0, 4, 1)], 4) == _flow_with_explicit_exits([(0, 2, 5), (2, 4, 3), (0, 4, 1)], 4) == 4
    assert _flow_with_explicit_exits([(0, 3, 5), (2, 4, 4)], 4) == 4  # routes leave the first at 2
    assert _flow_with_explicit_exits([(0, 2, 5), (1, 4, 9), (2, 4, 3)], 4) == 5  # at 1 or 2
    assert _flow_with_explicit_exits([(0, 2, 5), (3, 4, 5)], 4) == carried([(0, 2, 5), (3, 4, 5)], 4) == 0


@pytest.mark.parametrize("seed", range(40))
def test_what_routes_carry_is_the_weakest_layers_sum(seed):
    # the policies rank placements by their weakest layer (peer/balance.py): it must be the flow
    rng = random.Random(seed)
    layers = rng.randrange(1, 10)
    edges = []
    for _ in range(rng.randrange(1, 12)):
        start = rng.randrange(layers)
        edges.append((start, rng.randrange(start + 1, layers + 1), rng.randrange(1, 100)))
    records = [rec(a, b, throughput=float(rate), name=f"p{i}") for i, (a, b, rate) in enumerate(edges)]
    assert _flow_with_explicit_exits(edges, layers) == carried(edges, layers) == bottleneck(records, layers)


@pytest.mark.parametrize("seed", range(6))
def test_the_integer_optimum_is_the_best_placement_and_its_relaxation_bounds_it(seed):
    rng = random.Random(seed)
    fleet = [Capacity(rng.choice([10.0, 20.0, 30.0]), rng.choice([None, 8.0]), rng.choice([1, 2, 3])) for _ in range(4)]
    best = enumerated_best(fleet, 4)
    solved = best_placement(fleet, 4)
    assert solved.exact and solved.found == pytest.approx(best, rel=1e-6)
    assert best_placement(fleet, 4, relax=True).bound >= best - 1e-6


@pytest.mark.parametrize("seed", range(4))
def test_a_central_search_ends_where_no_single_move_raises_the_flow(seed):
    rng = random.Random(seed)
    fleet = [Capacity(rng.choice([10.0, 20.0, 30.0]), rng.choice([None, 8.0]), rng.choice([2, 3])) for _ in range(4)]
    start = [(0, 1), (0, 1), None, (1, 2)]  # nothing reaches layer 4: it carries nothing

    def flow(ranges):
        return carried([(a, b, c.throughput(b - a)) for r, c in zip(ranges, fleet) if r is not None for a, b in [r]], 4)

    found, ranges = searched(fleet, start, 4, seconds=30.0, rng=random.Random(0))
    assert ranges[2] is None and found == pytest.approx(flow(ranges))
    assert 0.0 < found <= enumerated_best([fleet[i] for i in (0, 1, 3)], 4) + 1e-6
    for i in (0, 1, 3):  # every move of one peer, tried here by brute force
        for a in range(4):
            for b in range(a + 1, min(a + fleet[i].max_layers, 4) + 1):
                assert flow([*ranges[:i], (a, b), *ranges[i + 1:]]) <= found * (1 + 1e-6)


def test_fleets_follow_the_profiles():
    model = MODELS["llama-70b-int8"]
    fleet = draw_fleet(400, model, random.Random(0))
    assert len({v.peer_id for v in fleet}) == 400 and all(1 <= v.capacity.max_layers <= 80 for v in fleet)
    holds = {v.device.name: v.capacity.max_layers for v in fleet}
    assert holds["A100 80GB"] == 80 and holds["RTX 3060 12GB"] == 12  # 0.86 GB a layer in int8
    assert 60 < sum(v.device.name.startswith("RTX 3060") for v in fleet) < 120  # 22 % of volunteers


def test_the_fewest_hops_leave_a_peer_where_the_next_starts():
    # 0:4 or 0:6 hands on at 4 to 4:10 (or at 3 to 3:10): one hop fewer than 0:4, 4:8, 8:10; a
    # backup is no hop
    records = [rec(0, 4), rec(4, 8), rec(8, 10), rec(0, 6), rec(4, 10), rec(3, 10), rec(0, 10, PeerState.BACKUP)]
    assert fewest_hops(records, 10) == 2
    assert fewest_hops([rec(0, 4), rec(5, 10)], 10) == 0
    assert fewest_hops([rec(0, 12)], 10) == 1


SMALL = ModelShape("small", 12, 0.856e9 * 80 / 12, 1.0, 8192)  # the 70B's bytes in 12 layers: few fit anywhere


@pytest.mark.parametrize("seed", range(5))
def test_joining_volunteers_cover_the_model_when_the_fleet_can(seed):
    rng = random.Random(seed)
    fleet = draw_fleet(30, SMALL, rng)
    swarm = built(fleet, SMALL, rng)
    assert min(layer_throughputs(swarm.records.values(), SMALL.layers)) > 0
    before = bottleneck(swarm.records.values(), SMALL.layers)
    swarm.settle()
    assert min(layer_throughputs(swarm.records.values(), SMALL.layers)) > 0
    assert bottleneck(swarm.records.values(), SMALL.layers) >= before


def test_small_swarms_come_close_to_their_optimum():
    """Five volunteers of a six-layer model, whose best placement the solver proves."""
    model = ModelShape("tiny", 6, 0.856e9 * 80 / 6, 1.0, 8192)
    ratios = []
    for seed in range(8):
        rng = random.Random(seed)
        fleet = draw_fleet(5, model, rng)
        swarm = built(fleet, model, rng)
        swarm.settle()
        solved = best_placement([v.capacity for v in fleet], model.layers)  # exact, as the test above checks
        assert solved.exact
        best = solved.found
        ratios.append(bottleneck(swarm.records.values(), model.layers) / best if best else 1.0)
    assert min(ratios) >= 0.7 and sum(ratios) / len(ratios) >= 0.9


@pytest.mark.parametrize("seed", range(2))
def test_through_churn_no_layer_goes_unserved_for_a_minute(seed):
    """Volunteers crash and newcomers arrive (sessions of a median 20 minutes, so an hour replaces
    most of the fleet); the real policies keep every layer served, within the time a crashed
    peer's record takes to expire plus a backup's or a mover's reaction."""
    rng = random.Random(seed)
    swarm = built(draw_fleet(20, SMALL, rng), SMALL, rng)
    swarm.settle()
    timeline = Timeline(swarm, lambda peer_id: newcomer(peer_id, SMALL, rng), session_median=1200.0)
    timeline.start()
    flows, sizes = [], []
    timeline.run_until(3600.0, 300.0, lambda t: (flows.append(t.flow()), sizes.append(len(t.alive))))
    # a sample may fall in one of the short gaps below, a crash not yet seen
    assert len(flows) == 12 and sum(flow > 0 for flow in flows) >= 9 and 5 <= min(sizes) and max(sizes) <= 40
    assert max(timeline.gaps, default=0.0) <= 60.0
    assert set(timeline.serving) <= timeline.alive and timeline.alive <= set(swarm.records)
