"""Many CLI command lines, each in a child of the tests' fork server (cli/forkserver.py), some at
once: `forked(forks, cases)` gives each its result as `subprocess.run` would. What a process
prints while it imports (library noise) is not seen here: tests of that start the CLI afresh."""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time
from pathlib import Path

from p2pfusion.cli.forkserver import ForkServer

PARALLEL = 6  # children at once: most of each waits for a dial or a timeout
CASE_TIMEOUT = 120.0  # seconds a child may run before it is killed (its result then says so)


def forked(forks: ForkServer, cases: list[list[str]], env: dict | None = None) -> list[subprocess.CompletedProcess]:
    with tempfile.TemporaryDirectory() as tmp:
        files = [(Path(tmp, f"{i}.out"), Path(tmp, f"{i}.err")) for i in range(len(cases))]
        codes: list[int] = []
        for start in range(0, len(cases), PARALLEL):
            batch = []
            for argv, (out, err) in zip(cases[start:start + PARALLEL], files[start:start + PARALLEL]):
                with open(out, "w") as stdout, open(err, "w") as stderr:
                    batch.append(forks.popen(argv, stdout=stdout, stderr=stderr, env=env))
            deadline = time.monotonic() + CASE_TIMEOUT
            for proc in batch:
                try:
                    codes.append(proc.wait(max(deadline - time.monotonic(), 0.0)))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    codes.append(proc.wait())
        return [subprocess.CompletedProcess(argv, code, out.read_text(errors="replace"), err.read_text(errors="replace"))
                for argv, code, (out, err) in zip(cases, codes, files)]


async def forked_async(forks: ForkServer, argv: list[str], stdin: str = "") -> subprocess.CompletedProcess:
    """One command line with `stdin` as its input, waited for without blocking the event loop
    (which may be the one its swarm's peers run on)."""
    with tempfile.TemporaryDirectory() as tmp:
        given, out, err = (Path(tmp, name) for name in ("in", "out", "err"))
        given.write_text(stdin)
        with open(given) as stdin_file, open(out, "w") as stdout, open(err, "w") as stderr:
            proc = forks.popen(argv, stdin=stdin_file, stdout=stdout, stderr=stderr)
        deadline = time.monotonic() + CASE_TIMEOUT
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
            await asyncio.sleep(0.05)
        return subprocess.CompletedProcess(argv, proc.returncode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))
