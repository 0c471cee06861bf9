"""A peer's Prometheus metrics (`run-peer --metrics-port`), scraped over HTTP from real peers on
127.0.0.1 and parsed as Prometheus does: the figures match what the clients sent, what the peers
held while a session was open, and what they refused; each peer counts only its own."""

import asyncio
import socket
import urllib.request

import pytest
import torch
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import ConfigError
from p2pfusion.net import messages as m
from p2pfusion.net.compression import Codec
from p2pfusion.net.framing import read_frame, write_frame
from p2pfusion.peer.runtime import Peer, PeerOptions
from tests.swarm import running_peers
from tests.test_cli_errors import assert_one_line_error, run

RANGES = [(0, 2), (2, 4)]
PROMPTS = [[3, 17, 42, 99, 5, 250, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [40, 41], [100, 101, 102, 103]]
NEW_TOKENS = 5
PER_CLIENT = 3  # sessions one client may hold open on a peer


async def _scrape(peer) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels) -> value, as Prometheus would read the peer's /metrics."""
    url = f"http://127.0.0.1:{peer.exporter.port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def _value(samples, name: str, **labels) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(value for (n, got), value in samples.items() if n == name and wanted <= got)


async def _stream(client, peer):
    return await client.transport.open(peer.swarm.peer_id, peer.swarm.transport.data_addrs, m.PROTOCOL)


async def _open_alone(client, peer, session_id: str, subscribe: bool = True):
    """A session routed through `peer` alone, opened by hand: (its streams, the Open's reply)."""
    streams = []
    if subscribe:
        sink = await _stream(client, peer)
        await write_frame(sink[1], m.to_header(m.Subscribe(session_id)))
        assert (await read_frame(sink[0]))[0]["kind"] == "ack"
        streams.append(sink)
    reader, writer = await _stream(client, peer)
    hop = m.Hop(peer.swarm.peer_id, peer.swarm.transport.data_addrs, peer.record.start, peer.record.end)
    await write_frame(writer, m.to_header(m.Open(session_id, 32, [hop], compression=Codec.NONE)))
    streams.append((reader, writer))
    return streams, (await read_frame(reader))[0]


async def _until_closed(peers) -> None:
    """Sessions a client closed end on the peers a moment later."""
    for _ in range(100):
        if not any(peer.server.sessions for peer in peers):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("sessions still open")


async def _served(source):
    async with running_peers(source, RANGES, metrics_port=0, client_sessions=PER_CLIENT) as (peers, maddrs):
        client = await join_swarm(maddrs, client_mode=True)
        # one token a step, so the counts below follow from the tokens generated
        model = RemoteCausalLM.build(source, client, compression="none", verify=0.0, speculate="off")
        seen = {"idle": await _scrape(peers[0])}
        generated = [await model.generate(PROMPTS[0], NEW_TOKENS, stop_at_eos=False, decode=False)]
        generated += await asyncio.gather(*(
            model.generate(ids, NEW_TOKENS, stop_at_eos=False, decode=False) for ids in PROMPTS[1:PER_CLIENT + 1]
        ))
        await _until_closed(peers)
        session = await model.open_session(16)
        await session.step(model.embed(PROMPTS[0]))
        seen["open"] = [await _scrape(peer) for peer in peers]
        seen["reserved"] = [sum(s.reserved for s in peer.server.sessions.values()) for peer in peers]
        await session.close()
        ids = torch.tensor([PROMPTS[1]])
        await model.train_step(ids, ids)
        await _until_closed(peers)

        held = [await _open_alone(client, peers[0], f"held{i}") for i in range(PER_CLIENT)]
        _, seen["busy"] = await _open_alone(client, peers[0], "one-too-many", subscribe=False)
        reader, writer = await _stream(client, peers[0])
        await write_frame(writer, m.to_header(m.Open("no-route", 32, [], compression=Codec.NONE)))
        seen["bad"] = (await read_frame(reader))[0]
        for streams, _ in held:
            for _, w in streams:
                w.close()
        await _until_closed(peers)
        seen["end"] = [await _scrape(peer) for peer in peers]
        seen["peers"] = [
            (peer.model, f"{peer.record.start}:{peer.record.end}", peer.server.tokens_done, peer.server.sessions_opened,
             peer.server.compute.stats) for peer in peers
        ]
        await client.shutdown()
    return [g.token_ids for g in generated], seen


