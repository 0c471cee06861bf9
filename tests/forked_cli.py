"""Many CLI command lines, each in a process of its own, for the cost of one start of the CLI.

`forked(cases)` runs each case's `p2pfusion.cli.main.main(argv)` in a child forked from one process
that has imported what the CLI's commands import (4 s of a 2-core machine per process otherwise):
each child starts from the state a fresh `p2pfusion` process reaches once its imports are done,
its exit code, stdout and stderr are its own, and its logging set-up dies with it. The parent
computes nothing with torch before forking, so no thread pool is forked half-started. What a
process prints while it imports (library noise) is not seen here: tests of that start the CLI."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARALLEL = 6  # children at once: most of each waits for a dial or a timeout
CASE_TIMEOUT = 120.0  # seconds a child may run before it is killed (its result then says so)


def forked(cases: list[list[str]], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Each command line's result, as `subprocess.run` would give it."""
    proc = subprocess.run([sys.executable, "-m", "tests.forked_cli"], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=timeout, cwd=Path(__file__).parents[1])
    if proc.returncode != 0:
        raise RuntimeError(f"the forking process failed: {proc.stderr}")
    return [subprocess.CompletedProcess(argv, code, out, err) for argv, (code, out, err) in zip(cases, json.loads(proc.stdout))]


def _child(argv: list[str], out_path: str, err_path: str) -> None:
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    code = 1
    try:
        from p2pfusion.cli.main import main

        code = main(argv)
    except SystemExit as exc:  # argparse's errors
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_all(cases: list[list[str]]) -> list[tuple[int, str, str]]:
    importlib.import_module("p2pfusion.cli.commands")  # what the commands import: torch, transformers, hivemind
    results: dict[int, tuple[int, str, str]] = {}
    running: dict[int, tuple[int, str, float]] = {}  # pid: (case index, its files' prefix, deadline)
    with tempfile.TemporaryDirectory() as tmp:
        pending = list(enumerate(cases))
        while pending or running:
            while pending and len(running) < PARALLEL:
                index, argv = pending.pop(0)
                prefix = os.path.join(tmp, str(index))
                pid = os.fork()
                if pid == 0:
                    _child(argv, f"{prefix}.out", f"{prefix}.err")
                running[pid] = (index, prefix, time.monotonic() + CASE_TIMEOUT)
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                for late, (_, _, deadline) in running.items():
                    if time.monotonic() > deadline:
                        os.kill(late, signal.SIGKILL)
                time.sleep(0.05)
                continue
            index, prefix, _ = running.pop(pid)
            texts = [Path(f"{prefix}.{kind}").read_text(errors="replace") for kind in ("out", "err")]
            results[index] = (os.waitstatus_to_exitcode(status), *texts)
    return [results[i] for i in range(len(cases))]


if __name__ == "__main__":
    json.dump(_run_all(json.load(sys.stdin)), sys.stdout)
