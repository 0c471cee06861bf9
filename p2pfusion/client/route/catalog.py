"""Which models a swarm serves, and a clear error for a client whose model is not among them.

Peers and clients meet under a model's swarm key, derived from its weights, so a client with other
weights (another fine-tune, another quantization, a different model of the same name) finds no
record at all. That is worth telling apart from missing layers: the user picked the wrong model.
"""

from __future__ import annotations

import asyncio

from p2pfusion.dht.records import ModelEntry, PeerRecord
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.errors import RouteError

# reads of a model's records while the swarm still lists the model: a read that found nothing may
# have timed out on a busy DHT (seen with 60 nodes and a fifth of them restarting every minute)
RECORD_READS = 3
REREAD_PAUSE = 1.0  # seconds


def describe(entries: list[ModelEntry]) -> str:
    return ", ".join(f"{e.name} (key {e.key}, {e.num_layers} layers)" for e in entries) or "no model at all"


def absent_model(name: str, key: str, served: list[ModelEntry]) -> RouteError:
    return RouteError(f"the swarm serves no model with the weights of {name} ({key}); it serves: {describe(served)}")


async def model_records(swarm: SwarmNode, key: str, name: str) -> list[PeerRecord]:
    """The records of the model whose swarm key is `key` (`name` is for people); when the swarm has
    none, in any state, a RouteError naming the models it does serve. While the swarm lists the
    model, or lists nothing (its read may have timed out too), an empty read is read again: it
    says the DHT was slow, not that the model is gone."""
    for read in range(RECORD_READS):
        records = await swarm.lookup(key)
        if records:
            return records
        served = await swarm.models()
        if served and all(entry.key != key for entry in served):
            raise absent_model(name, key, served)
        if read + 1 < RECORD_READS:
            await asyncio.sleep(REREAD_PAUSE)
    if not served:
        raise absent_model(name, key, served)
    raise RouteError(
        f"the swarm lists {name} ({key}), but {RECORD_READS} reads of its peers' records found none: "
        "the DHT is slow to answer, or its peers have just left; try again"
    )
