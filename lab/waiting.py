"""The lab's one way to wait for something to come true: a server that answers, a device that is
ready, a broker that listens, a file that arrives. Only asyncio and time are imported, so a
device container's entrypoint can use it too.

    status = await wait_until(lambda: ready(url), timeout_s=300, what=f"{url} was not ready")
    path = wait_until_sync(lambda: path if path.is_file() else None, timeout_s=60)

A check returns what was waited for, or None while it is not there yet; an exception it raises
ends the wait (a process that died is not waited for).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def wait_until(check: Callable[[], Awaitable[T | None]], timeout_s: float, what: str,
                     interval_s: float = 0.5) -> T:
    """check()'s first value that is not None; TimeoutError("WHAT within TIMEOUT_S s") when
    timeout_s passes first (check runs once more at the deadline)."""
    give_up = time.monotonic() + timeout_s
    while True:
        found = await check()
        if found is not None:
            return found
        if time.monotonic() > give_up:
            raise TimeoutError(f"{what} within {timeout_s:g} s")
        await asyncio.sleep(interval_s)


def wait_until_sync(check: Callable[[], T | None], timeout_s: float,
                    interval_s: float = 0.5) -> T | None:
    """check()'s first value that is not None, or None when timeout_s passes first (no event loop:
    a container's entrypoint before it execs the daemon)."""
    give_up = time.monotonic() + timeout_s
    while True:
        found = check()
        if found is not None or time.monotonic() > give_up:
            return found
        time.sleep(interval_s)
