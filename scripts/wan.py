#!/usr/bin/env python
"""A swarm of the default model spread over emulated regions of the internet, on this machine.

Each peer runs on a host of its own (a network namespace on a bridge), behind a relay that holds
every byte for the one-way delay between the hosts (p2pfusion/cli/wan.py; this kernel has no
netem); tbf shapes each link's rate. This machine's own namespace is the client's host. It prints
what it set up, with a round trip and a transfer measured from the client to each peer through our
own transport (each should match its configured figures), and serves until Ctrl-C, then removes
everything. Needs root.

Regions: --regions gives each peer's region (0, 1, 2, ...); --rtt gives the round trip between
regions as "A-B:MS" pairs (default 0-1:20,0-2:60,1-2:120), with --inside MS (1) within a region.
Usage: sudo .venv/bin/python scripts/wan.py [--regions 0,1,2] [--rtt 0-1:20,0-2:60,1-2:120] [--mbit 100]
"""

from __future__ import annotations

import argparse
import signal
import sys

try:
    import uvloop

    from p2pfusion.cli.hosts import HostNetwork, namespaces_unavailable
    from p2pfusion.cli.local_swarm import even_ranges
    from p2pfusion.cli.wan import WanSwarm
    from p2pfusion.dht.swarm import join_swarm
    from p2pfusion.models.source import resolve_model
    from p2pfusion.models.stage import load_config
    from p2pfusion.net.probe import measure_link
except ImportError as exc:  # sudo's python is not the virtualenv's
    sys.exit(f"wan.py: {sys.executable} cannot import {exc.name}: run it with the virtualenv's interpreter, "
             "e.g. sudo .venv/bin/python scripts/wan.py")


def parse_rtts(text: str) -> dict[tuple[int, int], float]:
    """'0-1:20,0-2:60' -> {(0, 1): 0.020, (1, 0): 0.020, ...} (round trips, in seconds)."""
    out = {}
    for item in filter(None, text.split(",")):
        pair, ms = item.split(":")
        a, b = (int(x) for x in pair.split("-"))
        out[(a, b)] = out[(b, a)] = float(ms) / 1000
    return out


async def measure(maddrs: list[str], records_of) -> list[tuple[str, float, float]]:
    client = await join_swarm(maddrs, client_mode=True)
    try:
        found = []
        for record in await records_of(client):
            link = await measure_link(client.transport, record.peer_id, record.data_addrs, payload_bytes=1 << 20)
            found.append((record.data_addrs[0] if record.data_addrs else record.peer_id, link.rtt, link.bytes_per_second))
        return found
    finally:
        await client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regions", default="0,1,2", help="each peer's region, in layer order")
    parser.add_argument("--rtt", default="0-1:20,0-2:60,1-2:120", help="round trips between regions, A-B:MS,...")
    parser.add_argument("--inside", type=float, default=1.0, help="round trip within a region, ms")
    parser.add_argument("--client-region", type=int, default=0)
    parser.add_argument("--mbit", type=int, default=100, help="each host's link rate")
    args = parser.parse_args()
    reason = namespaces_unavailable()
    if reason is not None:
        sys.exit(f"wan.py: error: {reason}")
    regions = [int(r) for r in args.regions.split(",")]
    rtts = parse_rtts(args.rtt)

    def one_way(a: int, b: int) -> float:
        return (args.inside / 1000 if a == b else rtts.get((a, b), 0.0)) / 2

    source = resolve_model(None)  # converted once, before the peers start
    layers = load_config(source).num_hidden_layers
    with HostNetwork(len(regions), prefix="p2pfwan", subnet="10.80.0", mbit=args.mbit) as net, \
            WanSwarm(net, regions, args.client_region) as wan:
        wan.delays(one_way)
        maddrs = wan.start(even_ranges(layers, len(regions)))
        print(f"client host {net.gateway} (region {args.client_region}); link rate {args.mbit} Mbit/s")
        for i, (region, span) in enumerate(zip(regions, even_ranges(layers, len(regions)))):
            print(f"  peer host {net.host(i)}: region {region}, layers {span[0]}:{span[1]}, "
                  f"configured round trip from the client {2000 * one_way(args.client_region, region):.0f} ms")

        async def records_of(client):
            (entry,) = await client.models()
            return sorted(await client.lookup(entry.key), key=lambda r: r.start)

        for addr, rtt, rate in uvloop.run(measure(maddrs, records_of)):
            print(f"  measured to {addr}: round trip {1000 * rtt:.1f} ms, {8 * rate / 1e6:.0f} Mbit/s")
        print(f"swarm ready: p2pfusion infer --initial-peers {maddrs[0]} \"...\"  (Ctrl-C ends it)", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            print("removing the hosts", file=sys.stderr)


if __name__ == "__main__":
    main()