def test_metrics_count_what_the_peers_served_held_and_refused(tiny_models):
    tokens, seen = uvloop.run(_served(tiny_models["llama"]))
    assert all(len(t) == NEW_TOKENS for t in tokens)
    idle = seen["idle"]
    assert _value(idle, "p2pfusion_sessions_open") == 0 and _value(idle, "p2pfusion_kv_cache_budget_bytes") > 0
    assert _value(idle, "p2pfusion_steps_total") == 0

    for i, (model, layers, tokens_done, opened, stats) in enumerate(seen["peers"]):
        open_, end = seen["open"][i], seen["end"][i]
        stage = dict(model=model, layers=layers)
        assert _value(end, "p2pfusion_peer_info", **stage) == 1
        # while a session was open: it, and the KV cache it reserved, within the budget
        assert _value(open_, "p2pfusion_sessions_open", **stage) == 1
        reserved, budget = _value(open_, "p2pfusion_kv_cache_reserved_bytes"), _value(open_, "p2pfusion_kv_cache_budget_bytes")
        assert 0 < reserved == seen["reserved"][i] <= budget
        assert _value(end, "p2pfusion_sessions_open") == 0 and _value(end, "p2pfusion_kv_cache_reserved_bytes") == 0
        assert _value(end, "p2pfusion_queue_depth") == 0

        # every hop ran each generation's prompt as one step, then one step per token but the last
        inference = dict(stage, kind="inference")
        generations = 1 + PER_CLIENT
        steps = generations * NEW_TOKENS + 1  # and the open session's one step
        positions = sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS[:generations]) + len(PROMPTS[0])
        assert _value(end, "p2pfusion_steps_total", **inference) == steps
        assert _value(end, "p2pfusion_tokens_total", **inference) == positions
        training = len(PROMPTS[1])
        for kind in ("training_forward", "training_backward"):
            assert _value(end, "p2pfusion_steps_total", kind=kind) == 1
            assert _value(end, "p2pfusion_tokens_total", kind=kind) == training
        assert _value(end, "p2pfusion_tokens_total") == tokens_done + training  # backward passes are not in tokens_done
        for histogram in ("p2pfusion_step_seconds", "p2pfusion_step_compute_seconds"):
            assert _value(end, f"{histogram}_count", **inference) == steps
            assert 0 < _value(end, f"{histogram}_sum", **inference) < 60
            assert _value(end, f"{histogram}_bucket", le="+Inf", **inference) == steps
        # the compute thread's forwards (the long prompt's, the training passes', the concurrent
        # sessions' decode steps): one per batch, one per job it ran alone
        forwards = stats.steps - stats.batched_steps + stats.batches
        assert forwards >= 3
        assert _value(end, "p2pfusion_forward_rows_count", **stage) == forwards
        assert _value(end, "p2pfusion_forward_seconds_count", **stage) == forwards
        assert 0 < _value(end, "p2pfusion_forward_rows_sum") <= positions + 2 * training
        # the generations', the session held open, the training one, and on the first peer those opened by hand
        assert _value(end, "p2pfusion_sessions_opened_total", **stage) == opened == generations + 2 + PER_CLIENT * (i == 0)

    assert seen["busy"]["code"] == m.ErrorCode.BUSY and "already has 3 sessions" in seen["busy"]["message"]
    assert "empty route" in seen["bad"]["message"]
    first, second = seen["end"]
    assert _value(first, "p2pfusion_sessions_refused_busy_total") == 1
    assert _value(first, "p2pfusion_errors_total", kind="busy") == 1
    assert _value(first, "p2pfusion_errors_total", kind="request") == 1
    assert _value(second, "p2pfusion_errors_total") == 0  # each peer its own registry
    assert _value(second, "p2pfusion_sessions_refused_busy_total") == 0


async def _taken(source, port: int) -> str:
    swarm = await join_swarm([])
    try:
        with pytest.raises(ConfigError) as refused:
            await Peer(PeerOptions(source, [], (0, 4), throughput="100", metrics_port=port), swarm).start()
    finally:
        await swarm.shutdown()
    return str(refused.value)


def test_metrics_port_taken_or_malformed(tiny_models):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        message = uvloop.run(_taken(tiny_models["llama"], port))
    assert message == f"cannot serve metrics on 127.0.0.1:{port}: address already in use"
    assert_one_line_error(run("run-peer", "--new-swarm", "--metrics-port", "http"), "--metrics-port", "whole number")
    assert_one_line_error(run("run-peer", "--new-swarm", "--metrics-host", "localhost"), "--metrics-host", "not an IP")
