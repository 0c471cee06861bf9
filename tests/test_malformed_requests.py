"""A real peer answers bad requests with an error to that caller and keeps serving everyone else."""

import asyncio
import struct
import time

import torch
import uvloop
from hivemind.p2p import PeerID

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import PeerRefused
from p2pfusion.net import messages as m
from p2pfusion.net.framing import read_frame, write_frame
from tests.conftest import reference_model
from tests.frames import raw_frame
from tests.swarm import running_peers

IDS = [3, 17, 42, 99]


async def _raw_stream(client, peer, direct: bool):
    """A stream to the peer over the direct TLS path, or over libp2p."""
    if direct:
        reader, writer = await client.transport.open(peer.swarm.peer_id, peer.swarm.transport.data_addrs, m.PROTOCOL)
        assert writer.get_extra_info("ssl_object") is not None
        return reader, writer
    _, reader, writer = await client.p2p.call_binary_stream_handler(PeerID.from_base58(peer.swarm.peer_id), m.PROTOCOL)
    return reader, writer


async def _error_of(reader) -> str:
    header, _ = await read_frame(reader)
    assert header["kind"] == "error", header
    return header["message"]


async def _scenario(source):
    errors = {}
    async with running_peers(source, [(0, 4)]) as ([peer], maddrs):
        client = await join_swarm(maddrs, client_mode=True)
        model = RemoteCausalLM.build(source, client)
        good = await model.open_session(32)  # a well-behaved session that lives through all of this
        first = await good.step(model.embed(IDS[:2]))

        reader, writer = await _raw_stream(client, peer, direct=False)
        writer.write(b"\x00\x00\x00\x05" + b"\x00" * 8 + b"garbage")
        await writer.drain()
        errors["garbage"] = await _error_of(reader)

        reader, writer = await _raw_stream(client, peer, direct=True)
        writer.write(struct.pack("!IQ", 1 << 30, 0))
        await writer.drain()
        errors["huge"] = await _error_of(reader)

        reader, writer = await _raw_stream(client, peer, direct=True)
        await write_frame(writer, m.to_header(m.Step(step=1)), torch.zeros(1, 1, 64))
        errors["unknown_session"] = await _error_of(reader)

        bad = await model.open_session(8)
        for name, tensor in {
            "dtype": torch.zeros(1, 1, 64, dtype=torch.int64),
            "shape": torch.zeros(1, 1, 63),
            "rank": torch.zeros(64),
            "nan": torch.full((1, 1, 64), float("nan")),
            "too_long": torch.zeros(1, 9, 64),
        }.items():
            await write_frame(bad.session._head, m.to_header(m.Step(step=99)), tensor)
            reply, _ = await bad.session._inbox.get()
            errors[name] = reply.message
        # a frame whose int8 tensor claims more exceptions than it carries
        spec = {"codec": "int8", "dtype": "float32", "shape": [1, 1, 64], "parts": [64, 4, 16, 4]}
        bad.session._head.write(raw_frame({**m.to_header(m.Step(step=98)), "tensor": spec}, bytes(88)))
        reply, _ = await bad.session._inbox.get()
        errors["codec"] = (reply.step, reply.message)
        # the same session still works after its bad steps
        recovered = await bad.step(model.embed(IDS))
        await bad.close()

        second = await good.step(model.embed(IDS[2:]))
        await good.close()
        after = await model.open_session(8)
        fresh = await after.step(model.embed(IDS))
        await after.close()
        await client.shutdown()
    return errors, torch.cat([first, second], 1), recovered, fresh


