"""How often each server failed one session, and when one has had its retries.

A server fails a session with a strike when it sends no Opened or no verdict within its deadline
(a Silence), or when it ends the session (a lost stream, an eviction) with no token committed
since the session last opened on it. Either way the session is reopened, on it or on another,
after a pause. One that answers every open and then stays silent, or fails every draft, would
hold the session for ever, so a session retries each server at most `retries` times: after
that, choosing it again ends the session (ServerSilent when its last strike was a silence, else
ServerGivenUp).

    strikes = Strikes(retries=1)
    strikes.add(stub, silence)         # its first strike: it may be retried
    strikes.check(stub)                # fine
    strikes.add(stub, lost)            # its second
    strikes.check(stub)                # raises ServerGivenUp
"""
from __future__ import annotations

from edge_client.transport import ServerGivenUp, ServerSilent, Silence, VerifyError

# How many times a session reopens on a server that has a strike before it gives that server up
# (the setting silent_retries).
SILENT_RETRIES = 1


class Strikes:
    """One session's strikes against its servers: how many each has, and its last. A server is
    whatever names it to the session (its stub); one never struck has 0."""

    def __init__(self, retries: int = SILENT_RETRIES) -> None:
        if retries < 0:
            raise ValueError(f"silent_retries must be >= 0, got {retries}")
        self.retries = retries
        self.times: dict[object, int] = {}
        self.last: dict[object, VerifyError] = {}
        self.silences: dict[object, int] = {}      # how many of its strikes were silences

    def add(self, server: object, error: VerifyError) -> None:
        """`server` failed the session once more, as `error` says (a Silence: it went silent)."""
        self.times[server] = self.times.get(server, 0) + 1
        self.last[server] = error
        self.silences[server] = self.silences.get(server, 0) + isinstance(error, Silence)

    def check(self, server: object) -> None:
        """ServerGivenUp (ServerSilent after a silence) when `server` has more strikes than it
        may be retried."""
        times = self.times.get(server, 0)
        if times <= self.retries:
            return
        given_up = ServerSilent if isinstance(self.last[server], Silence) else ServerGivenUp
        raise given_up(times, self.last[server], self.silences[server])
