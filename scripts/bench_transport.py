#!/usr/bin/env python
"""Data plane speed: our direct TLS path vs. libp2p streams, hivemind's unary call and raw TCP.

One run measures all four between two processes on 127.0.0.1 (a server process and this one):
- latency: the round trip of one echoed float32 tensor of one token (1x1x576), median;
- round trip of a 128-token tensor (1x128x576, 295 KB) and the MB/s it implies;
- stream: 128-token frames sent back to back one way, MB/s.
"raw TCP" is a plain uvloop socket with the same framing and no encryption: the floor.
Usage: python scripts/bench_transport.py [--rounds 200] [--stream-frames 200]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import torch
import uvloop
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from p2pfusion.net import probe
from p2pfusion.net.framing import read_frame, write_frame
from p2pfusion.net.transport import STREAM_LIMIT, Transport

HIDDEN = 576
UNARY = "bench.unary"


async def serve() -> None:
    transport = await Transport.start([], "127.0.0.1", 0, None, client_mode=False)
    await transport.listen("127.0.0.1", 0)
    await probe.serve_probes(transport)

    async def unary(request: runtime_pb2.ExpertRequest, _context) -> runtime_pb2.ExpertResponse:
        tensor = deserialize_torch_tensor(request.tensors[0])
        return runtime_pb2.ExpertResponse(tensors=[serialize_torch_tensor(tensor)])

    await transport.p2p.add_protobuf_handler(UNARY, unary, runtime_pb2.ExpertRequest)
    tcp = await asyncio.start_server(probe.echo, "127.0.0.1", 0, limit=STREAM_LIMIT)
    info = dict(
        peer_id=transport.peer_id, data_addrs=transport.data_addrs,
        maddrs=[str(m) for m in await transport.p2p.get_visible_maddrs()], tcp_port=tcp.sockets[0].getsockname()[1],
    )
    print(json.dumps(info), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    tcp.close()
    await transport.shutdown()


async def _stream_rates(reader, writer, rounds: int, frames: int) -> dict[str, float]:
    small = torch.randn(1, 1, HIDDEN)
    big = torch.randn(1, 128, HIDDEN)
    out = {}
    for name, tensor, n in (("token_ms", small, rounds), ("rt128_ms", big, max(rounds // 4, 10))):
        times = []
        for i in range(n + 5):
            t0 = time.perf_counter()
            await write_frame(writer, {"probe": 1}, tensor)
            await read_frame(reader)
            if i >= 5:  # warm-up
                times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    out["rt128_MBps"] = 2 * big.numel() * 4 / (out["rt128_ms"] / 1e3) / 1e6
    t0 = time.perf_counter()
    for _ in range(frames):
        await write_frame(writer, {"echo": False}, big)
    await write_frame(writer, {"probe": 1})
    await read_frame(reader)
    out["stream_MBps"] = frames * big.numel() * 4 / (time.perf_counter() - t0) / 1e6
    writer.close()
    return out


async def _unary_rates(transport: Transport, peer_id: str, rounds: int) -> dict[str, float]:
    target = PeerID.from_base58(peer_id)
    out = {}
    for name, shape, n in (("token_ms", (1, 1, HIDDEN), rounds), ("rt128_ms", (1, 128, HIDDEN), max(rounds // 4, 10))):
        request = runtime_pb2.ExpertRequest(tensors=[serialize_torch_tensor(torch.randn(*shape))])
        times = []
        for i in range(n + 5):
            t0 = time.perf_counter()
            reply = await transport.p2p.call_protobuf_handler(target, UNARY, request, runtime_pb2.ExpertResponse)
            deserialize_torch_tensor(reply.tensors[0])
            if i >= 5:
                times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    out["rt128_MBps"] = 2 * 128 * HIDDEN * 4 / (out["rt128_ms"] / 1e3) / 1e6
    return out


async def measure(info: dict, rounds: int, frames: int) -> dict[str, dict[str, float]]:
    client = await Transport.start(info["maddrs"], "127.0.0.1", 0, None, client_mode=True)
    try:
        results = {}
        results["direct TLS (ours)"] = await _stream_rates(
            *await client.open(info["peer_id"], info["data_addrs"], probe.PROTOCOL), rounds, frames
        )
        results["libp2p stream (our fallback)"] = await _stream_rates(
            *await client.open(info["peer_id"], [], probe.PROTOCOL), rounds, frames // 4
        )
        results["hivemind unary call"] = await _unary_rates(client, info["peer_id"], rounds)
        tcp = await asyncio.open_connection("127.0.0.1", info["tcp_port"], limit=STREAM_LIMIT)
        results["raw TCP, no TLS (floor)"] = await _stream_rates(*tcp, rounds, frames)
        return results
    finally:
        await client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--stream-frames", type=int, default=200)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        uvloop.run(serve())
        return
    print(machine_header(), flush=True)
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(server.stdout.readline())
        results = uvloop.run(measure(info, args.rounds, args.stream_frames))
    finally:
        server.stdin.close()
        server.wait(30)
    ours = results["direct TLS (ours)"]
    print(f"{'path':30} {'1-token RTT':>12} {'128-token RTT':>14} {'RTT MB/s':>9} {'stream MB/s':>12}")
    for name, r in results.items():
        stream = f"{r['stream_MBps']:12.0f}" if "stream_MBps" in r else f"{'-':>12}"
        print(f"{name:30} {r['token_ms']:9.3f} ms {r['rt128_ms']:11.3f} ms {r['rt128_MBps']:9.0f} {stream}")
    print("ratios, ours vs. each (latency: theirs/ours, higher is better; stream: ours/theirs):")
    for name, r in results.items():
        if r is ours:
            continue
        line = f"  vs {name:28} 1-token {r['token_ms'] / ours['token_ms']:6.2f}x  128-token {r['rt128_ms'] / ours['rt128_ms']:6.2f}x"
        if "stream_MBps" in r:
            line += f"  stream {ours['stream_MBps'] / r['stream_MBps']:6.2f}x"
        print(line)


if __name__ == "__main__":
    main()
