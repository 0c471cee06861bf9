"""How long to wait before reading on from a source that keeps sending what must be refused (pure).

One refusal costs an honest client nothing, but refusing is work: a peer must read (and decrypt)
a malformed tensor's body to stay in step with its stream, and the HTTP API accepts a connection
and parses a request before it can refuse a 40 MiB body. A source that sends such things as fast
as they are answered (2 MiB tensor bodies back to back, or thousands of oversized requests a
second) takes a core from everyone else. So each refusal earns its source a pause: none for the
first FREE_REFUSALS, then doubling from FIRST_PAUSE up to LONGEST_PAUSE; the count halves every
REFUSAL_HALF_LIFE seconds. A peer waits that long before reading the stream that sent a bad tensor
again (the sender's writes stop at its TCP window: what is not read is not decrypted); the API,
before it handles the source's next request.
"""

from __future__ import annotations

from collections import OrderedDict

FREE_REFUSALS = 3
FIRST_PAUSE = 0.05  # seconds, after the first refusal past the free ones
LONGEST_PAUSE = 2.0
REFUSAL_HALF_LIFE = 30.0
SOURCES_KEPT = 4096  # the sources remembered, the most recent ones


def pause_for(count: float) -> float:
    """Seconds to wait before reading on, for a source with `count` recent refusals."""
    if count <= FREE_REFUSALS:
        return 0.0
    return min(LONGEST_PAUSE, FIRST_PAUSE * 2 ** (count - FREE_REFUSALS - 1))


class Refusals:
    """Each source's recent refusals, decaying with time; `now` is monotonic seconds."""

    def __init__(self) -> None:
        self._counts: OrderedDict[str, tuple[float, float]] = OrderedDict()  # source -> (count, when)

    def add(self, source: str, now: float) -> float:
        """Count one more refusal of `source`'s, and say how long to wait before reading it again."""
        count = self._count(source, now) + 1
        self._counts.pop(source, None)
        self._counts[source] = (count, now)
        while len(self._counts) > SOURCES_KEPT:
            self._counts.popitem(last=False)
        return pause_for(count)

    def pause(self, source: str, now: float) -> float:
        """How long `source`'s recent refusals earn it now."""
        return pause_for(self._count(source, now))

    def _count(self, source: str, now: float) -> float:
        count, at = self._counts.get(source, (0.0, now))
        return count * 0.5 ** ((now - at) / REFUSAL_HALF_LIFE)
