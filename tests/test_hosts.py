"""Peers on separate hosts: each peer in its own network namespace with its own IP on a bridge, the
client in none of them. Joining goes through one published address, hidden states cross real
interfaces on the direct TLS path, a peer restarts with its identity, and the swarm outlives its
bootstrap peer. Skipped, with the reason, where this machine cannot make network namespaces."""

import signal

import pytest
import uvloop

from p2pfusion.cli.hosts import HostNetwork, namespaces_unavailable, nat_unavailable
from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.net.circuits import direct_to
from tests.test_churn import _reference

unavailable = namespaces_unavailable()
pytestmark = pytest.mark.skipif(unavailable is not None, reason=f"no test hosts here: {unavailable}")

FIXED = ["--throughput", "100"]
IDS = [3, 17, 42, 99, 5]


def _peer_id(maddrs: list[str]) -> str:
    return maddrs[0].rsplit("/p2p/", 1)[1]


async def _generate(source, maddrs, host=None):
    client = await join_swarm(maddrs, host=host, client_mode=True)  # in the test's own namespace
    try:
        model = RemoteCausalLM.build(source, client)
        result = await model.generate(IDS, 8, stop_at_eos=False, decode=False)
        records = await client.lookup(source.key)
        # which peers this client holds a connection to that no relay carries
        direct = {r.peer_id for r in records if await direct_to(client.transport.p2p, r.peer_id)}
        return result.token_ids, {r.peer_id: r for r in records}, direct
    finally:
        await client.shutdown()


def test_a_swarm_across_hosts_joins_serves_restarts_and_outlives_its_bootstrap(tiny_models, tmp_path):
    source = tiny_models["llama"]
    expected = _reference(source, IDS, 8)
    with HostNetwork(3) as net, LocalSwarm(model=str(source.folder)) as swarm:
        # host 0: the long-lived bootstrap peer, listening everywhere and announcing its address
        boot = swarm.launch((0, 2), [
            *FIXED, "--host", "0.0.0.0", "--announce-host", net.host(0), "--port", "31337", "--data-port", "31338",
            "--identity", str(tmp_path / "boot.key"),
        ], prefix=net.prefix_of(0))
        published = swarm.wait_ready(boot)
        assert published == [f"/ip4/{net.host(0)}/tcp/31337/p2p/{_peer_id(published)}"]
        # host 1 listens on every interface and announces what it has (loopback last); host 2 on its IP
        volunteer = ["--host", "0.0.0.0", "--identity", str(tmp_path / "volunteer.key")]
        second = swarm.launch((2, 4), [*FIXED, *volunteer], prefix=net.prefix_of(1))
        third = swarm.launch((0, 2), [*FIXED, "--host", net.host(2)], prefix=net.prefix_of(2))
        volunteer_id = _peer_id(swarm.wait_ready(second))
        swarm.wait_ready(third)

        sent = [net.bytes_sent(i) for i in range(3)]
        tokens, records, _ = uvloop.run(_generate(source, published))
        assert tokens == expected
        assert records[volunteer_id].data_addrs[0].startswith(f"{net.host(1)}:")  # not its loopback
        # the stage 2:4 host computed every token and sent each result across its interface
        assert net.bytes_sent(1) - sent[1] > len(tokens) * 64 * 4

        # the volunteer's machine crashes and comes back: same peer id, its layers, same answers
        second.kill()
        second.wait()
        again = swarm.launch(None, [*FIXED, *volunteer, "--max-layers", "2"], prefix=net.prefix_of(1))
        assert _peer_id(swarm.wait_ready(again)) == volunteer_id

        # the bootstrap host goes away; a client that knows two addresses still gets in
        boot.send_signal(signal.SIGTERM)
        assert boot.wait(30) == 0
        tokens, records, _ = uvloop.run(_generate(source, [*published, *swarm.wait_ready(third)]))
        assert tokens == expected
        assert (records[volunteer_id].start, records[volunteer_id].end) == (2, 4)

    for i in range(4):
        log = (swarm.workdir / f"peer{i}.log").read_text()
        assert "using libp2p" not in log, log  # every hop took the direct path across the bridge


@pytest.mark.slow
@pytest.mark.skipif(nat_unavailable() is not None, reason=f"no NAT here: {nat_unavailable()}")
def test_a_peer_behind_a_nat_serves_through_relays(tiny_models):
    """A peer on a LAN behind a masquerading router (no host can reach it) finds that no neighbour
    reaches it, joins again through relays, and serves layers 2:4 alone: the hop before it and the
    client find it through a relay, it calls them back (a relay carries 128 KiB of a connection),
    and the tokens are transformers'."""
    source = tiny_models["llama"]
    expected = _reference(source, IDS, 8)
    network = HostNetwork(4, prefix="p2pfnat", subnet="10.76.0", behind_nat=1)
    with network as net, LocalSwarm(model=str(source.folder)) as swarm:
        # four public peers: the daemon behind the NAT asks relays for slots at once when it knows four
        published = swarm.wait_ready(swarm.launch((0, 2), [*FIXED, "--host", net.host(0)], prefix=net.prefix_of(0)))
        public = [swarm.launch((0, 2), [*FIXED, "--host", net.host(i)], prefix=net.prefix_of(i)) for i in range(1, 4)]
        for proc in public:
            swarm.wait_ready(proc)
        natted = swarm.launch((2, 4), [*FIXED, "--host", "0.0.0.0"], prefix=net.natted_prefix_of(0))
        relayed = swarm.wait_ready(natted, timeout=300)
        natted_id = _peer_id(relayed)
        # the client listens at its address on the bridge, as one on the internet at its public
        # address (its daemon announces only the address of its default route, which is not there)
        tokens, records, direct = uvloop.run(_generate(source, published, host=net.gateway))
    log = (swarm.workdir / "peer4.log").read_text()
    assert "joining again, to serve through relays" in log and "behind a NAT" in log, log
    assert relayed and all("/p2p-circuit/p2p/" in m for m in relayed), relayed
    assert records[natted_id].maddrs == relayed and records[natted_id].data_addrs == []
    assert natted_id in direct  # it called the client back: no relay carries the session
    assert tokens == expected