def test_peer_survives_malformed_requests(tiny_models):
    source = tiny_models["llama"]
    errors, good, recovered, fresh = uvloop.run(_scenario(source))
    assert "undecodable" in errors["garbage"] or "frame" in errors["garbage"]
    assert "too large" in errors["huge"]
    assert "unknown session" in errors["unknown_session"]
    assert "must be float32, bfloat16 or float16, got torch.int64" in errors["dtype"]
    assert "shape" in errors["shape"] and "shape" in errors["rank"]
    assert errors["nan"].endswith("contain NaN or infinity (64 of 64 values of step 99, from the client)")
    assert "it was opened for" in errors["too_long"]
    assert errors["codec"][0] == 98 and "exception" in errors["codec"][1]
    ref = reference_model(source)
    with torch.no_grad():
        expected = ref(torch.tensor([IDS]), output_hidden_states=True).hidden_states[-1]
    head_norm = RemoteCausalLM.build(source).head.model.norm
    for out in (good, recovered, fresh):
        torch.testing.assert_close(head_norm(out), expected, atol=1e-5, rtol=0)


async def _bombs(source):
    """A session sends bad tensors back to back, each after the answer to the one before; returns
    how long each answer took, and whether another session's step got through while the peer
    paused before reading the bad session's next frame."""
    async with running_peers(source, [(0, 4)]) as (_, maddrs):
        client = await join_swarm(maddrs, client_mode=True)
        model = RemoteCausalLM.build(source, client)
        good, bad = await model.open_session(8), await model.open_session(8)
        spec = {"codec": "int8", "dtype": "float32", "shape": [1, 1, 64], "parts": [64, 4, 16, 4]}
        bomb = raw_frame({**m.to_header(m.Step(step=1)), "tensor": spec}, bytes(88))
        waited = []
        for _ in range(8):
            t0 = time.perf_counter()
            bad.session._head.write(bomb)
            reply, _ = await bad.session._inbox.get()
            waited.append(time.perf_counter() - t0)
            assert "exception" in reply.message
        bad.session._head.write(bomb)  # read only after the pause the eighth earned
        answer = asyncio.ensure_future(bad.session._inbox.get())
        step = asyncio.ensure_future(good.step(model.embed(IDS[:1])))
        done, _ = await asyncio.wait({answer, step}, return_when=asyncio.FIRST_COMPLETED)
        served_meanwhile = step in done and answer not in done
        await asyncio.gather(answer, step)
        await client.shutdown()
    return waited, served_meanwhile


def test_a_source_that_keeps_sending_bad_tensors_is_read_ever_more_slowly(tiny_models):
    waited, served_meanwhile = uvloop.run(_bombs(tiny_models["llama"]))
    # the pauses after the 4th to 7th bad tensors: 0.05, 0.1, 0.2 and 0.4 s (a little less as counts decay)
    assert sum(waited[4:]) > 0.6, waited
    assert served_meanwhile


async def _a_hop_that_computes_nan(source):
    """The first of two hops returns NaN for the second step; the client's error, from the hop after it."""
    async with running_peers(source, [(0, 2), (2, 4)]) as (peers, maddrs):
        compute = peers[0].server.compute
        forward, steps = compute.forward, []

        async def broken(session, inputs):
            out, seconds = await forward(session, inputs)
            steps.append(out)
            return (torch.full_like(out, float("nan")) if len(steps) == 2 else out), seconds

        compute.forward = broken
        client = await join_swarm(maddrs, client_mode=True)
        try:
            session = await RemoteCausalLM.build(source, client, verify=0.0).open_session(8)
            await session.session.step(torch.zeros(1, 3, 64))
            try:
                await session.session.step(torch.zeros(1, 1, 64))
            except PeerRefused as exc:
                return str(exc), peers[0].swarm.peer_id
            finally:
                await session.close()
        finally:
            await client.shutdown()
    return None, peers[0].swarm.peer_id


def test_nan_from_a_hop_is_refused_by_the_next_naming_the_hop_that_sent_it(tiny_models):
    error, first = uvloop.run(_a_hop_that_computes_nan(tiny_models["llama"]))
    assert error == f"hidden states contain NaN or infinity (64 of 64 values of step 2, from peer {first})"
