"""Loose verification settings, as a device asks for them and the server checks them.

Opt-in per greedy session and NOT lossless (FLy, training-free loosely speculative decoding): a
draft token that is not the target's own is still accepted when the target was unsure there (the
entropy of its three most likely tokens, renormalized, is above `entropy` nats) and the next
window - 1 draft tokens are each the target's own after it. The server applies it
(verify_server.acceptance.verify_greedy); every verdict counts the tokens kept that way.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

MAX_WINDOW = 16
MAX_ENTROPY = math.log(3)   # three equally likely tokens


def as_float32(value: float) -> float:
    """value as a float32 field carries it: as_float32(1.09861228) == 1.0986123085021973."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf


@dataclass(frozen=True, slots=True)
class Loose:
    window: int = 2
    entropy: float = 0.5

    def problem(self, greedy: bool = True) -> str | None:
        """What is out of range, in words, or what a request with these settings may not do
        (greedy: whether it is a greedy one); None when the settings are usable."""
        if not greedy:
            return "loose verification is for greedy sessions (temperature 0) only"
        if not 1 <= self.window <= MAX_WINDOW:
            return f"loose window must be 1 to {MAX_WINDOW}, got {self.window}"
        sent = as_float32(self.entropy)    # what the wire carries, and the server checks
        if not (math.isfinite(sent) and 0.0 < sent < MAX_ENTROPY):
            return (f"loose entropy must be above 0 and below ln 3 = {MAX_ENTROPY:.4f} nats "
                    f"(the most three tokens can have), got {self.entropy:g}")
        return None

    @classmethod
    def parse(cls, text: str) -> "Loose":
        """"WINDOW:ENTROPY" (e.g. "2:0.5") -> Loose; ValueError naming what is wrong."""
        window, sep, entropy = text.partition(":")
        try:
            loose = cls(int(window), float(entropy)) if sep else cls(int(window))
        except ValueError:
            raise ValueError(f"loose {text!r}: use WINDOW:ENTROPY, e.g. 2:0.5") from None
        problem = loose.problem()
        if problem is not None:
            raise ValueError(problem)
        return loose

    def to_proto(self, msg) -> None:
        """Fill a sled.v1.LooseVerification."""
        msg.window, msg.entropy = self.window, self.entropy

    @classmethod
    def from_proto(cls, msg) -> "Loose":
        return cls(msg.window, msg.entropy)
