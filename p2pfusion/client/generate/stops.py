"""Stop strings: a generation's text ends before the first of them, as OpenAI's `stop` ends it.

Text streams out as tokens come, so the end of the text so far is held back while it could still
be the start of a stop string: a reader never sees text that the next token turns into one.
"""

from __future__ import annotations

from collections.abc import Sequence


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first place any stop string starts (all of it when none occurs)."""
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return text[:min(found)] if found else text


class StopText:
    """A text given piece by piece; `add` returns what may be shown of it now."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [stop for stop in stops if stop]
        self.held = ""  # the end of the text given so far that may begin a stop string
        self.stopped = False  # a stop string occurred: nothing more is shown

    def add(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self.held + piece
        cut = cut_at_stop(text, self.stops)
        if len(cut) < len(text):
            self.held, self.stopped = "", True
            return cut
        keep = max((n for stop in self.stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]
