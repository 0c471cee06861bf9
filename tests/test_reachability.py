"""A peer checks that others reach it at the addresses it announces, before it claims layers, and
`swarm` and clients say when listed peers cannot be reached. Loopback only: a peer listening on
127.0.0.1 that announces 127.0.0.2 is the address nobody reaches."""

import json
import os
import signal
import time

import base58
import pytest
import uvloop

from p2pfusion.client.route.planner import find_route
from p2pfusion.client.survey import unanswered
from p2pfusion.dht.records import PeerState
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import RouteError
from p2pfusion.net import circuits, reach
from tests.forked_cli import forked
from tests.policy_records import rec
from tests.swarm import peers_in_background, running_peers
from tests.tiny_chat import with_chat_tokenizer


def _peer_cli(model: str, *args: str) -> list[str]:
    return ["run-peer", "--model", model, "--throughput", "100", "--host", "127.0.0.1", *args]


def test_a_neighbour_dials_only_as_far_as_the_asker_is():
    assert reach.may_dial("127.0.0.2", "ip:127.0.0.1")
    assert reach.may_dial("10.0.0.7", "ip:127.0.0.1") and reach.may_dial("93.184.216.34", "ip:10.1.2.3")
    assert not reach.may_dial("127.0.0.1", "ip:10.1.2.3")  # a LAN asker never makes us probe our loopback
    assert not reach.may_dial("192.168.1.11", "ip:93.184.216.34")  # nor an internet one our LAN
    assert not reach.may_dial("127.0.0.1", "circuit:12D3KooWRelay")
    assert reach.tcp_target("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW") == ("127.0.0.1", 4001)
    assert reach.tcp_target("/ip4/1.2.3.4/udp/4001/quic") is None
    assert reach.tcp_target("/ip4/1.2.3.4/tcp/4001/p2p/R/p2p-circuit/p2p/X") is None


def test_an_address_passes_when_any_checker_reached_it():
    good, bad, unchecked = "/ip4/1.2.3.4/tcp/1", "/ip4/5.6.7.8/tcp/2", "/ip4/9.9.9.9/udp/3/quic"
    liar = [reach.Dialled(good, False, "made up"), reach.Dialled(bad, False, "refused")]
    honest = [reach.Dialled(good, True), reach.Dialled(bad, False, "connection refused")]
    found = reach.verdict([good, bad, unchecked], ["1.2.3.4:5"], [liar, honest], "two peers")
    assert found.maddrs == [good, unchecked] and found.data_addrs == ["1.2.3.4:5"]
    assert [(d.address, d.reason) for d in found.unreachable] == [(bad, "refused")]


def test_a_neighbour_dials_back_real_addresses(tiny_models):
    """Over the real protocol: what listens answers, a port with nothing behind it does not, and a
    direct address must prove the asker's peer id."""

    async def scenario():
        async with running_peers(tiny_models["llama"], [(0, 2), (2, 4)]) as (peers, _):
            asker, neighbour = peers[1], peers[0]
            own = await asker.swarm.maddrs()
            port = own[0].split("/tcp/")[1].split("/")[0]
            dead = f"/ip4/127.0.0.2/tcp/{port}"
            other = neighbour.swarm.transport.data_addrs[0]  # a TLS listener that is not the asker
            answer = await reach.ask(
                asker.swarm.transport, neighbour.swarm.peer_id, neighbour.swarm.transport.data_addrs,
                [own[0], dead], [asker.swarm.transport.data_addrs[0], other],
            )
            return {d.address: (d.reached, d.reason) for d in answer}, own[0], dead, asker.swarm.transport.data_addrs[0], other

    results, good, dead, data, other = uvloop.run(scenario())
    assert results[good] == (True, "") and results[data] == (True, "")
    assert results[dead] == (False, "connection refused")
    assert results[other] == (False, "another host answers there, not this peer")


