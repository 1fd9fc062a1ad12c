"""The admission queue: sessions waiting at the memory wall for KV that running sessions hold.

When the whole KV cache is too full to reserve a new session's prompt + max_new_tokens, the
session is not refused at once: it waits here, inside its Open, until sessions end and free
theirs (its device's time to first token includes the wait). The core owns the reservation
itself; this queue only decides whose turn it is and for how long one may wait.

    if queue.first_in_line() and reserve():       # nobody waits ahead: try the cache now
        ...
    await queue.wait_for_kv(reserve, needed)      # else wait in line, or SessionError
    queue.kv_freed()                              # a session's KV went: the first in line tries

Strict FIFO: only the first session in line tries the cache; while it still does not fit, the
sessions behind it wait too, even a smaller one that would fit now, so a large session is never
passed over for as long as smaller ones keep arriving. A session that gets its KV hands the turn
to the one behind it at once (more may fit), and so does one that leaves the line.

Bounded twice: at most `limit` sessions wait at once (past it a new one is refused), and none
waits longer than `wait_s` seconds (then it is refused, holding nothing). Both refusals are
RESOURCE_EXHAUSTED with REASON_KV_BUDGET. limit 0: no queue, a session that does not fit is
refused at once by the core. Time is sled.clock's, so a simulation's virtual clock governs the
waits. A session whose call is cancelled while it waits leaves the line and holds nothing.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sled import clock
from verify_server import errors
from verify_server.errors import Reason, SessionError
from verify_server.metrics import Metrics

ADVICE = "retry later, lower max_new_tokens, or use a server with a larger --kv-budget"


@dataclass(eq=False)
class Waiting:
    """A session's place in line: since when it waits, and its signal to try the cache."""
    since: float
    turn: asyncio.Event = field(default_factory=asyncio.Event)


class AdmissionQueue:
    """`limit`: the most sessions waiting at once (0: none ever waits); `wait_s`: the longest
    one waits."""

    def __init__(self, limit: int, wait_s: float, metrics: Metrics) -> None:
        self.limit = limit
        self.wait_s = wait_s
        self.metrics = metrics
        self._line: deque[Waiting] = deque()
        metrics.admission_waiting.set_function(lambda: len(self._line))

    @property
    def waiting(self) -> int:
        """Sessions in line now."""
        return len(self._line)

    def first_in_line(self) -> bool:
        """Whether a new session may try the cache at once: nobody waits ahead of it."""
        return not self._line

    async def wait_for_kv(self, reserve: Callable[[], bool], needed: int) -> None:
        """Wait in line until `reserve()` (called at this session's turns, synchronously) says
        its KV is reserved. `needed`: the session's KV tokens, for the refusals' messages.
        SessionError (RESOURCE_EXHAUSTED, REASON_KV_BUDGET) when the line is full or the wait
        passes wait_s; whatever `reserve` raises ends the wait too."""
        if len(self._line) >= self.limit:
            self.metrics.admission_refusals.labels("queue").inc()
            raise self._line_full(needed)
        place = Waiting(clock.now())
        self._line.append(place)
        try:
            await self._until_reserved(place, reserve, needed)
        finally:
            self._leave(place)
        self.metrics.admission_wait.observe(clock.now() - place.since)

    def kv_freed(self) -> None:
        """Some session's KV was freed: the first in line tries the cache again."""
        if self._line:
            self._line[0].turn.set()

    async def _until_reserved(self, place: Waiting, reserve: Callable[[], bool],
                              needed: int) -> None:
        deadline = place.since + self.wait_s
        while True:
            try:
                async with asyncio.timeout(deadline - clock.now()):
                    await place.turn.wait()
            except TimeoutError:
                self.metrics.admission_refusals.labels("wait").inc()
                raise self._waited_too_long(clock.now() - place.since, needed) from None
            place.turn.clear()
            if reserve():
                return

    def _leave(self, place: Waiting) -> None:
        """Out of line (admitted, refused or cancelled): the one behind it, now first, tries."""
        first = self._line[0] is place
        self._line.remove(place)
        if first:
            self.kv_freed()

    def _line_full(self, needed: int) -> SessionError:
        return errors.exhausted(
            Reason.REASON_KV_BUDGET,
            f"the KV cache is full and as many sessions as may wait for it already do "
            f"(--admission-queue {self.limit}): this session needs {needed} tokens; {ADVICE}")

    def _waited_too_long(self, waited_s: float, needed: int) -> SessionError:
        return errors.exhausted(
            Reason.REASON_KV_BUDGET,
            f"the KV cache stayed full for the {waited_s:.1f} s this session waited, the longest "
            f"a session may wait for it (--admission-wait {self.wait_s:g}): it needs {needed} "
            f"tokens; {ADVICE}")
