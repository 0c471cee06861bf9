"""Attacks on a stage server by hostile clients and peers, on real peers on loopback: each is
refused with one clear error to its sender, and a legitimate client is still served exactly."""

import asyncio
import gc
import statistics
import time

import torch
import uvloop
from hivemind.p2p import PeerID

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.net import messages as m
from p2pfusion.net.compression import Codec
from p2pfusion.net.framing import read_frame, write_frame
from p2pfusion.net.clients import Source
from tests.conftest import reference_model
from tests.frames import raw_frame
from tests.swarm import running_peers

IDS = [3, 17, 42, 99, 5, 250, 7]
NEW_TOKENS = 8
MIB = 1 << 20
ELSEWHERE = "127.0.0.2"  # a client node listening here dials from here: another host's address, on loopback


def _reference(source, tokens=NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = reference_model(source).generate(torch.tensor([IDS]), max_new_tokens=tokens, do_sample=False)
    return out[0, len(IDS):].tolist()


async def _generate(client, source, tokens=NEW_TOKENS) -> list[int]:
    result = await RemoteCausalLM.build(source, client).generate(IDS, tokens, stop_at_eos=False, decode=False)
    return list(result.token_ids)


def _rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))


async def _stream(client, peer, direct: bool = True):
    """A raw stream to the peer: direct TLS (source ip:127.0.0.1) or libp2p (source peer:<client>)."""
    if direct:
        return await client.transport.open(peer.swarm.peer_id, peer.swarm.transport.data_addrs, m.PROTOCOL)
    _, reader, writer = await client.p2p.call_binary_stream_handler(PeerID.from_base58(peer.swarm.peer_id), m.PROTOCOL)
    return reader, writer


def _hop(peer) -> m.Hop:
    return m.Hop(peer.swarm.peer_id, peer.swarm.transport.data_addrs, peer.record.start, peer.record.end)


async def _open_raw(client, peers, session_id: str, length: int = 64, direct: bool = True, hops=None):
    """Subscribe at the last hop and open the route at the first: (head reader, head writer, sink reader,
    sink writer, the Open's reply)."""
    sink_reader, sink_writer = await _stream(client, peers[-1], direct)
    await write_frame(sink_writer, m.to_header(m.Subscribe(session_id)))
    subscribed, _ = await read_frame(sink_reader)
    assert subscribed["kind"] == "ack", subscribed
    reader, writer = await _stream(client, peers[0], direct)
    route = hops or [_hop(p) for p in peers]
    await write_frame(writer, m.to_header(m.Open(session_id, length, route, compression=Codec.NONE)))
    reply, _ = await read_frame(reader)
    return reader, writer, sink_reader, sink_writer, reply


def _tensors_of_shape(shape) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == shape)


async def _bad_tensors(source):
    async with running_peers(source, [(0, 4)]) as ([peer], maddrs):
        peer.server.compute.prefill_chunk = 2  # every prompt here runs in chunks, between other steps
        client = await join_swarm(maddrs, client_mode=True)
        model = RemoteCausalLM.build(source, client)
        good = await model.open_session(32)
        first = await good.step(model.embed(IDS[:5]))
        rss = _rss()
        errors = []
        for _ in range(2):  # a 2 MiB top-k frame declaring 2**29 values: 2 GiB once decoded
            reader, writer, *_, reply = await _open_raw(client, [peer], f"amp{_}")
            assert reply["kind"] == "ack"
            spec = {"codec": "topk", "dtype": "float32", "shape": [1 << 29], "k": 1 << 18, "parts": [MIB, MIB]}
            writer.write(raw_frame({**m.to_header(m.Step(step=1)), "tensor": spec}, bytes(2 * MIB)))
            await writer.drain()
            errors.append((await read_frame(reader))[0]["message"])
            # the stream is still in step: a refused step (wrong width) is answered, and its tensor not kept
            await write_frame(writer, m.to_header(m.Step(step=2)), torch.zeros(1, 700, 63))
            errors.append((await read_frame(reader))[0]["message"])
        grown = _rss() - rss
        retained = _tensors_of_shape((1, 700, 63))
        # a second result stream for a running session is refused; the session keeps its own
        reader, writer = await _stream(client, peer)
        await write_frame(writer, m.to_header(m.Subscribe(good.session.session_id)))
        takeover = (await read_frame(reader))[0]
        second = await good.step(model.embed(IDS[5:]))
        await good.close()
        tokens = await _generate(client, source)
        await client.shutdown()
    hidden = model.head.model.norm(torch.cat([first, second], 1))
    return errors, grown, retained, takeover, hidden, tokens


