"""A client trusts only what it measured: attacks by a real peer patched to lie, and by records
pointing at tarpits, against real peers on 127.0.0.1. Each checks that the client is still served
the tokens transformers gives, and that nobody honest pays for the lie.

The swarm: `forger` and `honest` serve layers 0:2 (the forger advertises more, so routes start
through it), `last` is the only server of 2:4. The forger lies on the stream to the client,
where it sits as the first hop, so each attack reaches the client whatever the relays do.
"""

import asyncio
import itertools
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from p2pfusion.cli import commands
from p2pfusion.cli.main import main
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.client.route.pings import PING_TIMEOUT
from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.dht.swarm import SwarmNode, join_swarm
from p2pfusion.models.source import ModelSource
from p2pfusion.net import messages as m
from p2pfusion.net.framing import write_frame
from p2pfusion.peer.runtime import Peer
from tests.conftest import reference_model
from tests.swarm import start_peer, stop_peer

IDS = [3, 17, 42, 99, 5]
NEW_TOKENS = 8


@dataclass
class Swarm:
    source: ModelSource
    loop: BackgroundLoop
    forger: Peer
    honest: Peer
    last: Peer
    client: SwarmNode
    maddrs: list[str]
    expected: list[int]

    def model(self) -> RemoteCausalLM:
        # a fresh client each time: nothing it learned in one attack carries into the next
        model = RemoteCausalLM.build(self.source, self.client, compression="none", verify=0.0)
        model.core.health.observed.clear()  # what the last one saved in the cache
        return model

    def generate(self, model: RemoteCausalLM):
        t0 = time.perf_counter()
        out = self.loop.run(model.generate(IDS, NEW_TOKENS, stop_at_eos=False, decode=False))
        return out, time.perf_counter() - t0

    def attacked(self, forge):
        """A fresh client's generation while the forger writes forge(step, output) frames to it."""
        arm(self.forger, forge)
        try:
            model = self.model()
            result, seconds = self.generate(model)
        finally:
            disarm(self.forger)
        return model, result, seconds

    @property
    def ids(self) -> dict[str, str]:
        return {"forger": self.forger.swarm.peer_id, "honest": self.honest.swarm.peer_id, "last": self.last.swarm.peer_id}


