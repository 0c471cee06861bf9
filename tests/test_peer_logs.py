"""What a volunteer reads in a peer's log: a periodic line on what it served, a client that went away
as one INFO line (not an ERROR with a traceback), and no progress-bar fragments."""

import asyncio
import logging
import re
import subprocess
import sys
import time

import pytest
import uvloop

from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.peer.upkeep import Upkeep
from tests.swarm import running_peers

# A client that sends steps and dies before their results come back, as a killed `infer` does.
DYING_CLIENT = """
import os, sys, uvloop
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import resolve_model

async def main():
    model = RemoteCausalLM.build(resolve_model(sys.argv[1]), await join_swarm([sys.argv[2]], client_mode=True))
    session = (await model.open_session(64)).session
    for _ in range(5):
        await session.submit(model.embed(list(range(1, 9))))
    os._exit(0)

uvloop.run(main())
"""


@pytest.mark.slow  # three processes start: two peers and the client
def test_a_client_that_dies_mid_session_is_one_info_line(tiny_models, forks):
    folder = str(tiny_models["llama"].folder)
    with LocalSwarm(model=folder, forks=forks) as swarm:
        first = swarm.launch((0, 2), ["--throughput", "100"])
        swarm.wait_ready(first)
        swarm.wait_ready(swarm.launch((2, 4), ["--throughput", "100"]))
        subprocess.run([sys.executable, "-c", DYING_CLIENT, folder, swarm.maddrs[0]], check=True, timeout=120)
        # the first peer sees its client's stream end without a close; the last may also fail to
        # write a result to the client's output stream, whichever comes first
        first_log = swarm.workdir / "peer0.log"
        deadline = time.monotonic() + 30
        while "went away" not in first_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
    logs = [(swarm.workdir / f"peer{i}.log").read_text() for i in range(2)]
    for log in logs:
        assert "Traceback" not in log and " ERROR " not in log, log
        assert "\r" not in log and "%|" not in log  # no progress bars in a log file
    went_away = [line for log in logs for line in log.splitlines() if "a client went away mid-session" in line]
    assert 1 <= len(went_away) <= 2 and all(" INFO " in line for line in went_away), logs


async def _served_and_reported(source):
    async with running_peers(source, [(0, 2), (2, 4)], report_period=0.3) as (peers, maddrs):
        async with Upkeep(peers[0]):
            swarm = await join_swarm(maddrs, client_mode=True)
            try:
                result = await RemoteCausalLM.build(source, swarm).generate([3, 17, 42, 99], 5, stop_at_eos=False, decode=False)
            finally:
                await swarm.shutdown()
            await asyncio.sleep(0.7)
    return result


def test_a_serving_peer_reports_what_it_served(tiny_models, caplog):
    with caplog.at_level(logging.INFO, logger="p2pfusion.peer.upkeep"):
        result = uvloop.run(_served_and_reported(tiny_models["llama"]))
    pattern = re.compile(
        r"layers 0:2: (\d+) sessions open, (\d+) opened and (\d+) tokens served in the last \d+ s \([\d.]+ tokens/s\); "
        r"since start, (\d+) of (\d+) queued steps ran in (\d+) batches, (\d+) steps of clients' cohorts$"
    )
    reports = [pattern.match(r.getMessage()) for r in caplog.records if r.name == "p2pfusion.peer.upkeep"]
    assert reports and all(reports), [r.getMessage() for r in caplog.records]
    assert sum(int(report[2]) for report in reports) == 1
    assert sum(int(report[3]) for report in reports) == 4 + len(result.token_ids) - 1  # the prompt, then one by one
    assert int(reports[-1][1]) == 0  # the session closed
    assert int(reports[-1][4]) == 0 and int(reports[-1][6]) == 0 and int(reports[-1][7]) == 0  # one session: alone