def test_oversized_tensors_retained_tensors_stream_takeovers_and_chunked_prefills(tiny_models):
    source = tiny_models["llama"]
    errors, grown, retained, takeover, hidden, tokens = uvloop.run(_bad_tensors(source))
    assert all("too large" in e for e in errors[::2]), errors
    assert all("shape" in e for e in errors[1::2]), errors
    assert grown < 64 * MIB, f"RSS grew {grown / MIB:.0f} MiB"
    assert retained == 0
    assert takeover["kind"] == "error" and "already has a result stream" in takeover["message"]
    with torch.no_grad():  # prefills in chunks of two tokens compute what a whole forward does
        expected = reference_model(source)(torch.tensor([IDS]), output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=0)
    assert tokens == _reference(source)


async def _silences(source):
    async with running_peers(source, [(0, 4)], first_frame_timeout=1.0, idle_timeout=2.0) as ([peer], maddrs):
        client = await join_swarm(maddrs, client_mode=True)
        t0 = time.perf_counter()
        reader, _ = await _stream(client, peer)  # the hello, then nothing
        silent = (await read_frame(reader))[0]
        silent_after = time.perf_counter() - t0
        opened = [await _open_raw(client, [peer], f"idle{i}") for i in range(20)]
        assert all(o[-1]["kind"] == "ack" for o in opened) and len(peer.server.sessions) == 20
        expired = [(await read_frame(o[0]))[0] for o in opened]
        left = len(peer.server.sessions)
        tokens = await _generate(client, source)  # steps a few ms apart: never idle that long
        await client.shutdown()
    return silent, silent_after, expired, left, tokens


def test_silent_streams_and_idle_sessions_expire(tiny_models):
    source = tiny_models["llama"]
    silent, silent_after, expired, left, tokens = uvloop.run(_silences(source))
    assert "no request within 1 s" in silent["message"] and silent_after < 5
    assert all(e["kind"] == "error" and e["code"] == m.ErrorCode.EXPIRED and "open it again" in e["message"] for e in expired)
    assert left == 0
    assert tokens == _reference(source)


CACHE_BUFFER = (1, 2, 2048, 16)  # one layer's keys or values of a session past 1024 positions


async def _memory(source):
    # 1 KiB of KV per token here (4 layers, 2 KV heads of 16, float32): 2 MiB per 2048-token session
    async with running_peers(source, [(0, 4)], refresh=True, cache_memory=80 * MIB) as ([peer], maddrs):
        client = await join_swarm(maddrs, client_mode=True)
        attacker = await join_swarm(maddrs, host=ELSEWHERE, client_mode=True)
        await _generate(client, source)  # what a client's first generation loads is not the sessions' memory
        gc.collect()
        baseline = _rss()
        sessions = []
        while True:  # over libp2p from another address: a source of its own, as another machine would be
            opened = await _open_raw(attacker, [peer], f"fill{len(sessions)}", length=2048, direct=False)
            if opened[-1]["kind"] != "ack":
                busy = opened[-1]
                break
            sessions.append(opened)
        for i, (reader, writer, sink, *_) in enumerate(sessions):
            await write_frame(writer, m.to_header(m.Step(step=1)), torch.randn(1, 2000, 64))
            assert (await read_frame(sink))[0]["kind"] == "result"
        await write_frame(sessions[0][1], m.to_header(m.Step(step=2)), torch.randn(2, 1, 64))
        wide = (await read_frame(sessions[0][0]))[0]
        peak = _rss()
        held = _tensors_of_shape(CACHE_BUFFER)
        tokens = await _generate(client, source)  # another source: still served
        for reader, writer, sink, sink_writer, _ in sessions:
            await write_frame(writer, m.to_header(m.Close()))
            writer.close()
            sink_writer.close()
        while peer.server.sessions:
            await asyncio.sleep(0.05)
        left = _tensors_of_shape(CACHE_BUFFER)
        after = _rss()
        await attacker.shutdown()
        await client.shutdown()
    return len(sessions), busy, wide, (held, left), (baseline, peak, after), tokens


