"""Stop strings: a generation's text ends before the first of them, as OpenAI's `stop` ends it.

Text streams out as tokens come, so the end of the text so far is held back while it could still
be the start of a stop string: a reader never sees text that the next token turns into one. Each
stop string's match is followed character by character (Knuth–Morris–Pratt), so a token costs the
length of its text, not of the stop strings; requests carry at most MAX_STOPS of at most
MAX_STOP_CHARS characters each, so what is held back stays small.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOPS = 4  # stop strings per request, as OpenAI's API
MAX_STOP_CHARS = 512  # characters per stop string


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first place any stop string starts (all of it when none occurs)."""
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return text[:min(found)] if found else text


def _failure(stop: str) -> list[int]:
    """KMP's failure function: for each prefix length n, the longest proper border of stop[:n]."""
    border = [0] * (len(stop) + 1)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = border[k]
        if stop[i] == stop[k]:
            k += 1
        border[i + 1] = k
    return border


class _Matcher:
    """How much of one stop string the text given so far ends with."""

    def __init__(self, stop: str):
        self.stop = stop
        self.border = _failure(stop)
        self.matched = 0  # characters of `stop` the text ends with

    def feed(self, text: str) -> bool:
        """Follow `text`; True once the whole stop string occurred."""
        stop, border, k = self.stop, self.border, self.matched
        for char in text:
            while k and char != stop[k]:
                k = border[k]
            if char == stop[k]:
                k += 1
                if k == len(stop):
                    self.matched = k
                    return True
        self.matched = k
        return False


class StopText:
    """A text given piece by piece; `add` returns what may be shown of it now."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [stop for stop in stops if stop]
        self._matchers = [_Matcher(stop) for stop in self.stops]
        self.held = ""  # the end of the text given so far that may begin a stop string
        self.stopped = False  # a stop string occurred: nothing more is shown

    def add(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self.held + piece
        if any([matcher.feed(piece) for matcher in self._matchers]):
            # the held text and the piece hold the occurrence: the first to start ends the text
            self.held, self.stopped = "", True
            return cut_at_stop(text, self.stops)
        keep = max((matcher.matched for matcher in self._matchers), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]
