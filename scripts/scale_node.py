#!/usr/bin/env python
"""One DHT-only participant of scripts/bench_scale.py: a libp2p daemon and a Kademlia node that
store and serve the swarm's records, as every peer's do, without serving layers.

It prints its multiaddrs as one JSON line on stdout once joined, then answers the harness on
stdin, one JSON line each:
- `{"watch": MODEL}`: reads MODEL's records until a lookup returns one; prints
  `{"seen": unix time}`;
- `{"lookup": MODEL}`: prints `{"records": N, "seconds": S}` of one lookup.
Usage (the harness starts it): python scripts/scale_node.py --initial-peers MADDR [...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import uvloop

from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import P2PFusionError

WATCH_EVERY = 0.25  # seconds between a watcher's reads
WATCH_LIMIT = 120.0


def say(message: dict) -> None:
    print(json.dumps(message), flush=True)


async def answer(node, request: dict) -> None:
    if "watch" in request:
        deadline = time.monotonic() + WATCH_LIMIT
        while not await node.lookup(request["watch"]) and time.monotonic() < deadline:
            await asyncio.sleep(WATCH_EVERY)
        say({"seen": time.time() if time.monotonic() < deadline else None})
    elif "lookup" in request:
        t0 = time.perf_counter()
        records = await node.lookup(request["lookup"])
        say({"records": len(records), "seconds": time.perf_counter() - t0})


async def serve(initial_peers: list[str], identity: str | None) -> None:
    node = await join_swarm(initial_peers, identity_path=identity)
    say({"maddrs": await node.maddrs(), "peer_id": node.peer_id})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            try:
                request = json.loads(line)
            except json.JSONDecodeError:
                continue
            await answer(node, request)
    finally:
        await node.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", action="append", required=True)
    parser.add_argument("--identity", help="key file: the node keeps its peer id across restarts")
    args = parser.parse_args()
    try:
        uvloop.run(serve(args.initial_peers, args.identity))
    except P2PFusionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