def test_sessions_reserve_memory_within_a_budget_and_free_it(tiny_models):
    source = tiny_models["llama"]
    count, busy, wide, (held, left), (baseline, peak, after), tokens = uvloop.run(_memory(source))
    assert count == 20  # half of 80 MiB, at 2 MiB a session
    assert busy["code"] == m.ErrorCode.BUSY and "one client may hold at most 40 MiB" in busy["message"], busy
    assert "opened for at most 1" in wide["message"]
    assert peak - baseline > 30 * MIB, (baseline, peak)  # 20 caches of 2000 tokens
    # every session's keys and values per layer, then none: what RSS gives back after the peer
    # trims its heap depends on glibc's fragments (all of it in one run, 2 MiB of 49 in another)
    assert (held, left) == (20 * 4 * 2, 0), f"RSS {baseline >> 20} -> {peak >> 20} -> {after >> 20} MiB"
    assert tokens == _reference(source)


async def _decode_latencies(model, tokens: int) -> list[float]:
    session = await model.open_session(len(IDS) + tokens + 1)
    await session.step(model.embed(IDS))
    latencies = []
    for token in range(tokens):
        t0 = time.perf_counter()
        await session.step(model.embed([token + 3]))
        latencies.append(time.perf_counter() - t0)
    await session.close()
    return latencies


async def _flood(attacker, peer, stop: asyncio.Event, name: str, prefills: list[float]):
    """Prefills of [4, 1440, 576] tokens, session after session, as fast as the peer takes them;
    `prefills` gets the time of each 1440-token one."""
    i = 0
    while not stop.is_set():
        i += 1
        reader, writer, sink, sink_writer, _ = await _open_raw(attacker, [peer], f"{name}.{i}", length=2048)
        for step, tokens in enumerate((4, 1440, 576)):
            t0 = time.perf_counter()
            await write_frame(writer, m.to_header(m.Step(step=step)), torch.randn(1, tokens, 64))
            await read_frame(sink)
            if tokens == 1440:
                prefills.append(time.perf_counter() - t0)
        await write_frame(writer, m.to_header(m.Close()))
        writer.close()
        sink_writer.close()


async def _prefill_flood(source):
    async with running_peers(source, [(0, 4)]) as ([peer], maddrs):
        client = await join_swarm(maddrs, client_mode=True)
        attacker = await join_swarm(maddrs, client_mode=True)
        model = RemoteCausalLM.build(source, client)
        quiet = await _decode_latencies(model, 24)
        stop, prefills = asyncio.Event(), []
        floods = [asyncio.create_task(_flood(attacker, peer, stop, f"flood{n}", prefills)) for n in range(3)]
        await asyncio.sleep(0.5)
        flooded = await _decode_latencies(model, 24)
        tokens = await _generate(client, source)
        stop.set()
        await asyncio.gather(*floods)
        await attacker.shutdown()
        await client.shutdown()
    return statistics.median(quiet), statistics.median(flooded), statistics.median(prefills), tokens


