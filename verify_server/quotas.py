"""Per-device quotas: open sessions, and tokens per second through the target.

A device's tokens per second is what its sessions cost the target: prompt tokens prefilled and
draft tokens verified (+1 for the token each pass adds, + SAT slots). It is a token bucket of
`rate` tokens/s holding `burst_s` seconds of them. Work starts while the bucket is not in debt
and is charged once known, so one long prompt goes through and the device's next work waits
for the debt to be repaid; when that wait would exceed `wait_s` the work is refused instead
(RESOURCE_EXHAUSTED, REASON_QUOTA), so a device over its rate is paced, and one far over it is
told so, while every other device's rounds go on.

    quotas = Quotas(sessions=4, tokens_per_s=200, burst_s=2, wait_s=2)
    quotas.open(identity)               # refuses a fifth open session of the same device
    await quotas.pace(identity, 37)     # waits (or refuses), then charges 37 tokens
    quotas.close(identity)
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from verify_server import errors
from verify_server.auth import Identity
from verify_server.errors import Reason


@dataclass(slots=True)
class TokenBucket:
    rate: float                          # tokens per second
    capacity: float                      # the most it holds (rate x burst seconds)
    level: float = field(default=-1.0)   # tokens it holds now; negative: in debt
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.level < 0:
            self.level = self.capacity

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_s(self, now: float) -> float:
        """Seconds until the bucket is out of debt."""
        self.refill(now)
        return max(0.0, -self.level / self.rate)

    def charge(self, tokens: int, now: float) -> None:
        self.refill(now)
        self.level -= tokens

    @property
    def full(self) -> bool:
        return self.level >= self.capacity


@dataclass(slots=True)
class Usage:
    """One device's open sessions and token bucket."""
    sessions: int = 0
    bucket: TokenBucket | None = None


class Quotas:
    """Owns every device's usage; a device's own quota (its token line) overrides the defaults.
    0 means no quota."""

    def __init__(self, sessions: int = 0, tokens_per_s: float = 0.0, burst_s: float = 2.0,
                 wait_s: float = 2.0) -> None:
        self.sessions, self.tokens_per_s = sessions, tokens_per_s
        self.burst_s, self.wait_s = burst_s, wait_s
        self.usage: dict[str, Usage] = {}

    def open(self, identity: Identity) -> None:
        """Count a session the device opens; RESOURCE_EXHAUSTED at its session quota."""
        usage = self.usage.setdefault(identity.key, Usage())
        limit = self._sessions_of(identity)
        if limit and usage.sessions >= limit:
            raise errors.exhausted(Reason.REASON_QUOTA, f"device {identity.device} has {limit} "
                                   f"sessions open, its quota: close one, or ask the server's "
                                   "operator for more (sessions=N on its token line)")
        usage.sessions += 1

    def close(self, identity: Identity) -> None:
        usage = self.usage.get(identity.key)
        if usage is not None:
            usage.sessions = max(0, usage.sessions - 1)
            self._forget_idle(identity.key)

    async def pace(self, identity: Identity, tokens: int) -> None:
        """Wait until the device's bucket is out of debt, then charge `tokens`; refuse the work
        when that wait would exceed wait_s."""
        bucket = self._bucket(identity)
        if bucket is None:
            return
        wait = bucket.wait_s(time.monotonic())
        if wait > self.wait_s:
            raise errors.exhausted(Reason.REASON_QUOTA, f"device {identity.device} is over its "
                                   f"quota of {bucket.rate:g} tokens/s (it would wait {wait:.1f} s"
                                   f" for {tokens} more): slow down, or retry in {wait:.0f} s")
        if wait > 0:
            await asyncio.sleep(wait)
        bucket.charge(tokens, time.monotonic())

    def _bucket(self, identity: Identity) -> TokenBucket | None:
        rate = identity.quota.tokens_per_s or self.tokens_per_s
        if not rate:
            return None
        usage = self.usage.setdefault(identity.key, Usage())
        if usage.bucket is None or usage.bucket.rate != rate:
            usage.bucket = TokenBucket(rate, rate * self.burst_s)
        return usage.bucket

    def _sessions_of(self, identity: Identity) -> int:
        return identity.quota.sessions or self.sessions

    def _forget_idle(self, key: str) -> None:
        """A device with no session and a full bucket needs no entry (bounded by live devices)."""
        usage = self.usage.get(key)
        if usage is not None and usage.sessions == 0:
            if usage.bucket is None or (usage.bucket.refill(time.monotonic()) or usage.bucket.full):
                del self.usage[key]
