"""Nodes that stay silent without refusing (a suspended host: SIGSTOP on its libp2p daemon, its
connections open) cost a joining client, a read and a store no request timeout: what the others
hold is found without them. Real DHT nodes on 127.0.0.1."""

import os
import signal
import time

import pytest
import uvloop

from p2pfusion.client.route.catalog import model_records
from p2pfusion.dht.records import ModelEntry, PeerRecord, PeerState
from p2pfusion.dht.swarm import LOOKUP_TIMEOUT, join_swarm
from p2pfusion.errors import ConfigError
from tests.receipts import fault

HIVEMIND_TIMEOUT = 3.0  # hivemind's own request timeout, which a silent node used to cost in full


def _entry(i: int) -> ModelEntry:
    return ModelEntry(f"model-{i}", f"model {i}", 4, 64)


def test_silent_initial_peers_cost_a_join_a_read_and_a_store_no_timeout():
    async def main():
        nodes = [await join_swarm([])]
        first = await nodes[0].maddrs()
        nodes += [await join_swarm(first) for _ in range(3)]
        silent = nodes[1:3]
        try:
            for i, node in enumerate(nodes):
                assert await node.announce_model(_entry(i))
            everyone = [(await node.maddrs())[0] for node in nodes]
            for node in silent:
                os.kill(node.p2p._child.pid, signal.SIGSTOP)
            started = time.monotonic()
            client = await join_swarm(everyone, client_mode=True)
            try:
                listed = await client.models()
                waited = time.monotonic() - started
                assert await nodes[3].announce_model(_entry(9))
                stored = time.monotonic() - started - waited
                assert sorted(e.key for e in await client.models()) == [f"model-{i}" for i in (0, 1, 2, 3, 9)]
            finally:
                await client.shutdown()
        finally:
            for node in silent:
                os.kill(node.p2p._child.pid, signal.SIGCONT)
            for node in nodes:
                await node.shutdown()
        # every entry was replicated to the nodes that answer; the daemon alone, dialling its
        # bootstrap peers one by one, took 5 s for each silent one, and a read or a store waited
        # out the DHT's request timeout for them
        assert [e.key for e in listed] == [f"model-{i}" for i in range(4)]
        assert waited < HIVEMIND_TIMEOUT and stored < HIVEMIND_TIMEOUT, (waited, stored)

    uvloop.run(main())


def test_an_identity_in_use_is_refused_and_free_once_its_peer_stopped(tmp_path):
    async def main():
        bootstrap = await join_swarm([])
        first = await bootstrap.maddrs()
        key = str(tmp_path / "identity.key")
        try:
            running = await join_swarm(first, identity_path=key)
            with pytest.raises(ConfigError, match="another running peer already uses the identity"):
                await join_swarm(first, identity_path=key)
            await running.shutdown()
            again = await join_swarm(first, identity_path=key)
            assert again.peer_id == running.peer_id
            await again.shutdown()
        finally:
            await bootstrap.shutdown()

    uvloop.run(main())


def test_a_read_held_up_by_silent_nodes_gives_way_to_the_records_found_lately():
    """Every DHT node frozen: a read waits out its timeout, while a client that found the model's
    records moments ago routes by those (every record is pinged before a route uses it)."""

    async def main():
        nodes = [await join_swarm([])]
        first = await nodes[0].maddrs()
        nodes += [await join_swarm(first) for _ in range(2)]
        try:
            for i, node in enumerate(nodes):
                assert await node.announce(PeerRecord("model-x", node.peer_id, [], i, i + 1, PeerState.ONLINE, 10.0, None, "cpu"))
            client = await join_swarm([(await node.maddrs())[0] for node in nodes], client_mode=True)
            try:
                found = await model_records(client, "model-x", "model x")
                for node in nodes:
                    os.kill(node.p2p._child.pid, signal.SIGSTOP)
                started = time.monotonic()
                again = await model_records(client, "model-x", "model x")
                waited = time.monotonic() - started
            finally:
                for node in nodes:
                    os.kill(node.p2p._child.pid, signal.SIGCONT)
                await client.shutdown()
        finally:
            for node in nodes:
                await node.shutdown()
        assert sorted(r.peer_id for r in found) == sorted(node.peer_id for node in nodes)
        assert again == found and waited < LOOKUP_TIMEOUT, waited

    uvloop.run(main())


def test_fault_reports_against_many_peers_are_read_in_one_traversal():
    """A client reads the reports against every peer it may route through: twenty keys, one
    traversal whose requests ask a node for several keys each. A read per key made a traversal
    each, and under churn each waited on the silent nodes on its own."""

    async def main():
        nodes = [await join_swarm([])]
        first = await nodes[0].maddrs()
        nodes += [await join_swarm(first) for _ in range(4)]
        reader = await join_swarm(first, client_mode=True)
        try:
            report = fault()
            assert await nodes[1].report_faulty("model-x", report)
            accused = [report.peer_id, *(f"QmMadeUp{i}" for i in range(19))]
            asked = []
            find = reader.dht.protocol.call_find

            async def counted(peer, keys):
                asked.append(len(keys))
                return await find(peer, keys)

            reader.dht.protocol.call_find = counted
            found = await reader.fault_reports("model-x", accused)
        finally:
            for node in [reader, *nodes]:
                await node.shutdown()
        return report.peer_id, found, asked

    accused, found, asked = uvloop.run(main())
    assert [report.peer_id for _, report in found] == [accused]
    assert 3 * len(asked) <= sum(asked), asked  # a read per key: 100 requests of one key here
