"""A DHT node's local storage with caps, so that a flood of records fills a bounded space.

hivemind's storage keeps every record it is asked to store until it expires. Here a key holds at
most `per_key` subkeys and the node at most `total` entries in all; a full key or node refuses new
subkeys, while updates of a subkey it holds always pass, so peers already listed keep refreshing
their records through a flood. Every record of this swarm is a subkey (the validator refuses
plain values), so plain values are refused here too.
"""

from __future__ import annotations

from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue

MAX_SUBKEYS = 256  # per key: peers of one model, reports against one model
MAX_ENTRIES = 16_384  # per node; with values of at most a few KB, some tens of MB at worst


class CappedStorage(DHTLocalStorage):
    def __init__(self, per_key: int = MAX_SUBKEYS, total: int = MAX_ENTRIES):
        super().__init__()
        self.per_key, self.total = per_key, total

    def entries(self) -> int:
        return sum(len(item.value) for _, item in self.items() if isinstance(item.value, DictionaryDHTValue))

    def store(self, key: DHTID, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        if not isinstance(value, DictionaryDHTValue):
            return False
        # a whole dictionary: what a search found (hivemind caches it), merged from several nodes
        stored = [self.store_subkey(key, s, item.value, item.expiration_time) for s, item in value.items()]
        return any(stored)

    def store_subkey(self, key: DHTID, subkey: Any, value: bytes, expiration_time: float) -> bool:
        held = self.get(key)
        subkeys = held.value if held is not None and isinstance(held.value, DictionaryDHTValue) else None
        is_new = subkeys is None or subkey not in subkeys.data
        if is_new and subkeys is not None and len(subkeys) >= self.per_key:
            return False
        if is_new and self.entries() >= self.total:
            return False
        return super().store_subkey(key, subkey, value, expiration_time)