@pytest.fixture(scope="module")
def swarm(tiny_models, tmp_path_factory):
    source = tiny_models["llama"]
    with pytest.MonkeyPatch.context() as patch:
        # observed speeds start empty and stay out of this machine's cache
        patch.setenv("P2PFUSION_CACHE", str(tmp_path_factory.mktemp("cache")))
        with torch.no_grad():
            out = reference_model(source).generate(torch.tensor([IDS]), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = out[0, len(IDS):].tolist()
        loop = BackgroundLoop("trust-peers")
        peers = []
        try:
            peers.append(loop.run(start_peer(source, [], (2, 4))))
            maddrs = loop.run(peers[0].swarm.maddrs())
            peers.append(loop.run(start_peer(source, maddrs, (0, 2), throughput="1000")))
            peers.append(loop.run(start_peer(source, maddrs, (0, 2))))
            client = loop.run(join_swarm(maddrs, client_mode=True))
            try:
                yield Swarm(source, loop, peers[1], peers[2], peers[0], client, maddrs, expected)
            finally:
                loop.run(client.shutdown())
        finally:
            for peer in peers:
                loop.run(stop_peer(peer))
            loop.close()


def arm(peer: Peer, forge):
    """Make `peer` write forge(step number, its output) frames to the hop before it (here the
    client) after computing each step, before passing the step on."""
    compute = peer.server.compute
    original = type(compute).forward.__get__(compute)
    counters: dict[str, itertools.count] = {}

    async def forward(session, inputs):
        out, seconds = await original(session, inputs)
        step = next(counters.setdefault(session.session_id, itertools.count(1)))
        for header, tensor in forge(step, out):
            await write_frame(session.upstream, header, tensor)
        return out, seconds

    compute.forward = forward


def disarm(peer: Peer) -> None:
    peer.server.compute.__dict__.pop("forward", None)


def test_a_forged_result_on_the_head_stream_never_becomes_the_output(swarm):
    ids = swarm.ids
    # the first hop answers every step itself, before the last hop can, with states of its own
    model, result, _ = swarm.attacked(lambda step, out: [(m.to_header(m.Result(step)), torch.full_like(out, 3.0))])
    assert result.token_ids == swarm.expected
    assert result.recoveries == 0  # the frames were dropped; the session went on
    assert swarm.forger.server.sessions_opened >= 1  # it was on the route
    assert ids["forger"] in model.core.health.bans  # the frames count against it once the session ends
    assert ids["last"] not in model.core.health.bans


def test_a_forged_failure_of_a_peer_off_the_route_bans_only_the_forger(swarm):
    ids = swarm.ids
    forged = m.Error(message=f"the next hop {ids['honest']} closed the session", failed_peer=ids["honest"])
    model, result, _ = swarm.attacked(lambda step, out: [(m.to_header(forged), None)] if step == 2 else [])
    assert result.token_ids == swarm.expected
    assert result.recoveries == 1
    assert set(model.core.health.bans) == {ids["forger"]}  # the honest peer named is neither banned
    reports = swarm.loop.run(swarm.client.unreachable_reports(swarm.source.key))
    assert ids["honest"] not in {r.peer_id for r in reports}  # nor reported


def test_a_forged_leaving_of_the_only_server_costs_seconds_not_the_generation(swarm):
    ids = swarm.ids
    model, result, seconds = swarm.attacked(lambda step, out: [(m.to_header(m.Leaving(ids["last"])), None)] if step == 2 else [])
    assert result.token_ids == swarm.expected
    assert seconds < 10.0
    # the client pinged `last`, found it serving, and held the hop before it to account
    assert set(model.core.health.bans) == {ids["forger"]}


def test_forged_timings_do_not_make_a_peer_fast_or_another_slow(swarm):
    ids = swarm.ids
    server = swarm.forger.server
    send_onward = type(server)._send_onward

    async def forged(session, header, payload):
        # the forger says it took a nanosecond and that the next hop took 100 s
        header = {**header, "timings": [[ids["last"], 100.0], [ids["forger"], 1e-9]]}
        await send_onward(session, header, payload)

    server._send_onward = forged
    try:
        model = swarm.model()
        result, _ = swarm.generate(model)
    finally:
        del server._send_onward
    assert result.token_ids == swarm.expected
    observed = model.core.health.observed
    # both hops get this client's own time per token, shared by layer: the same per-layer rate
    assert observed[ids["forger"]] == pytest.approx(observed[ids["last"]])
    assert 10.0 < observed[ids["last"]] < 1e6  # the forged figures would give 0.02 and 2e9


def test_busy_and_expired_move_the_session_without_a_ban(swarm):
    ids = swarm.ids
    for code in (m.ErrorCode.BUSY, m.ErrorCode.EXPIRED):
        error = m.Error(message=f"{code} on {ids['forger']}", failed_peer=ids["forger"], code=code)
        model, result, seconds = swarm.attacked(lambda step, out: [(m.to_header(error), None)] if step == 2 else [])
        assert result.token_ids == swarm.expected, code
        assert model.core.health.bans == {}, code
        assert seconds < 10.0
    reports = swarm.loop.run(swarm.client.unreachable_reports(swarm.source.key))
    assert ids["forger"] not in {r.peer_id for r in reports}, reports


TARPITS = 3


async def _tarpit_records(swarm: Swarm):
    """Nodes that announce, in their own names, layers 0:4 at a billion tokens/s, whose direct
    address accepts connections and never answers, and whose libp2p handler never answers."""
    release = asyncio.Event()

    async def hold(reader, writer, *_):
        await release.wait()
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    nodes = []
    for _ in range(TARPITS):
        node = await join_swarm(swarm.maddrs)
        await node.transport.add_handler(m.PROTOCOL, hold)
        record = PeerRecord(
            swarm.source.key, node.peer_id, await node.maddrs(), 0, 4, PeerState.ONLINE,
            compute_rate=4e9, network_rate=None, device="cpu", data_addrs=[addr], since=time.time(),
        )
        assert await node.announce(record)
        nodes.append(node)
    return server, release, nodes


def test_tarpit_records_cost_seconds(swarm):
    server, release, nodes = swarm.loop.run(_tarpit_records(swarm))
    try:
        records = swarm.loop.run(swarm.client.lookup(swarm.source.key))
        assert sum(r.peer_id in {n.peer_id for n in nodes} for r in records) == TARPITS
        model = swarm.model()
        result, seconds = swarm.generate(model)
        banned = swarm.loop.run(_banned_within(model, {n.peer_id for n in nodes}, PING_TIMEOUT + 2.0))
    finally:
        release.set()
        for node in nodes:
            swarm.loop.run(node.shutdown())
        server.close()
    assert result.token_ids == swarm.expected
    # the route did not wait out their pings (each used to cost 30 s, then one PING_TIMEOUT for
    # all): once the honest peers answered, the tarpits were left out, and banned when their
    # pings timed out
    assert seconds < PING_TIMEOUT
    assert banned


async def _banned_within(model, peers: set[str], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not peers <= set(model.core.health.bans):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def test_a_network_error_reaching_the_cli_is_one_line(monkeypatch, capsys):
    async def dropped(*_):
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(commands, "infer", dropped)
    # main() maps the quantization libraries `infer` never uses to None in sys.modules, meant for
    # a process of its own: set here, it is undone after the test (later tests start int4 peers)
    for library in ("bitsandbytes", "torchao"):
        if library not in sys.modules:
            monkeypatch.setitem(sys.modules, library, None)
    assert main(["infer", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmPeer", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "p2pfusion: error: ConnectionResetError: [Errno 104] Connection reset by peer"
    assert not any("Traceback" in line for line in err)


def test_a_made_up_refusal_is_checked_on_other_peers(swarm):
    ids = swarm.ids
    refusal = m.Error(message="hidden states must be float16, got float32", step=2)
    model, result, _ = swarm.attacked(lambda step, out: [(m.to_header(refusal), None)] if step == 2 else [])
    assert result.token_ids == swarm.expected  # the step went again through the honest 0:2 peer
    assert ids["forger"] not in model.core.health.bans and ids["honest"] not in model.core.health.bans
