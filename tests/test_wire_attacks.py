"""Attacks on the wire and the transport, against a real peer on loopback: a hello that claims a
huge body, a top-k frame that would decode to gigabytes, a flood of connections from one source,
and a record whose data addresses are tarpits. Each is refused at once, the peer's memory stays
within its budget, and a legitimate client is still served exactly."""

import asyncio
import time

import pytest
import torch

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.net import probe
from p2pfusion.net.framing import PREFIX, encode, read_frame, write_frame
from p2pfusion.net.identity import client_context
from p2pfusion.net.clients import MAX_PER_SOURCE, ConnectionCaps, connection_budget, source_of, source_of_maddr
from p2pfusion.net.transport import DIRECT_TIMEOUT, HELLO_TIMEOUT, MAX_DIALED
from tests.conftest import reference_model
from tests.frames import raw_frame
from tests.swarm import peers_in_background

IDS = [3, 17, 42, 99, 5]
NEW_TOKENS = 6
MIB = 1 << 20
ATTACKER = "127.0.0.2"  # loopback answers from any 127.x address: a source other than the client's


@pytest.fixture(scope="module")
def swarm(tiny_models):
    source = tiny_models["llama"]
    with torch.no_grad():
        out = reference_model(source).generate(torch.tensor([IDS]), max_new_tokens=NEW_TOKENS, do_sample=False)
    with peers_in_background(source, [(0, 4)]) as ([peer], maddrs, loop):
        client = loop.run(join_swarm(maddrs, client_mode=True))
        try:
            yield source, peer, client, loop, out[0, len(IDS):].tolist()
        finally:
            loop.run(client.shutdown())


async def _generate(source, client) -> list[int]:
    result = await RemoteCausalLM.build(source, client, compression="none").generate(
        IDS, NEW_TOKENS, stop_at_eos=False, decode=False
    )
    return list(result.token_ids)


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith(field + ":"))


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS


async def _connect(peer, source_ip: str = ATTACKER, tls: bool = True):
    host, port = peer.swarm.transport.data_addrs[0].rsplit(":", 1)
    return await asyncio.open_connection(
        host, int(port), ssl=client_context() if tls else None, local_addr=(source_ip, 0)
    )


async def _closed_after(reader) -> float:
    """Seconds until the peer closes the stream (reading whatever it says first)."""
    t0 = time.monotonic()
    try:
        while await asyncio.wait_for(reader.read(1 << 16), 10):
            pass
    except ConnectionError:
        pass
    return time.monotonic() - t0


async def _hellos(peer):
    reader, writer = await _connect(peer)
    writer.write(PREFIX.pack(20, 256 * MIB) + bytes(20))  # then it would stream 256 MiB
    await writer.drain()
    huge_body = await _closed_after(reader)
    reader, writer = await _connect(peer)
    writer.write(raw_frame({"protocol": "x" * 4096}, b""))
    huge_header = await _closed_after(reader)
    silent = [await _connect(peer, tls=False), await _connect(peer)]  # no TLS; TLS, then no hello
    return huge_body, huge_header, *await asyncio.gather(*[_closed_after(reader) for reader, _ in silent])


def test_hello_within_its_limits_and_time(swarm):
    _, peer, _, loop, _ = swarm
    huge_body, huge_header, silent_tcp, silent_tls = loop.run(_hellos(peer))
    assert huge_body < 1.0 and huge_header < 1.0, (huge_body, huge_header)  # refused on the prefix, unread
    assert HELLO_TIMEOUT - 0.5 < silent_tcp < HELLO_TIMEOUT + 2, silent_tcp
    assert HELLO_TIMEOUT - 0.5 < silent_tls < HELLO_TIMEOUT + 2, silent_tls


async def _probe_bomb(peer):
    """A top-k frame of 2 MiB declaring 2**29 float32 values (2 GiB), twice, on the echo protocol."""
    spec = {"codec": "topk", "dtype": "float32", "shape": [1 << 29], "k": 1 << 18, "parts": [MIB, MIB]}
    closed = []
    for _ in range(2):
        reader, writer = await _connect(peer)
        writer.writelines(encode({"protocol": probe.PROTOCOL}))
        writer.write(raw_frame({"probe": 1, "tensor": spec}, bytes(2 * MIB)))
        await writer.drain()
        closed.append(await _closed_after(reader))
    return closed


def test_decoding_amplification_is_refused_before_allocation(swarm):
    source, peer, client, loop, expected = swarm
    before = _status("VmRSS")
    _reset_peak_rss()
    closed = loop.run(_probe_bomb(peer))
    peak = _status("VmHWM") - before
    assert all(c < 2.0 for c in closed), closed
    assert peak < 64 * MIB, f"peak RSS grew {peak / MIB:.0f} MiB"
    assert loop.run(probe.reachable(client.transport, peer.swarm.peer_id, peer.swarm.transport.data_addrs))
    assert loop.run(_generate(source, client)) == expected