def test_a_peer_nobody_reaches_says_so_and_claims_no_layers(tiny_models, forks):
    """Alone (it dials itself) and beside a neighbour (which dials it back): one warning per
    address, then one error line naming the address and the flag, before any benchmark or load."""
    model = str(tiny_models["llama"].folder)
    with peers_in_background(tiny_models["llama"], [(0, 2)]) as (peers, maddrs, loop):
        alone, joined = forked(forks, [
            _peer_cli(model, "--new-swarm", "--announce-host", "127.0.0.2", "--layers", "0:2"),
            _peer_cli(model, "--initial-peers", maddrs[0], "--announce-host", "127.0.0.2", "--layers", "2:4"),
        ])
        records = loop.run(peers[0].swarm.lookup(peers[0].model))
    outs = {"alone": (alone.stdout, alone.stderr), "joined": (joined.stdout, joined.stderr)}
    for name, proc in {"alone": alone, "joined": joined}.items():
        stderr = outs[name][1]
        assert proc.returncode != 0, stderr
        last = stderr.strip().splitlines()[-1]
        assert "error: no address this peer announces can be reached" in last and "127.0.0.2" in last, last
        assert "--announce-host" in last and "claims no layers" in last and "Traceback" not in stderr
        warnings = [line for line in stderr.splitlines() if "others cannot reach this peer at" in line]
        assert len(warnings) == 2 and all("127.0.0.2" in w for w in warnings), stderr  # libp2p's and the direct one
        assert "benchmark" not in stderr.lower() and "loading layers" not in stderr
    assert "dialled from this host, as no other peer is known" in outs["alone"][1]
    assert f"dialled back by peer {peers[0].swarm.peer_id}" in outs["joined"][1]
    assert [r.peer_id for r in records] == [peers[0].swarm.peer_id]  # it never listed itself


def test_listed_peers_that_stop_answering_are_shown_and_named(tiny_models, tmp_path, forks):
    """A frozen peer (SIGSTOP: listed, connections open, nothing answers) shows in `swarm` as
    unreachable with the reason, its layers as not served by reachable peers, and a client's
    error names it. A view that has seen it echo before gives up on it once the other peer echoed."""
    source = with_chat_tokenizer(tiny_models["llama"], tmp_path / "chat")
    model = str(source.folder)
    with peers_in_background(source, [(0, 2)]) as (_, maddrs, _loop):
        with open(tmp_path / "second.log", "w") as log:
            second = forks.popen(_peer_cli(model, "--initial-peers", maddrs[0], "--layers", "2:4"), stderr=log)
        try:
            _wait_for_layers(maddrs, [[0, 2], [2, 4]])
            listed, before, after = uvloop.run(_echoes_around(maddrs, lambda: os.kill(second.pid, signal.SIGSTOP)))
            # the three wait on the same frozen peer's timeouts: at once, they wait once
            shown, table, infer = forked(forks, [
                ["swarm", "--initial-peers", maddrs[0], "--json"],
                ["swarm", "--initial-peers", maddrs[0]],
                ["infer", "--model", model, "--initial-peers", maddrs[0], "hi"],
            ])
        finally:
            os.kill(second.pid, signal.SIGKILL)
            second.wait()
    (frozen_id,) = [r.peer_id for r in listed if (r.start, r.end) == (2, 4)]
    assert before == {} and after == {frozen_id: "no echo while other peers echoed at once"}, (before, after)
    (view,) = json.loads(shown.stdout)["models"]
    frozen = [p for p in view["peers"] if p["layers"] == [2, 4]]
    assert len(frozen) == 1 and frozen[0]["state"] == "unreachable" and frozen[0]["claimed_state"] == "online"
    assert frozen[0]["unreachable"].startswith("no echo within"), frozen[0]
    assert view["gaps"] == [[2, 4]] and view["unreachable_claims"] == [[2, 4]]
    assert "unreachable" in table.stdout and "listed peers claim 2:4, but cannot be reached" in table.stdout, table.stdout
    last = infer.stderr.strip().splitlines()[-1]
    assert infer.returncode != 0 and "no peer serves layers 2:4" in last and frozen[0]["peer_id"] in last, infer.stderr


async def _echoes_around(maddrs, freeze):
    """The listed peers, and those that do not echo before and after `freeze()`, asked as the
    dashboard asks (the first round's echo times kept for the second)."""
    swarm = await join_swarm(maddrs, client_mode=True)
    try:
        (entry,) = await swarm.models()
        listed = await swarm.lookup(entry.key)
        rtts: dict[str, float] = {}
        before = await unanswered(swarm, listed, rtts)
        freeze()
        return listed, before, await unanswered(swarm, listed, rtts)
    finally:
        await swarm.shutdown()


async def _records(maddrs):
    swarm = await join_swarm(maddrs, client_mode=True)
    try:
        (entry,) = await swarm.models()
        return await swarm.lookup(entry.key)
    finally:
        await swarm.shutdown()


def _wait_for_layers(maddrs, layers, timeout=120.0):
    """Until peers serve (online, not just claim) exactly `layers`."""
    deadline = time.monotonic() + timeout
    while sorted([r.start, r.end] for r in uvloop.run(_records(maddrs)) if r.state == PeerState.ONLINE) != layers:
        assert time.monotonic() < deadline, "the second peer never served its layers"
        time.sleep(1)


