#!/usr/bin/env python
"""Silent peers: what DHT nodes that neither answer nor refuse cost a joining client and the nodes
already in the swarm.

A host that is suspended, or gone without a reset, keeps its connections open and answers
nothing; on the internet that is how most peers vanish. This starts `--nodes` DHT nodes on
127.0.0.1 (each lists a model, as serving peers do), then stops the libp2p daemons of one node,
then of a second (SIGSTOP). Each time, ours (`join_swarm`'s nodes) against the reference (hivemind
as it comes: the daemon told of every node as a bootstrap peer, `DHTNode` with its defaults,
`get(latest=True)`):
- at once, the first store and the first read of nodes that were in the swarm before (two nodes
  each, one with our requests, one with hivemind's own, at the same moment);
- then `--runs` times, alternating, a fresh client that joins through every node's address and
  reads the models listed (before each, the live nodes list their models again, as serving peers
  do every 10 s; entries live 30 s).
Prints the medians, reference / ours, and the fewest and most models a read listed. A reference
join that fails counts as its time to fail.
Usage: python scripts/bench_silent_peers.py [--nodes 8] [--runs 5]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import asyncio
import os
import signal
import statistics
import time

import uvloop
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, P2PDaemonError

from p2pfusion.dht.records import MODELS_KEY, ModelEntry
from p2pfusion.dht.swarm import SwarmNode, join_swarm
from p2pfusion.dht.validation import SwarmValidator

HIVEMIND_TIMEOUT = 3.0  # DHTNode's default wait_timeout


async def ours(maddrs: list[str]) -> tuple[float, float, int]:
    started = time.perf_counter()
    client = await join_swarm(maddrs, client_mode=True)
    joined = time.perf_counter()
    try:
        listed = len(await client.models())
        return joined - started, time.perf_counter() - joined, listed
    finally:
        await client.shutdown()


async def reference(maddrs: list[str]) -> tuple[float, float, int | None]:
    """Join and first read seconds, and the models listed (None: the join failed)."""
    started = time.perf_counter()
    try:
        p2p = await P2P.create(initial_peers=maddrs)
    except P2PDaemonError:  # its bootstrap outlasted the daemon's start
        return time.perf_counter() - started, 0.0, None
    # the swarm's validator only reads its signed values: hivemind's requests and waits are untouched
    dht = await DHTNode.create(p2p=p2p, initial_peers=maddrs, client_mode=True, record_validator=SwarmValidator(RSASignatureValidator()))
    joined = time.perf_counter()
    try:
        found = await dht.get(MODELS_KEY, latest=True)
        listed = len(found.value) if found is not None else 0
        return joined - started, time.perf_counter() - joined, listed
    finally:
        await dht.shutdown()
        await p2p.shutdown()


class Hivemind:
    """A node of ours whose DHT requests are hivemind's own again, with its default timeout, while
    inside this."""

    def __init__(self, node: SwarmNode):
        self.protocol = node.dht.protocol
        self.wrapped = {name: getattr(self.protocol, name) for name in ("call_find", "call_store")}
        self.timeout = self.protocol.wait_timeout

    def __enter__(self) -> None:
        for name in self.wrapped:
            delattr(self.protocol, name)  # the class's own methods show through again
        self.protocol.wait_timeout = HIVEMIND_TIMEOUT

    def __exit__(self, *exc) -> None:
        for name, call in self.wrapped.items():
            setattr(self.protocol, name, call)
        self.protocol.wait_timeout = self.timeout


async def timed(work) -> float:
    started = time.perf_counter()
    await work
    return time.perf_counter() - started


async def first_store_and_read(nodes: list[SwarmNode]) -> tuple[list[float], list[float]]:
    """(ours, reference) seconds of a store and a read, by four nodes at the same moment."""
    async def store(node: SwarmNode) -> float:
        return await timed(node.report_unreachable("bench-silent", node.peer_id, "a store"))

    async def read(node: SwarmNode) -> float:
        return await timed(node.models())

    with Hivemind(nodes[1]), Hivemind(nodes[3]):
        seconds = await asyncio.gather(store(nodes[0]), store(nodes[1]), read(nodes[2]), read(nodes[3]))
    return [seconds[0], seconds[2]], [seconds[1], seconds[3]]


async def announce(nodes: list[SwarmNode]) -> None:
    for node in nodes:
        await node.announce_model(ModelEntry(f"model-{node.peer_id[-8:]}", "model", 4, 64))


def listing(counts: list[int | None]) -> str:
    done = [c for c in counts if c is not None]
    failed = f", {len(counts) - len(done)} of {len(counts)} joins failed" if len(done) < len(counts) else ""
    return (f"{min(done)}-{max(done)}" if done else "-") + failed


def cell(mine: list[float], theirs: list[float]) -> str:
    mine, theirs = statistics.median(mine), statistics.median(theirs)
    return f"{mine:.2f} / {theirs:.2f} s (x{theirs / mine:.1f})"


async def bench(args) -> None:
    nodes = [await join_swarm([])]
    nodes += [await join_swarm(await nodes[0].maddrs()) for _ in range(args.nodes - 1)]
    stopped: list[SwarmNode] = []
    try:
        await announce(nodes)
        maddrs = [(await node.maddrs())[0] for node in nodes]
        print("| silent nodes | first store in the swarm, ours / reference | first read in the swarm | "
              "fresh client's join | its first read | models listed, ours / reference |")
        print("|---|---|---|---|---|---|")
        for silent in (1, 2):
            victim = nodes[silent]
            os.kill(victim.p2p._child.pid, signal.SIGSTOP)
            stopped.append(victim)
            mine, theirs = await first_store_and_read(nodes[-4:])
            rows: dict[str, list] = {"ours": [], "reference": []}
            for _ in range(args.runs):
                await announce([node for node in nodes if node not in stopped])
                rows["ours"].append(await ours(maddrs))
                rows["reference"].append(await reference(maddrs))
            cells = [cell([mine[0]], [theirs[0]]), cell([mine[1]], [theirs[1]])]
            cells += [cell([r[i] for r in rows["ours"]], [r[i] for r in rows["reference"]]) for i in (0, 1)]
            listed = [listing([r[2] for r in rows[k]]) for k in rows]
            print(f"| {silent} of {args.nodes} | {' | '.join(cells)} | {' / '.join(listed)} |", flush=True)
    finally:
        for node in stopped:
            os.kill(node.p2p._child.pid, signal.SIGCONT)
        for node in nodes:
            await node.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if args.nodes < 4 or args.runs < 1:
        parser.error("--nodes must be 4 or more and --runs 1 or more")
    print(machine_header(), flush=True)
    uvloop.run(bench(args))


if __name__ == "__main__":
    main()
