"""Routing only through trusted peers (`--trusted-peers`): the file's rules without a network, then
real peers on 127.0.0.1 where untrusted peers claim to be the fastest, and never get a session."""

import asyncio
import logging
import time

import pytest
import torch

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.route.allowlist import TrustedGap, parse_peer_id, read_trusted, trusted_peers, trusted_records
from p2pfusion.dht.records import PeerState
from p2pfusion.errors import RequestError, RouteError
from p2pfusion.net.identity import Identity, peer_id_of_key
from tests.conftest import reference_model
from tests.policy_records import rec
from tests.swarm import named_swarm, start_peer, stop_peer

IDS = [3, 17, 42, 99, 5, 250, 7, 1]
NEW = 8
ED25519_ID = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"  # libp2p's inlined-key form


def new_peer_id() -> str:
    return peer_id_of_key(Identity.create().private_key.public_key())


# the file and the coverage rule, without a network


def test_a_trusted_file_takes_ids_and_multiaddrs_and_skips_comments(tmp_path):
    a, b = new_peer_id(), new_peer_id()
    path = tmp_path / "trusted"
    path.write_text(f"# my machines\n\n{a}\n  /ip4/10.0.0.2/tcp/31337/p2p/{b}  # the partner's\n{ED25519_ID}\n")
    assert read_trusted(path) == {a, b, ED25519_ID}
    assert trusted_peers(str(path)) == trusted_peers([a, f"/dns4/x.org/tcp/1/p2p/{b}", ED25519_ID])


@pytest.mark.parametrize("line, why", [
    ("QmNotAPeer0", "not base58"),  # 0 is not a base58 digit
    ("abc", "not a libp2p peer id"),
    ("/ip4/10.0.0.2/tcp/31337", "must end in /p2p/<peer id>"),
    ("two words", "not base58"),
])
def test_a_bad_line_is_named_by_its_number(tmp_path, line, why):
    path = tmp_path / "trusted"
    path.write_text(f"{new_peer_id()}\n# fine so far\n{line}\n")
    with pytest.raises(RequestError, match=f"{path}, line 3: .*{why}"):
        read_trusted(path)
    # a multihash of the right kind but cut short is refused too
    with pytest.raises(ValueError, match="multihash"):
        parse_peer_id(new_peer_id()[:-3])


def test_a_missing_empty_or_mistyped_list_is_refused(tmp_path):
    with pytest.raises(RequestError, match="cannot read the trusted peers file"):
        trusted_peers(tmp_path / "absent")
    (tmp_path / "empty").write_text("# nobody yet\n\n")
    with pytest.raises(RequestError, match="lists no peer"):
        trusted_peers(tmp_path / "empty")
    with pytest.raises(RequestError, match="lists no peer"):
        trusted_peers([])
    with pytest.raises(RequestError, match="a path to a trusted-peers file or a collection"):
        trusted_peers(b"raw bytes")
    assert trusted_peers(None) is None


def test_trusted_records_keep_only_the_list_and_name_what_it_does_not_cover():
    records = [rec(0, 2, name="t1"), rec(2, 4, name="t2"), rec(2, 4, name="u"), rec(0, 4, name="v")]
    assert [r.peer_id for r in trusted_records(records, {"t1", "t2"}, 4, "M")] == ["t1", "t2"]
    with pytest.raises(TrustedGap, match="do not serve layers 2:4 of M; p2pfusion never routes through other peers"):
        trusted_records(records, {"t1", "ghost"}, 4, "M")
    # a trusted peer this client banned counts as gone, and is named
    with pytest.raises(TrustedGap, match=r"layers 2:4 of M \(trusted peers of them failed or were caught: t2\)"):
        trusted_records(records, {"t1", "t2"}, 4, "M", down={"t2"})
    # a trusted peer still loading those layers is waited for; an offline one is not
    joining = [*records, rec(2, 4, PeerState.JOINING, name="t3")]
    assert len(trusted_records(joining, {"t1", "t2", "t3"}, 4, "M", down={"t2"})) == 3
    offline = [rec(0, 2, name="t1"), rec(2, 3, PeerState.OFFLINE, name="t2"), rec(3, 4, name="t3")]
    with pytest.raises(TrustedGap, match="layers 2:3 of"):
        trusted_records(offline, {"t1", "t2", "t3"}, 4, "M")
    # layers the client runs itself (before `first`) need no peer
    assert len(trusted_records(records, {"t2"}, 4, "M", first=2)) == 1
    with pytest.raises(TrustedGap, match="layers 1:2 of"):
        trusted_records([rec(0, 1, name="t0"), rec(2, 4, name="t2")], {"t0", "t2"}, 4, "M", first=1)


# real peers: t1 and u0 serve layers 0:2, t2, t3 and u 2:4; the untrusted claim ten times the speed

LAYOUT = [
    ("t1", (0, 2), "100"), ("u0", (0, 2), "1000"), ("t2", (2, 4), "100"), ("t3", (2, 4), "100"), ("u", (2, 4), "1000"),
]


