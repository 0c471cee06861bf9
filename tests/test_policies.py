"""Pure policies, without a network: routing, layer claiming, DHT record parsing."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pfusion.client.routing import find_route, missing_layers
from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.errors import RouteError
from p2pfusion.peer.claim import choose_layers


def rec(start, end, state=PeerState.ONLINE, throughput=1.0, name=None):
    return PeerRecord("m", name or f"p{start}-{end}-{throughput}", [], start, end, state, throughput, "cpu")


def test_route_covers_all_layers_with_fewest_hops():
    records = [rec(0, 10), rec(10, 20), rec(20, 30), rec(0, 20), rec(10, 30, PeerState.OFFLINE)]
    route = find_route(records, 30)
    assert [(r.start, r.end) for r in route] == [(0, 20), (20, 30)]


def test_route_prefers_faster_peer_among_equal_hops():
    records = [rec(0, 5, throughput=1.0), rec(0, 5, throughput=9.0), rec(5, 10)]
    assert find_route(records, 10)[0].throughput == 9.0


def test_route_names_missing_layers():
    with pytest.raises(RouteError, match="layers 10:20, 25:30"):
        find_route([rec(0, 10), rec(20, 25), rec(10, 20, PeerState.JOINING)], 30)


def test_route_rejects_ranges_that_do_not_chain():
    with pytest.raises(RouteError, match="do not chain"):
        find_route([rec(0, 6), rec(4, 10)], 10)


@given(st.lists(st.tuples(st.integers(0, 11), st.integers(1, 12)), max_size=8))
def test_route_is_contiguous_whenever_it_exists(spans):
    records = [rec(a, b) for a, b in spans if a < b]
    try:
        route = find_route(records, 12)
    except RouteError:
        return
    assert route[0].start == 0 and route[-1].end == 12
    assert all(x.end == y.start for x, y in zip(route, route[1:]))


def test_claim_takes_first_unserved_range():
    assert choose_layers([], 30, 10) == (0, 10)
    assert choose_layers([rec(0, 10)], 30, 10) == (10, 20)
    assert choose_layers([rec(0, 10), rec(20, 30)], 30, 30) == (10, 20)


def test_claim_counts_joining_peers_and_ignores_offline_ones():
    assert choose_layers([rec(0, 10, PeerState.JOINING)], 30, 10) == (10, 20)
    assert choose_layers([rec(0, 10, PeerState.OFFLINE)], 30, 10) == (0, 10)


def test_claim_when_all_served_takes_least_replicated():
    records = [rec(0, 30), rec(0, 15)]
    assert choose_layers(records, 30, 30) == (15, 30)


@given(st.lists(st.tuples(st.integers(0, 19), st.integers(1, 20)), max_size=6), st.integers(1, 20))
def test_claim_is_in_bounds_and_fills_a_gap_first(spans, max_layers):
    records = [rec(a, b) for a, b in spans if a < b]
    start, end = choose_layers(records, 20, max_layers)
    assert 0 <= start < end <= 20 and end - start <= max_layers
    gaps = missing_layers(records, 20)
    if gaps:
        assert start == gaps[0][0]


def test_record_parsing_rejects_malformed_values():
    good = rec(0, 4).to_value()
    assert PeerRecord.from_value(good) == rec(0, 4)
    for bad in (None, 3, {}, {**good, "state": "dancing"}, {**good, "start": 5}, {**good, "maddrs": 7}):
        assert PeerRecord.from_value(bad) is None
