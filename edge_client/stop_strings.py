"""Stop strings: bounded as OpenAI bounds them, and matched in time linear in the text.

A request names at most MAX_STOPS stop strings of at most MAX_STOP_CHARS characters each
(check_stops; OpenAI allows 4). StopStrings finds the first one in a text (str.find from where
a new one can begin) and how much of a text's end may be the start of one (KMP over the last
len(stop) - 1 characters, so a long stop costs its length per token, not its length squared):

    stops = StopStrings(["\\n\\n", "END"])
    stops.first("a\\n\\nb")     -> 1
    stops.held("done\\nEN")     -> 2 (the next token may finish "END")
"""
from __future__ import annotations

from collections.abc import Sequence

MAX_STOPS = 4
MAX_STOP_CHARS = 256


def check_stops(stops: Sequence[str]) -> None:
    """ValueError naming the bound a request's stop strings pass, if they pass one."""
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop strings (got {len(stops)})")
    for stop in stops:
        if len(stop) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters "
                             f"(got one of {len(stop)})")


class StopStrings:
    """The stop strings of one output (empty ones dropped), with each one's KMP failure table."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self.failures = [failure_table(stop) for stop in self.stops]
        self.longest = max(map(len, self.stops), default=0)

    def first(self, text: str, start: int = 0) -> int:
        """Where the earliest stop string begins in TEXT at or after START; -1 if none does."""
        found = [i for i in (text.find(stop, start) for stop in self.stops) if i >= 0]
        return min(found, default=-1)

    def held(self, text: str) -> int:
        """The length of the longest end of TEXT that is a proper prefix of a stop string (text
        that must wait: the next token may complete the stop)."""
        return max((_prefix_at_end(stop, failure, text) for stop, failure
                    in zip(self.stops, self.failures)), default=0)


def failure_table(pattern: str) -> list[int]:
    """KMP: for each i, the length of the longest proper prefix of pattern[:i + 1] that is also
    its suffix."""
    failure = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = failure[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        failure[i] = k
    return failure


def _prefix_at_end(stop: str, failure: list[int], text: str) -> int:
    """The longest proper prefix of STOP that TEXT ends with, read off the last len(stop) - 1
    characters in one KMP pass."""
    k = 0
    for char in text[max(0, len(text) - len(stop) + 1):]:
        while k and char != stop[k]:
            k = failure[k - 1]
        if char == stop[k]:
            k += 1
        if k == len(stop):       # a whole stop (found by first()): keep its longest border
            k = failure[k - 1]
    return k
