"""How often each server went silent in one session, and when one has had its retries.

A server that sends no Opened or no verdict within its deadline is treated as lost (Silence) and
the session is reopened, on it or on another. One that answers every open and then says nothing
would hold the session for ever, a deadline at a time, so a session retries each server at most
`retries` times: after that, choosing it again ends the session (ServerSilent).

    silences = Silences(retries=1)
    silences.heard(stub, silence)      # its first silence: it may be retried
    silences.check(stub)               # fine
    silences.heard(stub, silence)      # its second
    silences.check(stub)               # raises ServerSilent
"""
from __future__ import annotations

from edge_client.transport import ServerSilent, Silence

# How many times a session reopens on a server that went silent before it gives that server up.
SILENT_RETRIES = 1


class Silences:
    """One session's silent servers: how often each went silent, and its last silence. A server
    is whatever names it to the session (its stub); one never heard went silent 0 times."""

    def __init__(self, retries: int = SILENT_RETRIES) -> None:
        if retries < 0:
            raise ValueError(f"silent_retries must be >= 0, got {retries}")
        self.retries = retries
        self.times: dict[object, int] = {}
        self.last: dict[object, Silence] = {}

    def heard(self, server: object, silence: Silence) -> None:
        """`server` went silent once more."""
        self.times[server] = self.times.get(server, 0) + 1
        self.last[server] = silence

    def check(self, server: object) -> None:
        """ServerSilent when `server` went silent more often than it may be retried."""
        times = self.times.get(server, 0)
        if times > self.retries:
            raise ServerSilent(times, self.last[server])
