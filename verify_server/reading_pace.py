"""How fast a client takes a long reply (GetTokenizer): it must read `min_rate` bytes per second
on average from the reply's start, after `grace_s` seconds for the connection to get going.

Each chunk must be handed to gRPC (the client has read what came before it, less what flow
control sends ahead) by the time the average would fall below the floor, so a reply is held at
most grace_s + its size / min_rate, and a client reading one chunk now and then, each under the
stall timeout, is ended as well as one reading nothing.

    pace = ReadingPace(min_rate=64 << 10, grace_s=10)
    await asyncio.wait_for(context.write(chunk), pace.seconds_left(len(chunk)))
    pace.written(len(chunk))
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sled import clock


@dataclass(slots=True)
class ReadingPace:
    min_rate: float                     # bytes per second, on average from the start
    grace_s: float                      # seconds not held to it
    started: float = field(default_factory=clock.now)
    sent: int = 0                       # bytes handed to gRPC so far

    def seconds_left(self, size: int) -> float:
        """Seconds the next `size` bytes may take before the reply is too slow."""
        due = self.started + self.grace_s + (self.sent + size) / self.min_rate
        return max(due - clock.now(), 0.0)

    def written(self, size: int) -> None:
        self.sent += size

    def too_slow(self) -> str:
        """The status details of a reply ended for its pace."""
        elapsed = max(clock.now() - self.started, 1e-9)
        return (f"the client read this reply at {self.sent / elapsed / 1024:.1f} KiB/s, under "
                f"the server's floor of {self.min_rate / 1024:g} KiB/s: it ends here (ask again "
                "over a faster link)")
