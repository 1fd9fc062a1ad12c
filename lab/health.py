"""A device daemon's /health, read and waited for in one way: the lab waits for a device to be
ready at start, for its MQTT link to come back after a fault, for a link to go down, for a mode
to take hold; each is a predicate over the same reading.

    health = await wait_health(handle.api_url, lambda h: h.status.get("mode") == "draft",
                               f"{handle.id} did not switch to drafting", timeout_s=60)
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from lab.waiting import wait_until


@dataclass(frozen=True)
class Health:
    """One answer of GET /health: its HTTP code (the daemon answers 503 until its drafter and
    its server are up) and its JSON body."""
    code: int
    status: dict

    @property
    def ready(self) -> bool:
        """200, state ready, and its MQTT link up (or no MQTT configured)."""
        mqtt = self.status.get("mqtt") or {}
        return (self.code == 200 and self.status.get("state") == "ready"
                and mqtt.get("connected", True) is not False)


async def read_health(http: aiohttp.ClientSession, api_url: str) -> Health | None:
    """The daemon's /health, or None while it does not answer with JSON."""
    try:
        async with http.get(api_url + "/health") as response:
            return Health(response.status, await response.json(content_type=None) or {})
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


async def wait_health(api_url: str | Callable[[], str], holds: Callable[[Health], bool],
                      what: str, timeout_s: float, interval_s: float = 0.1,
                      request_timeout_s: float = 3.0) -> Health:
    """The first reading for which holds(health) is true; TimeoutError naming WHAT after
    timeout_s. `api_url` may be a function, asked before every look (an exception it raises
    ends the wait: a daemon that died is not waited for)."""
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async def held() -> Health | None:
            health = await read_health(http, api_url() if callable(api_url) else api_url)
            return health if health is not None and holds(health) else None
        return await wait_until(held, timeout_s, what, interval_s)
