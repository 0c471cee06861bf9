"""Which models a swarm serves, and a clear error for a client whose model is not among them.

Peers and clients meet under a model's swarm key, derived from its weights, so a client with other
weights (another fine-tune, another quantization, a different model of the same name) finds no
record at all. That is worth telling apart from missing layers: the user picked the wrong model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from p2pfusion.dht.records import ModelEntry, PeerRecord
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.errors import RouteError

log = logging.getLogger(__name__)

# reads of a model's records before a client with no sign of the model gives up: a read that found
# nothing may have timed out on a busy DHT (seen with 60 nodes and a fifth of them restarting
# every minute)
RECORD_READS = 3
# seconds a client keeps reading while the swarm lists the model or this node found its records
# lately: the model is served, so an empty read says the DHT is slow (two of 22 generations failed
# on three empty reads in a row under that churn, docs/benchmarks.md)
RECORD_PATIENCE = 60.0
REREAD_PAUSE = 1.0  # seconds before the first read again, doubling up to MAX_REREAD_PAUSE
MAX_REREAD_PAUSE = 8.0
# A read slower than RECENT_WAIT seconds (p99 1.7 s from a fresh client of a 60-node swarm, several
# times that while frozen nodes hold traversals up) is not waited for when this node found the
# model's records within RECENT_RECORDS seconds (a record's TTL): those stand in for it, and the read
# goes on to refresh them. Every record is pinged before a route uses it, so a dead peer among them
# costs a ping, and a moved one a refused opening.
RECENT_WAIT = 2.0
RECENT_RECORDS = 30.0


def describe(entries: list[ModelEntry]) -> str:
    return ", ".join(f"{e.name} (key {e.key}, {e.num_layers} layers)" for e in entries) or "no model at all"


def absent_model(name: str, key: str, served: list[ModelEntry]) -> RouteError:
    return RouteError(f"the swarm serves no model with the weights of {name} ({key}); it serves: {describe(served)}")


async def model_records(
    swarm: SwarmNode, key: str, name: str, notice: Callable[[str], None] = log.warning
) -> list[PeerRecord]:
    """The records of the model whose swarm key is `key` (`name` is for people); when the swarm has
    none, in any state, a RouteError naming the models it does serve. A slow read may give way to
    recent records (RECENT_WAIT). An empty read is read again:
    for up to RECORD_PATIENCE seconds (saying so through `notice`) while the swarm lists the model
    or this node found its records lately, else RECORD_READS times (the list may have timed out too)."""
    deadline = time.monotonic() + RECORD_PATIENCE
    pause = REREAD_PAUSE
    read, known, told = 0, False, False
    recent = swarm.recent(key, RECENT_RECORDS)
    while True:
        reading = asyncio.ensure_future(swarm.lookup(key))
        if recent:
            await asyncio.wait({reading}, timeout=RECENT_WAIT)
            if not reading.done():
                return recent
        records = await reading
        if records:
            return records
        read += 1
        served = await swarm.models()
        known = known or any(entry.key == key for entry in served) or swarm.found_lately(key)
        if served and not known:
            raise absent_model(name, key, served)
        if (time.monotonic() + pause > deadline) if known else read >= RECORD_READS:
            break
        if known and not told:
            told = True
            notice(f"a read of {name}'s peers found none while the model is served: reading again for up to "
                   f"{RECORD_PATIENCE:.0f} s (the DHT is slow to answer)")
        await asyncio.sleep(pause)
        pause = min(2 * pause, MAX_REREAD_PAUSE)
    if not known:
        raise absent_model(name, key, served)
    raise RouteError(
        f"the swarm lists {name} ({key}), but reads of its peers' records found none for {RECORD_PATIENCE:.0f} s: "
        "the DHT is slow to answer, or its peers have just left; try again"
    )
