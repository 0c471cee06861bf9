"""The verification policies (client/checks/policy.py), without a network."""

import math

import pytest
import torch

from p2pfusion.client.checks.policy import (
    Culprit,
    alternative_route,
    check_rate,
    first_mismatch,
    judge,
    relative_errors,
    shift_tolerance,
    tolerance,
    total_variation,
    unchecked_layers,
    witness_chain,
)
from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.net.compression import AUTO, Codec
from p2pfusion.errors import RequestError
from p2pfusion.models.stage import load_stage


def record(
    peer: str, start: int, end: int, rate: float = 100.0, state=PeerState.ONLINE, weights: str = "float32"
) -> PeerRecord:
    return PeerRecord(
        "m", peer, [], start, end, state, compute_rate=rate, network_rate=None, device="cpu", weights=weights
    )


def test_judge_needs_a_third_opinion():
    assert judge(True, None, None) == Culprit.NONE
    assert judge(False, None, None) == Culprit.UNDECIDED
    assert judge(False, False, True) == Culprit.PRIMARY
    assert judge(False, True, False) == Culprit.WITNESS
    assert judge(False, False, False) == Culprit.UNDECIDED


def test_relative_errors_per_position():
    reference = torch.ones(1, 3, 4)
    claimed = reference.clone()
    claimed[0, 1] *= 1.01
    claimed[0, 2, 0] = math.nan
    errors = relative_errors(claimed, reference)
    assert errors[0, 0] == 0 and errors[0, 1] == pytest.approx(0.01, rel=1e-4) and errors[0, 2] == math.inf
    assert first_mismatch(errors, 1e-3) == 1
    assert first_mismatch(relative_errors(claimed, reference, torch.tensor([[1, 0, 0]])), 1e-3) is None


def test_tolerance_is_tight_only_for_exact_float32():
    assert tolerance(Codec.NONE, torch.float32) <= 2e-4
    assert tolerance(AUTO, torch.float32) >= tolerance(Codec.FLOAT16, torch.float32) > tolerance(Codec.NONE, torch.float32)
    assert tolerance(Codec.NONE, torch.float16) > tolerance(Codec.NONE, torch.float32)
    assert tolerance(Codec.TOPK, torch.float32) == math.inf
    with pytest.raises(RequestError):
        check_rate(1.5)


def test_the_distributions_bar_comes_from_the_formats_and_codecs_compared():
    """Total variation between next-token distributions: tight between float32 routes sent raw,
    widened only by the formats and codecs compared, and never passed against int4 (which changes
    a small model's distribution outright)."""
    logits = torch.tensor([[4.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert total_variation(logits, logits).tolist() == [0.0, 0.0]
    moved = torch.tensor([[4.0, 3.9, 0.0], [0.0, math.inf, 0.0]])  # the same greedy token, other odds
    distance = total_variation(logits, moved)
    assert 0.3 < float(distance[0]) < 0.5 and float(distance[1]) == 1.0
    assert shift_tolerance(Codec.NONE, torch.float32) <= 2e-3
    assert shift_tolerance(AUTO, torch.float32) == shift_tolerance(Codec.FLOAT16, torch.float32) < 1e-2
    assert shift_tolerance(AUTO, torch.float32, (), {Codec.NONE}) == shift_tolerance(Codec.NONE, torch.float32)
    assert shift_tolerance(Codec.NONE, torch.float32, {"float32", "int8"}) == 0.3
    assert shift_tolerance(Codec.NONE, torch.float32, {"int4"}) == 1.0  # nothing is further than 1
    assert shift_tolerance(Codec.NONE, torch.float32, {"made-up"}) == 1.0


def test_honest_float16_compute_and_wire_meet_the_tolerance(tiny_models):
    """A float16 stage, and float16 on the wire, against float32: within the bars they get."""
    source = tiny_models["llama"]
    torch.manual_seed(1)
    hidden = torch.randn(1, 24, 64)
    exact = load_stage(source, 0, 4).forward(hidden, 0)
    half = load_stage(source, 0, 4, torch.float16).forward(hidden.half(), 0)
    assert float(relative_errors(half, exact).max()) < tolerance(Codec.NONE, torch.float16) / 4
    stages = [load_stage(source, a, a + 1) for a in range(4)]
    wired = hidden
    for stage in stages:
        wired = stage.forward(wired.half().float(), 0)
    assert float(relative_errors(wired, exact).max()) < tolerance(AUTO, torch.float32) / 4


def test_alternative_route_reuses_as_few_peers_as_it_can():
    records = [record("A", 0, 2), record("B", 2, 4), record("C", 0, 2, rate=1.0), record("D", 2, 4, state=PeerState.BACKUP)]
    route = alternative_route(records, 4, primary={"A", "B"})
    assert [r.peer_id for r in route] == ["C", "D"] and unchecked_layers(route, {"A", "B"}) == []
    route = alternative_route(records[:3], 4, primary={"A", "B"})
    assert [r.peer_id for r in route] == ["C", "B"] and unchecked_layers(route, {"A", "B"}) == [(2, 4)]
    assert alternative_route(records[:3], 4, primary={"A", "B"}, avoid={"B"}) is None


def test_a_checking_route_takes_the_most_precise_formats_that_reuse_as_few_peers():
    """A faster int4 peer would set an int4 bar for the whole check: a float32 one is taken instead,
    unless only the int4 one avoids reusing a checked peer."""
    records = [
        record("A", 0, 2), record("B", 2, 4), record("Q", 0, 2, rate=1000.0, weights="int4"), record("F", 0, 2),
        record("D", 2, 4, weights="int8"),
    ]
    assert [r.peer_id for r in alternative_route(records, 4, primary={"A", "B"})] == ["F", "D"]
    route = alternative_route(records, 4, primary={"A", "B"}, avoid={"F"})
    assert [r.peer_id for r in route] == ["Q", "D"]  # reusing A would leave 0:2 unchecked
    assert [r.peer_id for r in witness_chain(records, 0, 2, avoid={"A"})] == ["F"]


def test_witness_chain_covers_exactly_the_hop():
    records = [record("A", 0, 2), record("B", 0, 1), record("C", 1, 2), record("D", 0, 3)]
    # D computes layers 0:2 and leaves the chain there, as a route may leave a peer early
    assert [(r.peer_id, r.start, r.end) for r in witness_chain(records, 0, 2, avoid={"A"})] == [("D", 0, 2)]
    assert [(r.peer_id, r.start, r.end) for r in witness_chain(records, 0, 2, avoid={"A", "D"})] == [("B", 0, 1), ("C", 1, 2)]
    assert witness_chain(records, 0, 2, avoid={"A", "C", "D"}) is None
