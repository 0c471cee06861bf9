"""What scripts/bench_scale.py asks of the swarm's views at scale: `p2pfusion swarm` (its JSON and
its table) and the API's `/v1/swarm` with its dashboard page, timed and checked against the peers
the harness knows serve."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
import time
import urllib.request
from pathlib import Path

CLI = [sys.executable, "-m", "p2pfusion.cli.main"]
CHROMIUM = "/usr/bin/chromium"
API_READY_WITHIN = 300.0
VIEW_RUNS = 5


async def _cli(args: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*CLI, *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL)
    out, _ = await proc.communicate()
    return time.perf_counter() - t0, out.decode()


def _listed(body: dict) -> set[str]:
    return {p["peer_id"] for m in body["models"] for p in m["peers"]}


async def swarm_command(fleet, source, serving: set[str]) -> None:
    join = [a for m in fleet.entry_points() for a in ("--initial-peers", m)]
    seconds, out = await _cli(["swarm", *join, "--model", source.key, "--json"])
    try:
        listed = _listed(json.loads(out))
    except (json.JSONDecodeError, KeyError):
        print(f"p2pfusion swarm --json: no JSON after {seconds:.1f} s")
        return
    table_seconds, table = await _cli(["swarm", *join, "--model", source.key])
    (fleet.workdir / "swarm.txt").write_text(table)
    bare, _ = await _cli(["swarm", *join, "--model", source.key, "--no-probe"])
    started, _ = await _cli(["--version"])
    print(f"p2pfusion swarm --json: {seconds:.1f} s, lists {len(serving & listed)} of {len(serving)} serving peers "
          f"({len(listed)} records); the table: {table_seconds:.1f} s, {len(table.splitlines())} lines; "
          f"with --no-probe {bare:.1f} s; `p2pfusion --version` alone {started:.1f} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as response:
        body = json.load(response)
    return time.perf_counter() - t0, body


async def dashboard(fleet, source, serving: set[str], screenshot: Path | None) -> None:
    port = _free_port()
    log = fleet.workdir / "api.log"
    join = [a for m in fleet.entry_points() for a in ("--initial-peers", m)]
    with open(log, "w") as err:
        api = await asyncio.create_subprocess_exec(
            *CLI, "api", "--model", str(source.folder), *join, "--port", str(port),
            stdout=asyncio.subprocess.DEVNULL, stderr=err,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + API_READY_WITHIN
        while not re.search(r"API at http://", log.read_text()):
            if api.returncode is not None or time.monotonic() > deadline:
                print(f"/v1/swarm: the API did not start (see {log})")
                return
            await asyncio.sleep(0.5)
        timed = [await asyncio.to_thread(_get, f"{url}/v1/swarm") for _ in range(VIEW_RUNS)]
        seconds = [t for t, _ in timed]
        listed = _listed(timed[-1][1])
        print(f"/v1/swarm: {1000 * min(seconds):.0f}-{1000 * max(seconds):.0f} ms over {VIEW_RUNS} requests, lists "
              f"{len(serving & listed)} of {len(serving)} serving peers ({len(listed)} records)")
        if screenshot is not None:
            await asyncio.to_thread(_screenshot, url, screenshot, len(listed))
    finally:
        if api.returncode is None:
            api.terminate()
        await api.wait()


def _screenshot(url: str, path: Path, rows: int) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            t0 = time.perf_counter()
            page.goto(url + "/swarm")
            page.wait_for_function(f"document.querySelectorAll('tr[data-peer-id]').length >= {rows}", timeout=60_000)
            shown = time.perf_counter() - t0
            page.screenshot(path=str(path), full_page=True)
        finally:
            browser.close()
    print(f"dashboard: {rows} peers' rows shown {shown:.1f} s after the page was opened; screenshot in {path}")
