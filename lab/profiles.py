"""Device and link profiles for emulated devices: how long drafting takes on a board, and what
the network between a device and the server adds to every message (a Link; lab.link puts one
under a device session's stream).

Specs are a built-in name ("pi5", "wifi") or a name with overrides ("wifi:rtt_ms=20,jitter_ms=5").
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
from dataclasses import dataclass

from sled import clock


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    name: str
    draft_ms_per_token: float    # one drafted token on this board
    round_overhead_ms: float     # per round: feeding the verdict's tokens back, sampling, framing
    cpus: float = 0.0            # container CPU quota, in x86 server cores (0 = no quota)
    memory_mb: int = 0           # container memory limit (0 = no limit)
    core_speed: float = 1.0      # one of its cores against one x86 server core (see the notes)

    def __post_init__(self) -> None:
        if self.draft_ms_per_token < 0 or self.round_overhead_ms < 0:
            raise ValueError(f"device profile {self.name!r}: latencies must be >= 0")
        if self.cpus < 0 or self.memory_mb < 0:
            raise ValueError(f"device profile {self.name!r}: cpus and memory_mb must be >= 0")
        if not self.core_speed > 0:
            raise ValueError(f"device profile {self.name!r}: core_speed must be > 0")

    def cpus_on(self, host_cpus: int) -> float:
        """The quota a container can get on a host with host_cpus cores (Docker refuses more
        than the host has): cpus_on(2) of a 2.5-core profile is 2.0; 0 stays 0 (no quota)."""
        return min(self.cpus, float(host_cpus)) if self.cpus else 0.0

    def draft_seconds(self, draft_len: int) -> float:
        """Drafting draft_len tokens in one round: draft_seconds(4) on pi5 = (4 * 20 + 3) ms."""
        return (draft_len * self.draft_ms_per_token + self.round_overhead_ms) / 1e3


@dataclass(frozen=True, slots=True)
class LinkProfile:
    name: str
    rtt_ms: float          # the floor of a round trip; each direction takes half
    jitter_ms: float       # scale of the extra queueing delay added to each message (>= 0)
    bandwidth_mbps: float  # each direction; 0 = unlimited
    loss_pct: float = 0.0  # packets lost, percent (netem drops them; Link retransmits late)

    def __post_init__(self) -> None:
        if self.rtt_ms < 0 or self.jitter_ms < 0 or self.bandwidth_mbps < 0:
            raise ValueError(f"link profile {self.name!r}: rtt, jitter and bandwidth must be >= 0")
        if not 0.0 <= self.loss_pct <= 100.0:
            raise ValueError(f"link profile {self.name!r}: loss_pct must be within 0..100")

    def retransmit_s(self) -> float:
        """What a lost packet costs over TCP: one retransmission timeout, max(200 ms, 2 x rtt)
        (200 ms is Linux's minimum RTO)."""
        return max(0.2, 2 * self.rtt_ms / 1e3)


# Where the numbers come from:
# - draft_ms_per_token, round_overhead_ms: assumptions, not measurements on the boards: the
#   per-token latency of a ~270M-parameter Q4 drafter (Gemma 3 270M Q4_K_M on llama.cpp) with a
#   short context, and the per-round overhead on top. For scale, BENCHMARKS.md ("drafter") measured
#   the same GGUF drafter at 83.8 tok/s (12 ms per token) on 2 cores of an AMD EPYC VM.
# - cpus: the board's cores times an assumed per-core speed relative to one x86 server core (an
#   assumption from the cores' public clock and generation, not a benchmark): Cortex-A72 at
#   1.8 GHz ~0.3 of a server core, Cortex-A76 at 2.4 GHz ~0.6, Cortex-A78AE at 1.5 GHz ~0.55.
# - memory_mb: the public RAM size of the model named (pi4: the common 4 GB board; pi5: 8 GB;
#   Orin Nano 8 GB, shared between its CPU and GPU, so the whole of it is the drafter's ceiling).
DEVICES = {p.name: p for p in (
    # Raspberry Pi 4 Model B: 4x Cortex-A72 @ 1.8 GHz (public spec) -> 4 x 0.3 = 1.2 cores; 4 GB
    DeviceProfile("pi4", draft_ms_per_token=45.0, round_overhead_ms=6.0, cpus=1.2, memory_mb=4096,
                  core_speed=0.3),
    # Raspberry Pi 5: 4x Cortex-A76 @ 2.4 GHz (public spec) -> 4 x 0.6 = 2.4 cores; 8 GB
    DeviceProfile("pi5", draft_ms_per_token=20.0, round_overhead_ms=3.0, cpus=2.4, memory_mb=8192,
                  core_speed=0.6),
    # Jetson Orin Nano 8 GB: 6x Cortex-A78AE @ 1.5 GHz (public spec) -> 6 x 0.55 = 3.3 cores;
    # its GPU would draft faster than the CPU (the lower draft time assumes it does)
    DeviceProfile("orin-nano", draft_ms_per_token=8.0, round_overhead_ms=1.5, cpus=3.3,
                  memory_mb=8192, core_speed=0.55),
    # no board: drafting as fast as the host runs it, no container limits
    DeviceProfile("instant", draft_ms_per_token=0.0, round_overhead_ms=0.0),
)}

# Typical access links to a server on the same site (ethernet, wifi) or in a nearby cloud (lte).
# rtt_ms, jitter_ms, bandwidth_mbps: assumptions, typical figures rather than measurements: a
# switched gigabit LAN (sub-millisecond RTT), a Wi-Fi 5/6 cell shared by a few clients (a few ms
# RTT, ~100 Mbit/s usable), an LTE uplink to a regional cloud (tens of ms RTT, ~20 Mbit/s).
# loss_pct: assumptions, not measurements: a wired LAN loses next to nothing (0); a busy Wi-Fi
# cell ~0.5 % of packets after its own link-layer retries; LTE ~1 % at the cell edge.
LINKS = {p.name: p for p in (
    LinkProfile("loopback", rtt_ms=0.0, jitter_ms=0.0, bandwidth_mbps=0.0),
    LinkProfile("ethernet", rtt_ms=0.5, jitter_ms=0.1, bandwidth_mbps=1000.0, loss_pct=0.0),
    LinkProfile("wifi", rtt_ms=6.0, jitter_ms=2.0, bandwidth_mbps=100.0, loss_pct=0.5),
    LinkProfile("lte", rtt_ms=45.0, jitter_ms=10.0, bandwidth_mbps=20.0, loss_pct=1.0),
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
            changes[key] = type(getattr(profile, key))(float(value))   # memory_mb stays an int
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
    messages arrives at the link's rate, not one latency apart. A lost packet (probability
    loss_pct/100 per message, from its own seeded stream) is not dropped, as TCP does not drop
    it: the message arrives one retransmission timeout later (LinkProfile.retransmit_s).
    """

    def __init__(self, profile: LinkProfile, seed: int = 0) -> None:
        self.profile = profile
        self.random = random.Random(seed)
        self.loss_random = random.Random(f"loss-{seed}")   # the jitter draws stay as they were
        self._last_arrival = {"up": 0.0, "down": 0.0}   # perf_counter seconds

    def arrival(self, direction: str, sent_at: float, nbytes: int) -> float:
        """When a message of nbytes sent at sent_at (clock.now() seconds) arrives."""
        p = self.profile
        jitter = abs(self.random.gauss(0.0, p.jitter_ms)) if p.jitter_ms else 0.0
        wire = nbytes * 8 / (p.bandwidth_mbps * 1e6) if p.bandwidth_mbps else 0.0
        lost = p.loss_pct and self.loss_random.random() * 100 < p.loss_pct
        resend = p.retransmit_s() if lost else 0.0
        at = max(sent_at + (p.rtt_ms / 2 + jitter) / 1e3 + wire + resend,
                 self._last_arrival[direction] + wire)
        self._last_arrival[direction] = at
        return at

    async def uplink(self, nbytes: int) -> None:
        """Device -> server: await before writing a message of nbytes."""
        await _sleep_until(self.arrival("up", clock.now(), nbytes))

    async def downlink(self, nbytes: int, received_at: float | None = None) -> None:
        """Server -> device: await after reading a message of nbytes; received_at is when the
        local stack took it (default: now)."""
        sent_at = clock.now() if received_at is None else received_at
        await _sleep_until(self.arrival("down", sent_at, nbytes))


async def _sleep_until(at: float) -> None:
    while (delay := at - clock.now()) > 0:
        await asyncio.sleep(delay)