@pytest.fixture(scope="module")
def swarm(tiny_models):
    source = tiny_models["llama"]
    layout = [(name, layers, {"throughput": throughput}) for name, layers, throughput in LAYOUT]
    with named_swarm(source, layout, "test-trusted") as (loop, peers, client):  # every test's clients share its node
        with torch.no_grad():
            out = reference_model(source).generate(
                torch.tensor([IDS]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
            )
        yield source, loop, peers, client, out[0, len(IDS):].tolist()


def ids_of(peers, *names) -> list[str]:
    return [peers[name].swarm.peer_id for name in names]


def opened(peers) -> dict[str, int]:
    return {name: peer.server.sessions_opened for name, peer in peers.items()}


async def generate(source, client, trusted, verify=0.0):
    model = RemoteCausalLM.build(source, client, compression="none", verify=verify, trusted_peers=trusted)
    return await model.generate(IDS, NEW, stop_at_eos=False, decode=False)


def test_a_partial_list_is_refused_before_any_session_opens(swarm, tmp_path):
    source, loop, peers, client, _ = swarm
    path = tmp_path / "trusted"
    path.write_text("\n".join(ids_of(peers, "t1")) + "\n")
    before = opened(peers)
    with pytest.raises(RouteError, match=f"the trusted peers do not serve layers 2:4 of {source.name}"):
        loop.run(generate(source, client, path))
    assert opened(peers) == before


def test_a_full_list_gives_transformers_tokens_through_trusted_peers_only(swarm):
    source, loop, peers, client, expected = swarm
    before = opened(peers)
    result = loop.run(generate(source, client, ids_of(peers, "t1", "t2", "t3")))
    assert result.token_ids == expected
    after = opened(peers)
    assert after["u0"] == before["u0"] and after["u"] == before["u"]
    # without the list the same client prefers the untrusted peers: the list is what kept them out
    loop.run(generate(source, client, None))
    assert opened(peers)["u0"] > after["u0"] and opened(peers)["u"] > after["u"]


def test_verification_checks_only_against_trusted_peers(swarm):
    source, loop, peers, client, expected = swarm
    before = opened(peers)
    result = loop.run(generate(source, client, ids_of(peers, "t1", "t2", "t3"), verify=1.0))
    assert result.token_ids == expected and result.rewinds == 0
    after = opened(peers)
    assert after["u0"] == before["u0"] and after["u"] == before["u"]
    assert after["t2"] > before["t2"] and after["t3"] > before["t3"]  # the route and its check


def test_the_layers_no_second_trusted_peer_serves_are_named_once_in_one_line(swarm, caplog):
    source, loop, peers, client, expected = swarm
    with caplog.at_level(logging.WARNING):
        result = loop.run(generate(source, client, ids_of(peers, "t1", "t2"), verify=1.0))
    assert result.token_ids == expected
    said = [r.getMessage() for r in caplog.records if "cannot be verified" in r.getMessage()]
    assert said == ["layers 0:2, 2:4 cannot be verified: no other peer you trust (--trusted-peers) serves them"]


async def step_by_step(source, client, trusted, extra, act) -> tuple[list[int], int, str]:
    """Greedy tokens of IDS, one step at a time; after the first, `act` (awaited) befalls the peer
    of `extra` that holds the session. The tokens, the session's recoveries, and that peer's name."""
    model = RemoteCausalLM.build(source, client, compression="none", verify=0.0, trusted_peers=trusted)
    session = await model.open_session(len(IDS) + NEW)
    try:
        tokens = [await model.next_token(await session.step(model.embed(IDS)), 0.0, None)]
        holder = next(name for name, peer in extra.items() if peer.server.sessions)
        await act(extra[holder])
        while len(tokens) < NEW:
            tokens.append(await model.next_token(await session.step(model.embed(tokens[-1:])), 0.0, None))
        return tokens, session.recoveries, holder
    finally:
        await session.close()


def test_failover_stays_on_the_list_and_fails_fast_when_it_runs_out(swarm):
    """Trusted peers a and b serve 2:4 beside untrusted ones. The one holding the session leaves
    mid-generation: the other takes over. Then that one crashes (no goodbye, its record still
    online): only untrusted peers serve 2:4, and the client says so at once."""
    source, loop, peers, client, expected = swarm
    events = {}  # the leave in flight; when and which peer crashed

    async def leave(peer):
        leaving = asyncio.ensure_future(peer.leave())  # it drains: done once the session moved
        while not peer.server.draining:
            await asyncio.sleep(0.01)
        events["leaving"] = leaving

    async def crash(peer):
        """The peer's process dies: its streams break, and its record stays in the DHT until it expires."""
        await peer.swarm.shutdown()
        peer.server.compute.shutdown()
        events["at"], events["peer"] = time.monotonic(), peer

    async def scenario():
        maddrs = await peers["t1"].swarm.maddrs()
        extra = {name: await start_peer(source, maddrs, (2, 4)) for name in ("a", "b")}
        trusted = [*ids_of(peers, "t1"), *(p.swarm.peer_id for p in extra.values())]
        before = opened(peers)
        try:
            moved = await step_by_step(source, client, trusted, extra, leave)
            await events["leaving"]
            took_over = {name: peer.server.sessions_opened for name, peer in extra.items()}
            with pytest.raises(RouteError, match="do not serve layers 2:4 .*failed or were caught") as failure:
                await step_by_step(source, client, trusted, extra, crash)
            waited = time.monotonic() - events["at"]
        finally:
            for peer in extra.values():
                if peer is not events.get("peer"):
                    await stop_peer(peer)
        return moved, took_over, failure.value, waited, before

    (tokens, recoveries, left), took_over, failure, waited, before = loop.run(scenario())
    assert tokens == expected and recoveries == 0  # moved on the leaving notice, to the other trusted peer
    assert took_over == {left: 1, ({"a", "b"} - {left}).pop(): 1}
    after = opened(peers)
    assert all(after[name] == before[name] for name in ("u0", "u", "t2", "t3")), (before, after)
    assert waited < 5.0, f"the client waited {waited:.1f} s before saying the trusted peers ran out: {failure}"