async def _flood(peer, source, client, extra: int):
    held = []
    for _ in range(MAX_PER_SOURCE):  # a full share: TLS, a hello, then silence
        reader, writer = await _connect(peer)
        writer.writelines(encode({"protocol": probe.PROTOCOL}))
        await write_frame(writer, {"probe": 1})
        await read_frame(reader)  # admitted and served
        held.append((reader, writer))
    excess = [await _connect(peer, tls=False) for _ in range(extra)]  # writers kept: a dropped one closes
    refused = await asyncio.gather(*[_closed_after(reader) for reader, _ in excess])
    tokens = await _generate(source, client)  # the client's own source still has its share
    for _, writer in held:
        writer.close()
    await asyncio.sleep(0.2)
    reader, writer = await _connect(peer)  # the attacker's share is free again
    writer.writelines(encode({"protocol": probe.PROTOCOL}))
    await write_frame(writer, {"probe": 1})
    readmitted = (await asyncio.wait_for(read_frame(reader), 5))[0] == {"probe": 1}
    writer.close()
    return refused, tokens, readmitted


def test_connections_over_the_per_source_cap_are_closed_at_once(swarm):
    source, peer, client, loop, expected = swarm
    refused, tokens, readmitted = loop.run(_flood(peer, source, client, extra=3 * MAX_PER_SOURCE))
    assert max(refused) < 1.0, max(refused)  # closed on accept, not after the hello's timeout
    assert tokens == expected
    assert readmitted


async def _tarpit_dials(peer, maddrs):
    dialed = 0

    async def tarpit(reader, writer):
        nonlocal dialed
        dialed += 1
        await reader.read()  # accepts, never answers

    pit = await asyncio.start_server(tarpit, "127.0.0.1", 0)
    pit_addr = f"127.0.0.1:{pit.sockets[0].getsockname()[1]}"
    client = await join_swarm(maddrs, client_mode=True)  # its own memory of failed dials
    try:
        t0 = time.monotonic()
        _, writer = await client.transport.open(
            peer.swarm.peer_id, [pit_addr, pit_addr, *peer.swarm.transport.data_addrs], probe.PROTOCOL
        )
        mixed = (time.monotonic() - t0, writer.get_extra_info("ssl_object") is not None)
        writer.close()
        dialed = 0
        t0 = time.monotonic()
        reader, writer = await client.transport.open(peer.swarm.peer_id, [pit_addr] * 8, probe.PROTOCOL)
        await write_frame(writer, {"probe": 1})
        echoed = (await read_frame(reader))[0] == {"probe": 1}
        tarpits = (time.monotonic() - t0, dialed, echoed)
        writer.close()
    finally:
        pit.close()
        await client.shutdown()
    return mixed, tarpits


def test_tarpit_addresses_cost_one_dial_timeout(swarm):
    _, peer, _, loop, _ = swarm
    maddrs = loop.run(peer.swarm.maddrs())
    (mixed_seconds, mixed_direct), (seconds, dialed, echoed) = loop.run(_tarpit_dials(peer, maddrs))
    assert mixed_direct and mixed_seconds < 1.0, mixed_seconds  # dialed at once: the real address wins
    assert dialed == MAX_DIALED
    assert DIRECT_TIMEOUT - 0.2 < seconds < DIRECT_TIMEOUT + 3, seconds  # then libp2p, not 8 x 3 s
    assert echoed


def test_libp2p_streams_count_against_the_address_they_came_from():
    assert source_of_maddr("/ip4/203.0.113.5/tcp/4001") == "ip:203.0.113.5"
    assert source_of_maddr("/ip6/2001:db8::1/tcp/1") == source_of_maddr("/ip6/2001:db8::ff/udp/2/quic") == "ip:2001:db8::/64"
    assert source_of_maddr("/ip4/198.51.100.1/tcp/1/p2p/QmRelay/p2p-circuit") == "circuit:QmRelay"
    assert source_of_maddr("/dns4/example.org/tcp/1") == "ip:unknown"
    caps = ConnectionCaps(per_source=3, total=10, per_relay=1)
    assert caps.admit("circuit:QmRelay") and not caps.admit("circuit:QmRelay")  # a relay's clients share a tight bucket


def test_caps_per_source_and_in_total():
    caps = ConnectionCaps(per_source=2, total=3)
    assert caps.admit("ip:a") and caps.admit("ip:a") and not caps.admit("ip:a")
    assert caps.admit("peer:b") and not caps.admit("ip:c")  # the node is full
    caps.release("ip:a")
    assert caps.admit("ip:c") and caps.open == {"ip:a": 1, "peer:b": 1, "ip:c": 1}
    # a listed peer's streams leave its address's share, and have no cap of their own but the total
    caps = ConnectionCaps(per_source=1, total=4)
    for _ in range(3):
        assert caps.admit("ip:a") and not caps.admit("ip:a")
        caps.transfer("ip:a", "relay:Qm")
    assert caps.admit("ip:a") and not caps.admit("ip:c")
    assert caps.open == {"relay:Qm": 3, "ip:a": 1} and caps.open_total == 4
    caps.release("relay:Qm")
    assert caps.open == {"relay:Qm": 2, "ip:a": 1}
    assert connection_budget(20_000) == 4096 and connection_budget(1024) == 384 and connection_budget(10) == 1


def test_sources_group_what_one_host_controls():
    assert source_of(("203.0.113.9", 5000)) == "ip:203.0.113.9"
    assert source_of(("::ffff:203.0.113.9", 5000, 0, 0)) == "ip:203.0.113.9"
    assert source_of(("2001:db8:1:2:aaaa::1", 5000, 0, 0)) == source_of(("2001:db8:1:2:bbbb::7", 1, 0, 0))
    assert source_of(("2001:db8:1:2::1", 5000, 0, 0)) == "ip:2001:db8:1:2::/64"
    assert source_of(None) == "ip:unknown"