def test_a_prefill_flood_does_not_starve_decoding(tiny_models):
    source = tiny_models["llama"]
    quiet, flooded, prefill, tokens = uvloop.run(_prefill_flood(source))
    print(f"decode step: {quiet * 1e3:.1f} ms quiet, {flooded * 1e3:.1f} ms beside 1440-token prefills of {prefill * 1e3:.0f} ms")
    # run whole, each prefill would hold a decoding step for as long as itself, or three of them
    assert flooded < prefill / 2, (quiet, flooded, prefill)
    assert tokens == _reference(source)


async def _forgeries(source):
    async with running_peers(source, [(0, 2), (2, 4)]) as (peers, maddrs):
        first, last = peers
        forged = {
            "result": m.Result(step=1),
            "bare result": m.Result(step=1),
            "blame": m.Error("the first hop failed", failed_peer=first.swarm.peer_id),
            "leaving": m.Leaving(peer_id=first.swarm.peer_id),
            "honest": m.Leaving(peer_id=last.swarm.peer_id),
        }
        server = last.server
        honest_frame = server._on_frame

        async def forging(session, frame, writer):  # a patched last hop: a forgery upstream at each step
            message = forged[session.session_id]
            payload = torch.zeros(1, 1, 64) if session.session_id == "result" else None
            await write_frame(session.upstream, m.to_header(message), payload)
            return True

        server._on_frame = forging
        client = await join_swarm(maddrs, client_mode=True)
        seen = {}
        for name in forged:
            reader, writer, sink, *_, reply = await _open_raw(client, peers, name)
            assert reply["kind"] == "ack"
            await write_frame(writer, m.to_header(m.Step(step=1)), torch.randn(1, 2, 64))
            seen[name] = (await read_frame(reader))[0]
            writer.close()
        server._on_frame = honest_frame
        tokens = await _generate(client, source)
        await client.shutdown()
    return seen, last.swarm.peer_id, tokens


def test_a_relay_passes_no_result_and_no_forged_blame(tiny_models):
    source = tiny_models["llama"]
    seen, forger, tokens = uvloop.run(_forgeries(source))
    for name in ("result", "bare result", "blame", "leaving"):
        assert seen[name]["kind"] == "error" and seen[name]["failed_peer"] == forger, seen[name]
    assert "'result'" in seen["result"]["message"]
    assert seen["honest"] == m.to_header(m.Leaving(peer_id=forger))
    assert tokens == _reference(source)


