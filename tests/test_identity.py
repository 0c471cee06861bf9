"""Volunteers' peers that last: a peer restarts with its identity (same peer id, same certificate,
its layers back), key files stay private, and a swarm outlives its bootstrap peer."""

import signal
import stat

import pytest
import uvloop

from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import ConfigError
from p2pfusion.net.addresses import free_port
from p2pfusion.net.identity import Identity
from tests.test_churn import _reference

FIXED = ["--throughput", "100"]


def _peer_id(maddrs: list[str]) -> str:
    return maddrs[0].rsplit("/p2p/", 1)[1]


async def _records(maddrs, model):
    client = await join_swarm(maddrs, client_mode=True)
    try:
        return {r.peer_id: r for r in await client.lookup(model)}
    finally:
        await client.shutdown()


async def _generate(source, maddrs, ids):
    client = await join_swarm(maddrs, client_mode=True)
    try:
        return (await RemoteCausalLM.build(source, client).generate(ids, 8, stop_at_eos=False, decode=False)).token_ids
    finally:
        await client.shutdown()


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_killed_peer_comes_back_as_itself_and_the_swarm_outlives_its_bootstrap_peer(tiny_models, tmp_path, forks):
    """A volunteer killed without a goodbye restarts with its id, certificate, address and layers.
    A long-lived bootstrap peer (fixed ports, kept identity) goes down: peers and clients that list
    several initial peers join through any one that answers, and it comes back at its address."""
    source = tiny_models["llama"]
    key = tmp_path / "volunteer.key"
    args = [*FIXED, "--identity", str(key), "--max-layers", "2"]
    boot_args = [*FIXED, "--identity", str(tmp_path / "boot.key"), "--port", str(free_port("127.0.0.1")), "--data-port", str(free_port("127.0.0.1"))]
    ids = [3, 17, 42, 99]
    with LocalSwarm(model=str(source.folder), forks=forks) as swarm:
        boot = swarm.launch((0, 2), boot_args)
        boot_maddr = swarm.wait_ready(boot)[0]
        first = swarm.launch(None, args)
        maddrs = swarm.wait_ready(first)
        peer_id = _peer_id(maddrs)
        certificate = (tmp_path / "volunteer.key.tls").read_bytes()
        assert _mode(key) == 0o600 and _mode(tmp_path / "volunteer.key.tls") == 0o600
        data_addrs = uvloop.run(_records(swarm.maddrs, source.key))[peer_id].data_addrs
        first.kill()  # no goodbye: its record still says online
        first.wait()
        again = swarm.launch(None, args)
        # the same id at the same address: the multiaddr others were given still reaches it
        assert swarm.wait_ready(again) == maddrs and _peer_id(maddrs) == peer_id
        assert (tmp_path / "volunteer.key.tls").read_bytes() == certificate
        record = uvloop.run(_records(swarm.maddrs, source.key))[peer_id]
        assert (record.start, record.end, record.state) == (2, 4, PeerState.ONLINE)
        assert record.data_addrs == data_addrs
        assert uvloop.run(_generate(source, swarm.maddrs, ids)) == _reference(source, ids, 8)

        both = [boot_maddr, maddrs[0]]
        boot.send_signal(signal.SIGTERM)
        assert boot.wait(30) == 0
        swarm.maddrs = both  # a volunteer's saved line, the first of which is down
        swarm.wait_ready(swarm.launch((0, 2), FIXED))
        ids = [5, 6, 7]
        assert uvloop.run(_generate(source, both, ids)) == _reference(source, ids, 8)
        # the bootstrap peer comes back with the same shared list (it skips its own address)
        back = swarm.launch((0, 2), boot_args)
        assert swarm.wait_ready(back)[0] == boot_maddr
        assert uvloop.run(_generate(source, [boot_maddr], ids)) == _reference(source, ids, 8)


def test_identity_files_are_private_and_kept(tmp_path):
    path = tmp_path / "peer.key"
    made = Identity.create(path)
    assert _mode(path) == 0o600
    made.server_context()  # writes the certificate beside the key
    assert _mode(tmp_path / "peer.key.tls") == 0o600
    path.chmod(0o644)  # as an older version or a copy may leave it
    loaded = Identity.load_or_create(path)
    assert loaded.peer_id == made.peer_id and _mode(path) == 0o600
    assert loaded.tls_credentials() == made.tls_credentials()  # the same certificate after a restart


def test_a_broken_identity_file_is_a_one_line_error(tmp_path):
    path = tmp_path / "peer.key"
    path.write_bytes(b"not a key")
    with pytest.raises(ConfigError, match="not a readable libp2p identity file"):
        Identity.load_or_create(path)


def test_a_record_in_another_peers_name_is_dropped():
    """Records are signed with the peer's own libp2p key: one that names another peer is ignored."""

    async def scenario():
        victim = await join_swarm([])
        maddrs = await victim.maddrs()
        attacker = await join_swarm(maddrs)
        client = await join_swarm(maddrs, client_mode=True)
        try:
            for peer_id in (victim.peer_id, attacker.peer_id):
                await attacker.announce(PeerRecord("m", peer_id, [], 0, 4, PeerState.ONLINE, 1.0, None, "cpu"))
            return [r.peer_id for r in await client.lookup("m")], attacker.peer_id
        finally:
            for node in (client, attacker, victim):
                await node.shutdown()

    found, attacker = uvloop.run(scenario())
    assert found == [attacker]
