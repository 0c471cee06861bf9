"""Wide-area links on one machine: every byte between two hosts takes the time the latency matrix says.

This kernel has no netem, so the delay is added in user space. Each peer host (a network namespace
of `HostNetwork`) runs a `DelayRelay` in front of its peer: the relay listens on the host's
address at the peer's ports and forwards to the peer, which listens on 127.0.0.1 and announces the
host's address (`--announce-host`, fixed `--port`/`--data-port`). Every connection to a host
crosses that host's relay and no other, so both planes (libp2p, which carries the DHT, and the
direct TLS connections) and every pair of hosts see the matrix: each chunk, in each direction, is
held for the one-way delay between the connecting host and this one (plus up to `jitter`, never
reordered). The kernel's tbf (`HostNetwork(mbit=...)`) shapes the rate. Loss is emulated as TCP
shows it to the application: a lost chunk (each with probability `loss`) arrives late, after a
retransmission (Linux's least retransmission timeout, 200 ms, plus a round trip), and holds up
what follows it.

The matrix is a JSON file, {"one_way": {SOURCE_IP: seconds}, "default": seconds, "jitter": seconds, "loss": share},
read again whenever it changes, so a benchmark can sweep delays without restarting the swarm.
Run one relay as `python -m p2pfusion.cli.wan --host IP --ports P,Q --matrix FILE` inside the host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from p2pfusion.cli.hosts import HostNetwork
from p2pfusion.cli.local_swarm import LocalSwarm

CHUNK = 64 << 10
PEER_PORT = 31337  # each host's peer: libp2p here, direct TLS one above (hosts are namespaces: all alike)
RELOAD_EVERY = 0.2  # seconds between looks at the matrix file
RETRANSMIT_TIMEOUT = 0.2  # Linux's least RTO: what a lost segment costs beyond the round trip


@dataclass
class Matrix:
    """One-way delays to this host by the source's address, from a file read again when it changes."""

    path: Path
    one_way: dict[str, float] = field(default_factory=dict)
    default: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0
    _mtime: float = -1.0
    _looked: float = 0.0

    def delay(self, source: str, rng: random.Random) -> float:
        now = time.monotonic()
        if now - self._looked > RELOAD_EVERY:
            self._looked = now
            self._reload()
        base = self.one_way.get(source, self.default)
        late = RETRANSMIT_TIMEOUT + 2 * base if self.loss and rng.random() < self.loss else 0.0
        return base + late + (rng.random() * self.jitter if self.jitter else 0.0)

    def _reload(self) -> None:
        try:
            mtime = self.path.stat().st_mtime
            if mtime == self._mtime:
                return
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return  # a file being rewritten: the last matrix holds
        self._mtime = mtime
        self.one_way = {str(k): float(v) for k, v in data.get("one_way", {}).items()}
        self.default, self.jitter = float(data.get("default", 0.0)), float(data.get("jitter", 0.0))
        self.loss = float(data.get("loss", 0.0))


