"""The processes of scripts/bench_scale.py: real `run-peer` processes and DHT-only participants
(scripts/scale_node.py), each with its own libp2p daemon, started, watched, killed and restarted.

Each node runs in its own process group, so a kill takes its libp2p daemon with it, as a machine
that loses power would. A node keeps its key file across restarts, so it comes back as the same
peer (a serving peer then takes back its old layers if nobody took them meanwhile).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

NODE_SCRIPT = Path(__file__).with_name("scale_node.py")
JOIN_TIMEOUT = 900.0
INITIAL_PEERS = 5  # a restarting node is given this many live nodes to join through
TRIES = 3  # starts of a node that exits before it joins, as a supervisor (systemd, Docker) would


@dataclass
class Node:
    kind: str  # "peer" (run-peer) or "dht" (scale_node.py)
    index: int
    throughput: float = 0.0  # a peer's announced one-token steps/s through one layer
    proc: asyncio.subprocess.Process | None = None
    launched: float = 0.0
    ready: float | None = None
    maddrs: list[str] = field(default_factory=list)
    peer_id: str = ""
    restarts: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request at a time to a DHT node

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and self.ready is not None

    def memory(self) -> tuple[float, float, float]:
        """(RSS of the Python process, RSS of its libp2p daemon, PSS of both), MiB."""
        main = psutil.Process(self.proc.pid)
        children = main.children(recursive=True)
        rss = main.memory_info().rss
        daemon = sum(c.memory_info().rss for c in children)
        pss = sum(p.memory_full_info().pss for p in [main, *children])
        return rss / 2**20, daemon / 2**20, pss / 2**20

    async def ask(self, request: dict) -> dict:
        """A DHT node's answer to one request (scale_node.py's protocol)."""
        async with self.lock:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            await self.proc.stdin.drain()
            line = await self.proc.stdout.readline()
        if not line:
            raise ConnectionError(f"dht node {self.index} exited")
        return json.loads(line)


@dataclass
class Fleet:
    model: Path
    workdir: Path
    peer_args: list[str]
    nodes: list[Node] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.alive]

    def entry_points(self) -> list[str]:
        live = self.live()
        return [n.maddrs[0] for n in self.rng.sample(live, min(INITIAL_PEERS, len(live)))]

    async def launch(self, node: Node, initial: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "P2PFUSION_CACHE": str(self.workdir / "cache")}
        join = ["--new-swarm"] if not initial else [a for m in initial for a in ("--initial-peers", m)]
        log = open(self.workdir / f"{node.kind}{node.index}.log", "a")
        key = str(self.workdir / f"{node.kind}{node.index}.key")
        if node.kind == "peer":
            address_file = self.workdir / f"peer{node.index}.addr"
            address_file.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "p2pfusion.cli.main", "run-peer", "--model", str(self.model), *join,
                   "--identity", key, "--address-file", str(address_file), "--throughput", str(node.throughput),
                   *self.peer_args]
            pipes = dict(stdout=asyncio.subprocess.DEVNULL)
        else:
            cmd = [sys.executable, str(NODE_SCRIPT), *join, "--identity", key]
            pipes = dict(stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        node.ready, node.launched = None, time.time()
        node.proc = await asyncio.create_subprocess_exec(*cmd, stderr=log, env=env, start_new_session=True, **pipes)
        log.close()

    async def wait_ready(self, node: Node, timeout: float = JOIN_TIMEOUT) -> bool:
        """Until the node serves (a peer writes its address file) or has joined (a DHT node says
        its addresses); False if it exited or took longer than `timeout`."""
        deadline = time.monotonic() + timeout
        proc = node.proc
        if node.kind == "dht":
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), timeout)
            except asyncio.TimeoutError:
                return False
            if not line:
                return False
            hello = json.loads(line)
            node.maddrs, node.peer_id = hello["maddrs"], hello["peer_id"]
        else:
            address_file = self.workdir / f"peer{node.index}.addr"
            while not address_file.exists():
                if proc.returncode is not None or time.monotonic() > deadline:
                    return False
                await asyncio.sleep(0.2)
            node.maddrs = address_file.read_text().split()
            node.peer_id = node.maddrs[0].rsplit("/p2p/", 1)[1]
        if proc is not node.proc:  # killed and relaunched meanwhile
            return False
        node.ready = time.time()
        return True

    def freeze(self, node: Node) -> None:
        """SIGSTOP to the node and its daemon: a host suspended, or gone without a reset (its
        connections stay open and nothing answers); `kill` ends it later."""
        self._signal(node, signal.SIGSTOP)

    def kill(self, node: Node) -> None:
        self._signal(node, signal.SIGKILL)

    @staticmethod
    def _signal(node: Node, number: int) -> None:
        """To the node's process group (its daemon too); it no longer counts as live."""
        if node.proc is not None and node.proc.returncode is None:
            try:
                os.killpg(node.proc.pid, number)
            except ProcessLookupError:
                pass
        node.ready = None

    async def restart(self, node: Node) -> float | None:
        """Start a killed node again through live nodes, again if it exits before it joins (its
        entry points may die meanwhile); seconds from the kill until it serves again, or None."""
        killed = time.time()
        proc = node.proc
        for _ in range(TRIES):
            await proc.wait()
            if node.proc is not proc:  # killed and relaunched by a later round meanwhile
                return None
            node.restarts += 1
            await self.launch(node, self.entry_points())
            proc = node.proc
            if await self.wait_ready(node):
                return node.ready - killed
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except asyncio.TimeoutError:  # still trying to join after JOIN_TIMEOUT
                return None
        return None

    def stop(self) -> None:
        for node in self.nodes:
            self.kill(node)
