"""The simulation's clock: an asyncio event loop on virtual time (looptime).

The server's core, its scheduler, the device sessions and the links are asyncio code timed by
the loop's clock (sled.clock). On looptime's loop that clock is virtual: whenever every task
waits on a timer, the clock jumps to the earliest one instead of sleeping, so a fleet's hour
passes in the time its Python takes, and the same code runs under both clocks. A discrete-event
library such as simpy would have meant writing the server and the devices again as its
processes: a second model of them, which is what the simulation must not be.

    result = simulate(main())      # main() runs on virtual time, from START
"""
from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import TypeVar

import looptime

T = TypeVar("T")
# Where the virtual clock starts: the same instant every run, so that the same seed gives the
# same stamps to the last bit (everything the simulation times is made on its loop).
START = 1_000_000.0
# No-op loop cycles before the clock jumps: none. asyncio gives select() a zero timeout while
# any callback is ready, so the clock only moves once every task waits on a timer.
NOOP_CYCLES = 0
# The cyclic garbage collector's first threshold during a run (Python's default: 700). A fleet
# allocates millions of short-lived futures, handles and messages, nearly all freed by their
# reference counts; collecting every 700 of them, and rescanning the traces and scripts loaded
# before the run at every full collection, took 16% of a 1024-device run and 35% of a
# 2048-device one. When the collector runs never reaches the results: only Python's own
# bookkeeping.
GC_THRESHOLD0 = 50_000


def simulate(main: Coroutine[object, object, T]) -> T:
    """Run `main` to its end on a loop whose clock is virtual, starting at START."""
    loop = looptime.new_event_loop(start=START, noop_cycles=NOOP_CYCLES)
    thresholds = gc.get_threshold()
    gc.freeze()            # what exists before the run (traces, scripts) is never rescanned
    gc.set_threshold(GC_THRESHOLD0, *thresholds[1:])
    try:
        with asyncio.Runner(loop_factory=lambda: loop) as runner:
            return runner.run(main)
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
