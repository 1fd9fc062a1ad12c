"""Device and link profiles for emulated devices: how long drafting takes on a board, and what
the network between a device and the server adds to every message (a Link; lab.link puts one
under a device session's stream).

Specs are a built-in name ("pi5", "wifi") or a name with overrides ("wifi:rtt_ms=20,jitter_ms=5").
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    name: str
    draft_ms_per_token: float    # one drafted token on this board
    round_overhead_ms: float     # per round: feeding the verdict's tokens back, sampling, framing

    def __post_init__(self) -> None:
        if self.draft_ms_per_token < 0 or self.round_overhead_ms < 0:
            raise ValueError(f"device profile {self.name!r}: latencies must be >= 0")

    def draft_seconds(self, draft_len: int) -> float:
        """Drafting draft_len tokens in one round: draft_seconds(4) on pi5 = (4 * 20 + 3) ms."""
        return (draft_len * self.draft_ms_per_token + self.round_overhead_ms) / 1e3


@dataclass(frozen=True, slots=True)
class LinkProfile:
    name: str
    rtt_ms: float          # the floor of a round trip; each direction takes half
    jitter_ms: float       # scale of the extra queueing delay added to each message (>= 0)
    bandwidth_mbps: float  # each direction; 0 = unlimited

    def __post_init__(self) -> None:
        if self.rtt_ms < 0 or self.jitter_ms < 0 or self.bandwidth_mbps < 0:
            raise ValueError(f"link profile {self.name!r}: rtt, jitter and bandwidth must be >= 0")


# Assumptions, not measurements: per-token latency of a ~270M-parameter Q4 drafter
# (Gemma 3 270M Q4_K_M on llama.cpp) with a short context, and the per-round overhead on top.
DEVICES = {p.name: p for p in (
    DeviceProfile("pi4", draft_ms_per_token=45.0, round_overhead_ms=6.0),
    DeviceProfile("pi5", draft_ms_per_token=20.0, round_overhead_ms=3.0),
    DeviceProfile("orin-nano", draft_ms_per_token=8.0, round_overhead_ms=1.5),
    DeviceProfile("instant", draft_ms_per_token=0.0, round_overhead_ms=0.0),
)}

# Typical access links to a server on the same site (ethernet, wifi) or in a nearby cloud (lte).
LINKS = {p.name: p for p in (
    LinkProfile("loopback", rtt_ms=0.0, jitter_ms=0.0, bandwidth_mbps=0.0),
    LinkProfile("ethernet", rtt_ms=0.5, jitter_ms=0.1, bandwidth_mbps=1000.0),
    LinkProfile("wifi", rtt_ms=6.0, jitter_ms=2.0, bandwidth_mbps=100.0),
    LinkProfile("lte", rtt_ms=45.0, jitter_ms=10.0, bandwidth_mbps=20.0),
)}


def _parse(spec: str, table: dict, kind: str):
    """"name" or "name:field=value,...": a built-in profile, with fields overridden."""
    name, _, overrides = spec.partition(":")
    if name not in table:
        raise ValueError(f"unknown {kind} profile {name!r}; built-in: {', '.join(table)}")
    profile = table[name]
    if not overrides:
        return profile
    fields = {f.name for f in dataclasses.fields(profile)} - {"name"}
    changes = {}
    for item in overrides.split(","):
        key, _, value = item.partition("=")
        if key not in fields:
            raise ValueError(f"bad {kind} profile {spec!r}: {key!r} is not one of {', '.join(sorted(fields))}")
        try:
            changes[key] = float(value)
        except ValueError:
            raise ValueError(f"bad {kind} profile {spec!r}: {key} needs a number") from None
    return dataclasses.replace(profile, name=spec, **changes)


def device_profile(spec: str) -> DeviceProfile:
    return _parse(spec, DEVICES, "device")


def link_profile(spec: str) -> LinkProfile:
    return _parse(spec, LINKS, "link")


class Link:
    """One device's network path: each message waits rtt/2, a jitter draw and its serialisation.

    Jitter is half-normal with scale jitter_ms (seeded), so a message never arrives sooner than
    rtt/2 after it was sent and a round trip never takes less than rtt. Each direction is FIFO,
    like the TCP stream under gRPC: a message never overtakes the one before it, and a stream of
    messages arrives at the link's rate, not one latency apart.
    """

    def __init__(self, profile: LinkProfile, seed: int = 0) -> None:
        self.profile = profile
        self.random = random.Random(seed)
        self._last_arrival = {"up": 0.0, "down": 0.0}   # perf_counter seconds

    def arrival(self, direction: str, sent_at: float, nbytes: int) -> float:
        """When a message of nbytes sent at sent_at (perf_counter seconds) arrives."""
        p = self.profile
        jitter = abs(self.random.gauss(0.0, p.jitter_ms)) if p.jitter_ms else 0.0
        wire = nbytes * 8 / (p.bandwidth_mbps * 1e6) if p.bandwidth_mbps else 0.0
        at = max(sent_at + (p.rtt_ms / 2 + jitter) / 1e3 + wire, self._last_arrival[direction] + wire)
        self._last_arrival[direction] = at
        return at

    async def uplink(self, nbytes: int) -> None:
        """Device -> server: await before writing a message of nbytes."""
        await _sleep_until(self.arrival("up", time.perf_counter(), nbytes))

    async def downlink(self, nbytes: int, received_at: float | None = None) -> None:
        """Server -> device: await after reading a message of nbytes; received_at is when the
        local stack took it (default: now)."""
        sent_at = time.perf_counter() if received_at is None else received_at
        await _sleep_until(self.arrival("down", sent_at, nbytes))


async def _sleep_until(at: float) -> None:
    while (delay := at - time.perf_counter()) > 0:
        await asyncio.sleep(delay)
