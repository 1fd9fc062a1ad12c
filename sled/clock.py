"""The clock that times sessions, rounds and deadlines on both sides: the running event loop's.

In a server or on a device that is asyncio's own clock, time.monotonic. `sled lab simulate`
runs the server's core and the devices on an event loop whose clock is virtual (looptime): every
stamp taken with `now()` (a deadline, a queued round, a verdict's arrival) is then simulated
time, and the same code runs unchanged under both clocks. Outside a running loop it is
time.monotonic, the loop's clock in real time, so stamps taken before a loop starts compare with
those taken inside it.
"""
from __future__ import annotations

import asyncio
import time


def now() -> float:
    """Seconds on the running loop's clock (time.monotonic outside a loop)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
