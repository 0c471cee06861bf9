"""What a client believes, without a network: which stream may carry what, who answers for a false
claim, routing that trusts only the client's own measurements, and the bounded speed cache."""

import json
import math

import pytest

from p2pfusion.client.route import health as health_module
from p2pfusion.client.route.health import MAX_OBSERVED, PeerHealth, load_observed, save_observed
from p2pfusion.client.route.planner import HOP_SECONDS, UNOBSERVED_CAP, expected_throughput, find_route
from p2pfusion.client.route.claims import Stream, admitted, blamed, claim_subject, needs_ping
from p2pfusion.net import messages as m
from tests.policy_records import rec

ROUTE = ["first", "middle", "last"]


def test_results_come_only_on_the_sink_and_gradients_only_on_the_head():
    assert admitted(Stream.SINK, "result") and not admitted(Stream.HEAD, "result")
    assert admitted(Stream.HEAD, "backward") and not admitted(Stream.SINK, "backward")
    assert admitted(Stream.HEAD, "param_grads") and not admitted(Stream.SINK, "param_grads")
    for stream in Stream:
        assert admitted(stream, "error") and admitted(stream, "leaving")
        assert not admitted(stream, "ack") and not admitted(stream, "step") and not admitted(stream, "open")


def test_only_failure_and_leaving_claims_need_proof():
    assert claim_subject(m.Leaving("x")) == "x"
    assert claim_subject(m.Error("gone", failed_peer="x")) == "x"
    assert claim_subject(m.Error("bad step")) is None
    # busy and expired cost a moment, never a ban: no proof needed
    assert claim_subject(m.Error("full", failed_peer="x", code=m.ErrorCode.BUSY)) is None
    assert claim_subject(m.Error("idle", failed_peer="x", code=m.ErrorCode.EXPIRED)) is None


def test_a_claim_counts_from_its_subject_is_probed_on_the_route_and_false_off_it():
    assert not needs_ping(ROUTE, 0, "first")  # the first hop about itself, on the stream to it
    assert not needs_ping(ROUTE, 2, "last")  # the last hop about itself, on the sink
    assert needs_ping(ROUTE, 0, "last") and needs_ping(ROUTE, 0, "middle")
    assert needs_ping(ROUTE, 2, "first")  # the last hop about another: checked too
    assert not needs_ping(ROUTE, 0, "stranger")  # not on the route: false without a probe


def test_a_false_claim_is_held_against_the_hop_that_could_have_made_it():
    # about a hop of the route, relayed up the head stream: the hop just before it
    assert blamed(ROUTE, 0, "last") == "middle"
    assert blamed(ROUTE, 0, "middle") == "first"
    # about a peer off the route: the stream's own peer made or relayed it, and may do neither
    assert blamed(ROUTE, 0, "stranger") == "first"
    assert blamed(ROUTE, 2, "stranger") == "last"
    # the last hop has nobody after it to relay for: its claims about others are its own
    assert blamed(ROUTE, 2, "first") == "last"


def test_an_advertised_figure_wins_only_until_it_is_observed():
    liar = rec(0, 30, throughput=1e9, name="liar")
    honest = [rec(0, 10, throughput=50.0, name="a"), rec(10, 20, throughput=50.0, name="b"),
              rec(20, 30, throughput=50.0, name="c")]
    records = [liar, *honest]
    assert [r.peer_id for r in find_route(records, 30)] == ["liar"]  # nothing observed: the claim is all there is
    # observed (per layer) at 30 layer-tokens/s: 1 token/s through its 30 layers
    observed = {"liar": 30.0, "a": 400.0, "b": 400.0, "c": 400.0}
    assert [r.peer_id for r in find_route(records, 30, observed=observed)] == ["a", "b", "c"]
    assert expected_throughput(liar, observed) == pytest.approx(1.0)


def test_an_unobserved_peer_is_capped_at_a_multiple_of_the_best_observed():
    records = [rec(0, 4, throughput=1e9, name="new"), rec(0, 4, throughput=100.0, name="seen")]
    observed = {"seen": 400.0}  # 100 tokens/s through 4 layers
    assert expected_throughput(records[0], observed) == pytest.approx(UNOBSERVED_CAP * 100.0)
    assert expected_throughput(records[1], observed) == pytest.approx(100.0)
    # never above what it claims, either
    assert expected_throughput(rec(0, 4, throughput=3.0, name="modest"), observed) == pytest.approx(3.0)
    # the cap lets a newcomer be tried once (it may be faster), and what the client sees then decides
    assert find_route(records, 4, observed=observed)[0].peer_id == "new"
    assert find_route(records, 4, observed={**observed, "new": 40.0})[0].peer_id == "seen"


def test_each_hop_costs_a_network_round_measured_or_assumed():
    one = [rec(0, 4, throughput=1000.0, name="whole")]
    two = [rec(0, 2, throughput=2000.0, name="x"), rec(2, 4, throughput=2000.0, name="y")]
    # equal compute time per token (1 ms): the extra hop's round decides
    assert [r.peer_id for r in find_route(one + two, 4)] == ["whole"]
    # a hop this client pinged at 0.1 ms is cheaper than one it never timed
    rtts = {"whole": 0.02, "x": 0.0001, "y": 0.0001}
    assert [r.peer_id for r in find_route(one + two, 4, rtts=rtts)] == ["x", "y"]
    assert HOP_SECONDS < 0.02


def test_observed_speeds_keep_the_most_recent_peers_and_only_finite_positive_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("P2PFUSION_CACHE", str(tmp_path))
    health = PeerHealth()
    for i in range(MAX_OBSERVED + 50):
        health.observe(f"p{i}", layers=2, seconds=0.01)
    health.observe("p0", layers=2, seconds=math.inf)  # ignored
    health.observe("p0", layers=2, seconds=-1.0)
    assert len(health.observed) == MAX_OBSERVED and "p0" not in health.observed
    health.observe("p60", layers=2, seconds=0.02)  # seen again: the most recent now
    assert list(health.observed)[-1] == "p60"
    save_observed("m", health.observed)
    assert load_observed("m") == health.observed
    path = health_module._path("m")
    path.write_text(json.dumps({"nan": float("nan"), "inf": 1e400, "neg": -3, "zero": 0, "text": "9", "ok": 2.5}))
    assert load_observed("m") == {"ok": 2.5}
    path.write_text(json.dumps({f"q{i}": 1.0 for i in range(MAX_OBSERVED + 10)}))
    loaded = load_observed("m")
    assert len(loaded) == MAX_OBSERVED and "q0" not in loaded and f"q{MAX_OBSERVED + 9}" in loaded
