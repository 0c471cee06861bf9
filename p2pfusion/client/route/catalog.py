"""Which models a swarm serves, and a clear error for a client whose model is not among them.

Peers and clients meet under a model's swarm key, derived from its weights, so a client with other
weights (another fine-tune, another quantization, a different model of the same name) finds no
record at all. That is worth telling apart from missing layers: the user picked the wrong model.
"""

from __future__ import annotations

from p2pfusion.dht.records import ModelEntry, PeerRecord
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.errors import RouteError


def describe(entries: list[ModelEntry]) -> str:
    return ", ".join(f"{e.name} (key {e.key}, {e.num_layers} layers)" for e in entries) or "no model at all"


def absent_model(name: str, key: str, served: list[ModelEntry]) -> RouteError:
    return RouteError(f"the swarm serves no model with the weights of {name} ({key}); it serves: {describe(served)}")


async def model_records(swarm: SwarmNode, key: str, name: str) -> list[PeerRecord]:
    """The records of the model whose swarm key is `key` (`name` is for people); when the swarm has
    none, in any state, a RouteError naming the models it does serve."""
    records = await swarm.lookup(key)
    if records:
        return records
    raise absent_model(name, key, await swarm.models())