def write_matrix(
    path: Path, one_way: dict[str, float], default: float = 0.0, jitter: float = 0.0, loss: float = 0.0
) -> None:
    """Write a relay's matrix at once (relays read it within RELOAD_EVERY)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"one_way": one_way, "default": default, "jitter": jitter, "loss": loss}))
    tmp.replace(path)


async def _delayed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, matrix: Matrix, source: str) -> None:
    """Copy `reader` to `writer`, each chunk released its delay after it arrived, in order."""
    queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
    loop, rng = asyncio.get_running_loop(), random.Random()

    async def take() -> None:
        last = 0.0
        try:
            while chunk := await reader.read(CHUNK):
                last = max(last, loop.time() + matrix.delay(source, rng))  # jitter never reorders
                queue.put_nowait((last, chunk))
        except OSError:
            pass
        queue.put_nowait(None)

    taker = asyncio.ensure_future(take())
    try:
        while (item := await queue.get()) is not None:
            release, chunk = item
            wait = release - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        pass
    finally:
        taker.cancel()


class DelayRelay:
    """Forwards `host:port` to `127.0.0.1:port` for each port, delayed by `matrix`."""

    def __init__(self, host: str, ports: list[int], matrix: Matrix, target: str = "127.0.0.1"):
        self.host, self.ports, self.matrix, self.target = host, ports, matrix, target
        # asyncio drops its own reference to a connection's handler once the client's side is
        # gone; one still copying from a frozen peer would then be collected mid-await
        self._handling: set[asyncio.Task] = set()

    async def serve(self) -> None:
        servers = [await asyncio.start_server(self._handler(port), self.host, port) for port in self.ports]
        await asyncio.gather(*(server.serve_forever() for server in servers))

    def _handler(self, port: int):
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            self._handling.add(task)
            task.add_done_callback(self._handling.discard)
            source = writer.get_extra_info("peername")[0]
            try:
                up_reader, up_writer = await asyncio.open_connection(self.target, port)
            except OSError:
                writer.close()
                return
            try:
                await asyncio.gather(
                    _delayed(reader, up_writer, self.matrix, source), _delayed(up_reader, writer, self.matrix, source)
                )
            finally:
                up_writer.close()
                writer.close()

        return handle


class WanSwarm:
    """Peers on the hosts of `net`, each behind its `DelayRelay`, and the one-way delays between
    hosts in `regions` (the region of each host; the caller's own namespace, where clients run,
    is in `client_region`)."""

    def __init__(self, net: HostNetwork, regions: list[int], client_region: int = 0, workdir: Path | None = None):
        self.net, self.regions, self.client_region = net, regions, client_region
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="p2pfusion-wan-"))
        self.relays: list[subprocess.Popen] = []
        self.swarm = LocalSwarm(model=None, workdir=self.workdir)

    def matrix(self, i: int) -> Path:
        return self.workdir / f"matrix{i}.json"

    def delays(self, one_way: Callable[[int, int], float], jitter: float = 0.0, loss: float = 0.0) -> None:
        """Set every host's matrix: `one_way(region_a, region_b)` seconds from a host of region a
        to one of region b (both ways alike), `jitter` seconds more at most, `loss` of the chunks
        retransmitted."""
        for i, region in enumerate(self.regions):
            sources = {self.net.host(j): one_way(other, region) for j, other in enumerate(self.regions) if j != i}
            sources[self.net.gateway] = one_way(self.client_region, region)
            write_matrix(self.matrix(i), sources, jitter=jitter, loss=loss)

    def start(
        self, ranges: list[tuple[int, int] | None], extra: list[str] | None = None,
        each: list[list[str]] | None = None, one_by_one: bool = False,
    ) -> list[str]:
        """A relay and a peer on each host (the first starts the swarm), with `extra` arguments and
        the host's own of `each`; a peer waits for the one before when `one_by_one` (peers that
        choose their layers see those before them). The swarm's first addresses."""
        ports = [str(PEER_PORT), str(PEER_PORT + 1)]
        peers = []
        for i, layers in enumerate(ranges):
            if not self.matrix(i).exists():
                write_matrix(self.matrix(i), {})
            self.relays.append(subprocess.Popen(
                [*self.net.prefix_of(i), sys.executable, "-m", "p2pfusion.cli.wan", "--host", self.net.host(i),
                 "--ports", ",".join(ports), "--matrix", str(self.matrix(i))],
            ))
            args = ["--host", "127.0.0.1", "--announce-host", self.net.host(i), "--port", ports[0], "--data-port", ports[1]]
            own = each[i] if each is not None else []
            peers.append(self.swarm.launch(layers, [*args, *(extra or []), *own], prefix=self.net.prefix_of(i)))
            if i == 0 or one_by_one:
                self.swarm.wait_ready(peers[i])
        for proc in peers[1:]:
            self.swarm.wait_ready(proc)
        return self.swarm.maddrs

    def __enter__(self) -> WanSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.swarm.stop()
        for relay in self.relays:
            relay.kill()
            relay.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description="a delaying relay in front of one host's ports")
    parser.add_argument("--host", required=True, help="the address others reach this host at")
    parser.add_argument("--ports", required=True, help="comma-separated ports to relay to 127.0.0.1")
    parser.add_argument("--matrix", required=True, type=Path, help="the JSON file of one-way delays")
    args = parser.parse_args()
    relay = DelayRelay(args.host, [int(p) for p in args.ports.split(",")], Matrix(args.matrix))
    # a terminal's Ctrl-C reaches the whole process group: the relay's owner (WanSwarm) ends it
    # once the peers behind it have left, which they may only do through it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(relay.serve())


if __name__ == "__main__":
    main()