def test_a_route_error_names_the_peers_left_out():
    records = [rec(0, 2, name="a"), rec(2, 4, name="b")]
    with pytest.raises(RouteError, match=r"layers 2:4 of this model: peers claim them \(b\)"):
        find_route(records, 4, banned={"b"})
    with pytest.raises(RouteError, match=r"^no peer serves layers 2:4 of this model$"):
        find_route(records[:1], 4)



def test_circuit_addresses_are_built_and_encoded_as_the_daemon_reads_them():
    """A relayed peer's address through each relay (loopback left out, at most MAX_CIRCUITS), and
    each `/p2p/` id written as its bare multihash: hivemind's CIDv1 form is refused by the daemon."""
    relay, me = "QmP9cFWkjZnzejBgh6e8YfCU2h4aNCj2xw1Mh5vV4oV2nr", "12D3KooWHZnok2fyjBTsW7ng3av1kTavsRVgKQ5Z88Xdm9pBmxZY"
    relays = [(relay, ["/ip4/127.0.0.1/tcp/4100", "/ip4/10.79.0.11/tcp/4100"]), ("QmOther", ["/ip4/127.0.0.1/tcp/9"])]
    relays += [(f"Qm{i}", [f"/ip4/10.0.0.{i}/tcp/1"]) for i in range(20)]
    found = circuits.circuits_through(relays, me)
    assert found[0] == f"/ip4/10.79.0.11/tcp/4100/p2p/{relay}/p2p-circuit/p2p/{me}"
    assert len(found) == circuits.MAX_CIRCUITS and all(circuits.is_circuit(a) for a in found)
    # a relayed connection's remote end, as the daemon lists it, against a direct one's
    assert circuits.is_circuit(f"/ip4/10.79.0.11/tcp/4100/p2p/{relay}/p2p-circuit")
    assert not circuits.is_circuit("/ip4/10.79.0.11/tcp/4100")
    raw = circuits.daemon_maddr(found[0]).to_bytes()
    assert base58.b58decode(relay) in raw and base58.b58decode(me) in raw
    assert raw.endswith(bytes([len(base58.b58decode(me))]) + base58.b58decode(me))  # no CID prefix before it
    for bad in ["/ip4/x/tcp/1", "/ip4/1.2.3.4/tcp/99999", "/p2p/0OIl", "nope"]:
        with pytest.raises(ValueError, match="not a multiaddr"):
            circuits.daemon_maddr(bad)


def test_a_relayed_peers_daemon_is_told_of_relays_it_can_read():
    """The listed peers' full addresses, one each, that a relayed peer's daemon asks for slots at its
    start: never itself, loopback, a circuit or an address the daemon would stop on. Told of four or
    more, it waits a few seconds for its slots; else the daemon looks for relays itself."""
    me, good = "12D3KooWHZnok2fyjBTsW7ng3av1kTavsRVgKQ5Z88Xdm9pBmxZY", "QmP9cFWkjZnzejBgh6e8YfCU2h4aNCj2xw1Mh5vV4oV2nr"
    peers = [
        (me, [f"/ip4/10.0.0.1/tcp/1/p2p/{me}"]),
        (good, ["/ip4/127.0.0.1/tcp/4100", f"/ip4/10.79.0.11/tcp/4100/p2p/{good}", "/ip4/10.79.0.11/tcp/9"]),
        ("0OIl-not-base58", ["/ip4/10.0.0.2/tcp/1"]),
        ("QmYTPCvX3MkiCzkRKqWd11eQ", ["nonsense", "/ip4/10.0.0.3/tcp/99999", f"/ip4/1.2.3.4/tcp/5/p2p/{good}/p2p-circuit"]),
    ]
    peers += [(f"QmP9cFWkjZnzejBgh6e8YfCU2h4aNCj2xw1Mh5vV4oV{i}", [f"/ip6/fd00::{i + 1}/tcp/1"]) for i in range(10, 20)]
    found = circuits.relay_addresses(peers, me)
    assert found[0] == f"/ip4/10.79.0.11/tcp/4100/p2p/{good}"
    assert len(found) == circuits.MAX_CIRCUITS and all(a.startswith("/ip6/fd00::") for a in found[1:])
    assert circuits.relay_addresses(peers[:1], me) == []
    assert circuits.slot_wait(len(found)) < 15 < circuits.slot_wait(circuits.MIN_RELAYS - 1)
