"""Start a swarm of real peer processes on 127.0.0.1 (the demo, tests and benchmarks use it).

Peers are forked from a fork server (cli/forkserver.py), which imports torch and transformers once
for all of them, unless `fork=False`: measures of one peer process's memory start each afresh."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from p2pfusion.cli.forkserver import ForkedProcess, ForkServer
from p2pfusion.errors import RouteError

START_TIMEOUT = 120.0


def even_ranges(num_layers: int, peers: int) -> list[tuple[int, int]]:
    bounds = [round(i * num_layers / peers) for i in range(peers + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass
class LocalSwarm:
    model: str | None
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="p2pfusion-")))
    processes: list[subprocess.Popen | ForkedProcess] = field(default_factory=list)
    maddrs: list[str] = field(default_factory=list)
    fork: bool = True
    # the fork server peers come from: one this swarm starts at its first launch when none is given
    forks: ForkServer | None = None
    _own_forks: bool = field(default=False, repr=False)

    def launch(
        self, layers: tuple[int, int] | None, extra: list[str] | None = None, prefix: list[str] | None = None
    ) -> subprocess.Popen | ForkedProcess:
        """Start one peer process (under `prefix`, e.g. `ip netns exec NS`, afresh); the first one
        starts the swarm."""
        index = len(self.processes)
        argv = ["run-peer"]
        if self.model is not None:
            argv += ["--model", self.model]
        argv += ["--new-swarm"] if not self.maddrs else [arg for m in self.maddrs for arg in ("--initial-peers", m)]
        if layers is not None:
            argv += ["--layers", f"{layers[0]}:{layers[1]}"]
        address_file = self.workdir / f"peer{index}.addr"
        argv += ["--address-file", str(address_file), *(extra or [])]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.workdir / f"peer{index}.log", "w") as log:
            if prefix or not self.fork:
                cmd = [*(prefix or []), sys.executable, "-m", "p2pfusion.cli.main", *argv]
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
            else:
                if self.forks is None:
                    self.forks, self._own_forks = ForkServer(), True
                proc = self.forks.popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env)
        self.processes.append(proc)
        proc.address_file = address_file  # type: ignore[union-attr]
        return proc

    def wait_ready(self, proc: subprocess.Popen | ForkedProcess, timeout: float = START_TIMEOUT) -> list[str]:
        deadline = time.monotonic() + timeout
        address_file: Path = proc.address_file  # type: ignore[attr-defined]
        while not address_file.exists():
            if proc.poll() is not None:
                log = (self.workdir / f"peer{self.processes.index(proc)}.log").read_text()
                raise RouteError(f"a local peer exited with code {proc.returncode}: {log.strip().splitlines()[-1:]}")
            if time.monotonic() > deadline:
                raise RouteError(f"a local peer did not start within {timeout:.0f} s")
            time.sleep(0.1)
        maddrs = address_file.read_text().split()
        if not self.maddrs:
            self.maddrs = maddrs
        return maddrs

    def start(self, ranges: list[tuple[int, int]], extra: list[str] | None = None) -> LocalSwarm:
        """The first peer starts the swarm; the others join it in parallel. `extra`: run-peer arguments for all."""
        first = self.launch(ranges[0], extra)
        self.wait_ready(first)
        rest = [self.launch(r, extra) for r in ranges[1:]]
        for proc in rest:
            self.wait_ready(proc)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._own_forks and self.forks is not None:
            self.forks.close()
            self.forks, self._own_forks = None, False

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
