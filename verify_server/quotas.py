"""Per-device quotas: open sessions, and tokens per second through the target.

A device's tokens per second is what its sessions cost the target: prompt tokens prefilled and
draft tokens verified (+1 for the token each pass adds, + SAT slots). It is a token bucket of
`rate` tokens/s holding `burst_s` seconds of them. Work waits until the bucket holds what it
costs (a bucket holds at most its capacity: larger work waits for a full one), then is charged;
when that wait would exceed `wait_s` the work is refused instead (RESOURCE_EXHAUSTED,
REASON_QUOTA), and work larger than the bucket can ever pay within the wait
(capacity + rate x wait_s) is refused when its session opens, before it takes any KV. So a
device over its rate is paced, one far over it is told so, and every other device's rounds go on.

    quotas = Quotas(sessions=4, tokens_per_s=200, burst_s=2, wait_s=2)
    quotas.open(identity, prompt_tokens=120)   # refuses a fifth session, or an 800-token prompt
    await quotas.pace(identity, 37)            # waits (or refuses), then charges 37 tokens
    quotas.close(identity)
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from sled import clock
from verify_server import errors
from verify_server.auth import Identity
from verify_server.errors import Reason

SWEEP_AT = 1024      # idle devices' entries are swept once this many are kept


@dataclass(slots=True)
class TokenBucket:
    rate: float                              # tokens per second
    capacity: float                          # the most it holds (rate x burst seconds)
    level: float | None = None               # tokens it holds now (None: full); < 0: in debt
    stamp: float = field(default_factory=clock.now)

    def __post_init__(self) -> None:
        if self.level is None:
            self.level = self.capacity

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_s(self, tokens: float, now: float) -> float:
        """Seconds until the bucket holds `tokens` (at most its capacity)."""
        self.refill(now)
        return max(0.0, (min(tokens, self.capacity) - self.level) / self.rate)

    def charge(self, tokens: int, now: float) -> None:
        self.refill(now)
        self.level -= tokens

    def retune(self, rate: float, capacity: float, now: float) -> None:
        """A new rate (the token file re-read): what the bucket holds carries over."""
        self.refill(now)
        self.rate, self.capacity, self.level = rate, capacity, min(self.level, capacity)

    def full(self, now: float) -> bool:
        self.refill(now)
        return self.level >= self.capacity


@dataclass(slots=True)
class Usage:
    """One device's open sessions and token bucket."""
    sessions: int = 0
    bucket: TokenBucket | None = None


class Quotas:
    """Owns every device's usage; a device's own quota (its token line) overrides the defaults.
    0 means no quota. `host_sessions` holds callers that only their host tells apart (no token,
    no certificate: a NAT's devices share it); None: as `sessions`."""

    def __init__(self, sessions: int = 0, tokens_per_s: float = 0.0, burst_s: float = 2.0,
                 wait_s: float = 2.0, host_sessions: int | None = None) -> None:
        self.sessions, self.tokens_per_s = sessions, tokens_per_s
        self.host_sessions = sessions if host_sessions is None else host_sessions
        self.burst_s, self.wait_s = burst_s, wait_s
        self.usage: dict[str, Usage] = {}

    def open(self, identity: Identity, prompt_tokens: int = 0) -> None:
        """Count a session the device opens; RESOURCE_EXHAUSTED at its session quota, or for a
        prompt its tokens/s quota can never take."""
        if len(self.usage) >= SWEEP_AT:
            self.sweep()
        self._check_size(identity, prompt_tokens)
        usage = self.usage.setdefault(identity.key, Usage())
        limit = identity.quota.sessions or self.sessions_of(identity)
        if limit and usage.sessions >= limit:
            raise errors.exhausted(Reason.REASON_QUOTA, f"device {identity.device} has {limit} "
                                   f"sessions open, its quota: close one, or ask the server's "
                                   "operator for more (sessions=N on its token line)")
        usage.sessions += 1

    def sessions_of(self, identity: Identity) -> int:
        """The default session quota of a caller: a device's, or its host's."""
        return self.sessions if identity.authenticated else self.host_sessions

    def close(self, identity: Identity) -> None:
        usage = self.usage.get(identity.key)
        if usage is not None:
            usage.sessions = max(0, usage.sessions - 1)

    async def pace(self, identity: Identity, tokens: int) -> None:
        """Wait until the device's bucket holds `tokens` (or is full), then charge them; refuse
        the work when that wait would exceed wait_s."""
        bucket = self._bucket(identity)
        if bucket is None:
            return
        wait = bucket.wait_s(tokens, clock.now())
        if wait > self.wait_s:
            raise errors.exhausted(Reason.REASON_QUOTA, f"device {identity.device} is over its "
                                   f"quota of {bucket.rate:g} tokens/s ({tokens} more would wait "
                                   f"{wait:.1f} s): slow down, or retry in {math.ceil(wait)} s")
        if wait > 0:
            await asyncio.sleep(wait)
        bucket.charge(tokens, clock.now())

    def sweep(self) -> None:
        """Forget devices with no session and a full bucket: they cost nothing to remember
        again, and the table stays as large as the devices in use."""
        now = clock.now()
        for key in [key for key, usage in self.usage.items() if usage.sessions == 0
                    and (usage.bucket is None or usage.bucket.full(now))]:
            del self.usage[key]

    def _check_size(self, identity: Identity, tokens: int) -> None:
        rate = identity.quota.tokens_per_s or self.tokens_per_s
        most = rate * (self.burst_s + self.wait_s)
        if rate and tokens > most:
            raise errors.exhausted(Reason.REASON_QUOTA, f"device {identity.device}'s quota of "
                                   f"{rate:g} tokens/s takes at most {most:.0f} tokens at once "
                                   f"and this prompt has {tokens}: send a shorter one, or ask the "
                                   "server's operator for a larger quota")

    def _bucket(self, identity: Identity) -> TokenBucket | None:
        rate = identity.quota.tokens_per_s or self.tokens_per_s
        if not rate:
            return None
        usage = self.usage.setdefault(identity.key, Usage())
        if usage.bucket is None:
            usage.bucket = TokenBucket(rate, rate * self.burst_s)
        elif usage.bucket.rate != rate:
            usage.bucket.retune(rate, rate * self.burst_s, clock.now())
        return usage.bucket
