"""How long a peer waits before reading on from a source that keeps sending bad tensors (pure).

A malformed tensor costs only its step, so that one mistake of an honest client loses nothing. But
the peer must read (and decrypt) each such frame's body to stay in step with the stream, and a
source that sends them as fast as the peer answers (2 MiB bodies back to back, on a few streams)
takes a core from everyone the peer serves. So each bad tensor from a source earns a pause before
its stream is read again: none for the first FREE_BAD_TENSORS, then doubling up to LONGEST_PAUSE.
What the peer does not read it does not decrypt: the sender's writes stop at the peer's TCP
window. A source's count halves every BAD_TENSOR_HALF_LIFE seconds without one.
"""

from __future__ import annotations

from collections import OrderedDict

FREE_BAD_TENSORS = 3
FIRST_PAUSE = 0.05  # seconds, after the first bad tensor past the free ones
LONGEST_PAUSE = 2.0
BAD_TENSOR_HALF_LIFE = 30.0
SOURCES_KEPT = 4096  # the sources remembered, the most recent ones


def pause_for(count: float) -> float:
    """Seconds to wait before reading on, for a source with `count` recent bad tensors."""
    if count <= FREE_BAD_TENSORS:
        return 0.0
    return min(LONGEST_PAUSE, FIRST_PAUSE * 2 ** (count - FREE_BAD_TENSORS - 1))


class BadTensorCounts:
    """Each source's recent bad tensors, decaying with time."""

    def __init__(self) -> None:
        self._counts: OrderedDict[str, tuple[float, float]] = OrderedDict()  # source -> (count, when)

    def pause(self, source: str, now: float) -> float:
        """Count one more bad tensor from `source` at `now` (seconds, monotonic), and say how long
        to wait before reading its stream again."""
        count, at = self._counts.pop(source, (0.0, now))
        count = count * 0.5 ** ((now - at) / BAD_TENSOR_HALF_LIFE) + 1
        self._counts[source] = (count, now)
        while len(self._counts) > SOURCES_KEPT:
            self._counts.popitem(last=False)
        return pause_for(count)