async def _port_scan(source):
    attempts = []

    async def count(reader, writer):
        attempts.append(writer.get_extra_info("sockname"))
        writer.close()

    listeners = [await asyncio.start_server(count, "127.0.0.1", 0) for _ in range(7)]
    bait = [f"127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in listeners]
    async with running_peers(source, [(0, 2), (2, 4)]) as (peers, maddrs):
        first, last = peers
        client = await join_swarm(maddrs, client_mode=True)
        real = _hop(last)
        scanning = [_hop(first), m.Hop(real.peer_id, bait + real.data_addrs, 2, 4)]
        reply = (await _open_raw(client, peers, "scan", hops=scanning))[-1]
        stranger = "12D3KooWNoRecordAnywhereNoRecordAnywhereNoRec"
        unknown = [_hop(first), m.Hop(stranger, bait, 2, 4)]
        refused = (await _open_raw(client, peers, "stranger", hops=unknown))[-1]
        tokens = await _generate(client, source)
        await client.shutdown()
    for listener in listeners:
        listener.close()
    return reply, refused, stranger, attempts, tokens


def test_an_open_dials_only_addresses_the_next_hop_announced(tiny_models):
    source = tiny_models["llama"]
    reply, refused, stranger, attempts, tokens = uvloop.run(_port_scan(source))
    assert reply["kind"] == "ack"  # through the real address, which its record lists
    assert refused["failed_peer"] == stranger and "has no record" in refused["message"]
    assert attempts == []
    assert tokens == _reference(source)


async def _relayed_shares(source):
    # 512 B of KV per token per 2-layer stage: 1 MiB a 2048-token session, 10 of them a client's share
    async with running_peers(source, [(0, 2), (2, 4)], cache_memory=20 * MIB) as (peers, maddrs):
        first, last = peers
        client = await join_swarm(maddrs, client_mode=True)
        attacker = await join_swarm(maddrs, host=ELSEWHERE, client_mode=True)
        held = []
        while True:  # over libp2p from another address: a source of its own at the first hop
            opened = await _open_raw(attacker, peers, f"fill{len(held)}", length=2048, direct=False)
            if opened[-1]["kind"] != "ack":
                refused = opened[-1]
                break
            held.append(opened)
        at_last_hop = {(s.source, s.client) for s in last.server.sessions.values()}
        # the first hop relays everyone's sessions from one address: the client's are its own there
        tokens = await asyncio.wait_for(_generate(client, source), 60)
        model = RemoteCausalLM.build(source, client)
        session = await model.open_session(16)
        await session.step(model.embed(IDS))
        units = [{s.client for s in peer.server.sessions.values() if s.source != f"ip:{ELSEWHERE}"} for peer in peers]
        await session.close()
        # a claim about whom it relays, from someone the swarm does not list, counts for nothing
        reader, writer = await _stream(attacker, first, direct=False)
        claim = m.Open("claim", 64, [_hop(p) for p in peers], compression=Codec.NONE, origin="ip:203.0.113.7")
        await write_frame(writer, m.to_header(claim))
        claimed = (await read_frame(reader))[0]
        await attacker.shutdown()
        await client.shutdown()
    return len(held), refused, at_last_hop, (f"ip:{ELSEWHERE}", f"peer:{attacker.peer_id}"), tokens, units, claimed


def test_a_relayed_session_counts_against_its_client_not_the_relay(tiny_models):
    source = tiny_models["llama"]
    count, refused, at_last_hop, attacker, tokens, units, claimed = uvloop.run(_relayed_shares(source))
    assert count == 10 and refused["code"] == m.ErrorCode.BUSY and "one client may hold at most 10 MiB" in refused["message"]
    address, identity = attacker
    # its caps and its share of compute, as at the first hop
    assert at_last_hop == {(address, Source(address, identity).fairness)}, at_last_hop
    assert len(units[0]) == 1 and units[0] == units[1]  # the client is charged as one unit at every hop
    assert tokens == _reference(source)
    assert claimed["code"] == m.ErrorCode.BUSY, claimed  # still the attacker's own share, full


async def _sybils(source):
    """Five libp2p identities from one address, each opening as many sessions as it may."""
    async with running_peers(source, [(0, 4)], client_sessions=6, max_sessions=12) as ([peer], maddrs):
        sybils = [await join_swarm(maddrs, host=ELSEWHERE, client_mode=True) for _ in range(5)]
        held, refused = [], []
        for sybil in sybils:
            for i in range(4):
                opened = await _open_raw(sybil, [peer], f"{sybil.peer_id[-6:]}-{i}", direct=False)
                (held if opened[-1]["kind"] == "ack" else refused).append(opened)
        client = await join_swarm(maddrs, client_mode=True)
        tokens = await asyncio.wait_for(_generate(client, source), 60)
        sources = {s.source for s in peer.server.sessions.values()}
        for node in [*sybils, client]:
            await node.shutdown()
    return len(held), [opened[-1] for opened in refused], sources, tokens


def test_many_libp2p_identities_from_one_address_get_what_one_gets(tiny_models):
    """The Sybil hog: identities cost nothing, so a libp2p stream counts against the address it came
    from, as a direct connection does; a client from another address is still served."""
    source = tiny_models["llama"]
    held, refused, sources, tokens = uvloop.run(_sybils(source))
    assert held == 6 and len(refused) == 14, (held, sources)
    assert all(r["code"] == m.ErrorCode.BUSY and "this client already has 6 sessions" in r["message"] for r in refused)
    assert sources == {f"ip:{ELSEWHERE}"}
    assert tokens == _reference(source)
