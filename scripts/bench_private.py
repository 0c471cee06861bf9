#!/usr/bin/env python
"""What the swarm secret costs: the same measurements against an open node and a private one.

Two server processes on 127.0.0.1, one without a secret and one with (`join_swarm(..., secret=)`:
the DHT authorizer and the hello's proof), each a DHT node answering the echo probe; this process
joins each as a client (with the secret for the private one) and measures, alternating rounds
between the two so that the machine's load falls on both alike:
- open: a fresh direct TLS stream (handshake, hello, proof checked) and one echoed one-token
  tensor (1x1x576 float32), median;
- rtt: the one-token round trip on an open stream (after the hello, nothing differs);
- libp2p open: a fresh libp2p stream (the proof is a frame of its own there) and one round trip;
- DHT get: a read of an absent key, one request and answer to the node;
- and, in this process alone, the microseconds of one proof made and checked, and of a DHT
  request and answer signed and checked.
Usage: python scripts/bench_private.py [--rounds 200]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

import torch
import uvloop
from hivemind.proto import dht_pb2

from p2pfusion.dht.private import SecretAuthorizer
from p2pfusion.dht.swarm import SwarmNode, join_swarm
from p2pfusion.net import probe
from p2pfusion.net.framing import read_frame, write_frame
from p2pfusion.net.secret import SwarmSecret, create_secret_file, load_secret

HIDDEN = 576
ABSENT = "p2pfusion.model.bench-absent"


async def serve(secret_file: str | None) -> None:
    node = await join_swarm([], secret=load_secret(secret_file))
    await probe.serve_probes(node.transport)
    info = dict(peer_id=node.peer_id, data_addrs=node.transport.data_addrs, maddrs=await node.maddrs())
    print(json.dumps(info), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await node.shutdown()


async def _echo(reader, writer, tensor: torch.Tensor) -> None:
    await write_frame(writer, {"probe": 1}, tensor)
    await read_frame(reader)


def _timed(make: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[float]]:
    async def run() -> float:
        t0 = time.perf_counter()
        await make()
        return time.perf_counter() - t0

    return run


def _probes(client: SwarmNode, info: dict, stream) -> dict[str, Callable[[], Awaitable[float]]]:
    token = torch.randn(1, 1, HIDDEN)

    async def fresh(addrs: list[str]) -> None:
        reader, writer = await client.transport.open(info["peer_id"], addrs, probe.PROTOCOL)
        try:
            await _echo(reader, writer, token)
        finally:
            writer.close()

    return {
        "open + 1-token RTT, direct": _timed(lambda: fresh(info["data_addrs"])),
        "1-token RTT, open stream": _timed(lambda: _echo(*stream, token)),
        "open + 1-token RTT, libp2p": _timed(lambda: fresh([])),
        "DHT get (one request)": _timed(lambda: client.dht.get(ABSENT, latest=True)),
    }


async def measure(infos: dict[str, dict], secret_file: str, rounds: int) -> dict[str, dict[str, float]]:
    clients = {}
    for name, info in infos.items():
        secret = load_secret(secret_file if name == "private" else None)
        clients[name] = await join_swarm(info["maddrs"], client_mode=True, secret=secret)
    try:
        streams = {}
        for name, info in infos.items():
            streams[name] = await clients[name].transport.open(info["peer_id"], info["data_addrs"], probe.PROTOCOL)
        probes = {name: _probes(clients[name], infos[name], streams[name]) for name in infos}
        times: dict[str, dict[str, list[float]]] = {name: {what: [] for what in probes[name]} for name in infos}
        for i in range(rounds + 5):
            for what in probes["open"]:
                for name in (("open", "private") if i % 2 else ("private", "open")):
                    seconds = await probes[name][what]()
                    if i >= 5:  # warm-up
                        times[name][what].append(seconds)
        for _, writer in streams.values():
            writer.close()
        return {name: {what: statistics.median(t) * 1e3 for what, t in kinds.items()} for name, kinds in times.items()}
    finally:
        for client in clients.values():
            await client.shutdown()


async def micro(rounds: int = 20000) -> dict[str, float]:
    """Microseconds of one hello proof made and checked, and one DHT request and answer signed and checked."""
    secret = SwarmSecret(os.urandom(32))
    t0 = time.perf_counter()
    for _ in range(rounds):
        if secret.refusal(secret.proof("QmPeer", probe.PROTOCOL), "QmPeer", probe.PROTOCOL) is not None:
            raise RuntimeError("a valid proof was refused")
    hello = (time.perf_counter() - t0) / rounds * 1e6
    client, server = SecretAuthorizer(secret), SecretAuthorizer(secret)
    t0 = time.perf_counter()
    for _ in range(rounds):
        request = dht_pb2.FindRequest(keys=[os.urandom(20)], peer=dht_pb2.NodeInfo(node_id=os.urandom(20)))
        await client.sign_request(request)
        response = dht_pb2.FindResponse(peer=dht_pb2.NodeInfo(node_id=os.urandom(20)))
        if not await server.validate_request(request):
            raise RuntimeError("a valid request was refused")
        await server.sign_response(response, request)
        if not await client.validate_response(response, request):
            raise RuntimeError("a valid answer was refused")
    dht = (time.perf_counter() - t0) / rounds * 1e6
    return {"hello proof, made + checked": hello, "DHT request + answer, signed + checked": dht}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--serve", metavar="SECRET_FILE", nargs="?", const="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        uvloop.run(serve(args.serve or None))
        return
    print(machine_header(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        secret_file = str(create_secret_file(os.path.join(tmp, "swarm.secret")))
        servers = {
            name: subprocess.Popen(
                [sys.executable, __file__, "--serve", *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            for name, extra in (("open", []), ("private", [secret_file]))
        }
        try:
            infos = {name: json.loads(server.stdout.readline()) for name, server in servers.items()}
            results = uvloop.run(measure(infos, secret_file, args.rounds))
            costs = uvloop.run(micro())
        finally:
            for server in servers.values():
                server.stdin.close()
                server.wait(30)
    print(f"{'median of ' + str(args.rounds):32} {'open swarm':>12} {'private':>12} {'ratio':>7}")
    for what, plain in results["open"].items():
        private = results["private"][what]
        print(f"{what:32} {plain:9.3f} ms {private:9.3f} ms {private / plain:6.2f}x")
    for what, micros in costs.items():
        print(f"{what:40} {micros:6.1f} us")


if __name__ == "__main__":
    main()
