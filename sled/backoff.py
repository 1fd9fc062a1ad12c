"""sled's one backoff: the delays between attempts at something that may come back (a lost
verify server, a server busy sending its tokenizer, the MQTT broker for a device and a server).

    pauses = Backoff(0.05, most=2.0)
    while not await try_once():
        await pauses.wait()              # 0.05, 0.1, 0.2, ... 2.0, 2.0 s

Each delay is `factor` times the last, from `first` up to `most`; `jitter` spreads each one
evenly within that fraction of its value (0: exactly). A refused attempt (the broker refusing
the credentials: retrying fast cannot help) waits at least `after_refusal`. An instance serves
sled.mqtt.MqttConnection as its backoff (next(refused), reset()); broker_backoff() is its
default.
"""
from __future__ import annotations

import asyncio
import math
import random


class Backoff:
    def __init__(self, first: float, *, factor: float = 2.0, most: float = math.inf,
                 jitter: float = 0.0, after_refusal: float = 0.0) -> None:
        self.first, self.factor, self.most = first, factor, most
        self.jitter, self.after_refusal = jitter, after_refusal
        self.current = first             # the next delay, before its jitter

    def next(self, refused: bool = False) -> float:
        """The next delay (jittered, at least after_refusal when refused); the one after it
        grows by factor, up to most."""
        delay = self.current * random.uniform(1 - self.jitter, 1 + self.jitter) if self.jitter \
            else self.current
        self.current = min(self.current * self.factor, self.most)
        return max(delay, self.after_refusal) if refused else delay

    async def wait(self, refused: bool = False) -> None:
        """Sleep the next delay."""
        await asyncio.sleep(self.next(refused))

    def reset(self) -> None:
        """Start again from first (the thing came back)."""
        self.current = self.first


def broker_backoff() -> Backoff:
    """Between attempts at the MQTT broker: 0.5 s doubling to 30 s, each within 20%, and 30 s
    after refused credentials."""
    return Backoff(0.5, most=30.0, jitter=0.2, after_refusal=30.0)
