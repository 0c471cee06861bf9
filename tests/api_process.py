"""A `p2pfusion api` process for tests, on a free port: `launch_api`, then `api_url` once it is needed
(other processes may start meanwhile)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from p2pfusion.cli.forkserver import ForkedProcess, ForkServer

READY_WITHIN = 120.0


def launch_api(args: list[str], log: Path, forks: ForkServer) -> ForkedProcess:
    """`p2pfusion api ARGS --port 0`, its stderr in `log`."""
    with open(log, "w") as err:
        return forks.popen(["api", *args, "--port", "0"], stdout=subprocess.DEVNULL, stderr=err)


def api_url(proc: ForkedProcess, log: Path) -> str:
    """The API's base URL (without `/v1`), once it serves: it logs the URL then."""
    deadline = time.monotonic() + READY_WITHIN
    while time.monotonic() < deadline:
        found = re.search(r"API at (http://\S+)/v1", log.read_text())
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"p2pfusion api exited: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"p2pfusion api did not start: {log.read_text()[-2000:]}")
