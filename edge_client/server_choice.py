"""Which verify server a device's requests use: the directory's pick, waited for up to
reconnect_s when there is none; another one after a lost server (failover); and the probes that
keep the directory fresh. The choice shows in the device's state (DeviceState): ready on a
server, degraded on one that went silent and has answered nothing since (no other answers), or
waiting."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from edge_client.device_requests import DeviceError
from edge_client.device_status import DeviceState
from edge_client.result import LOST, ServerEvent
from edge_client.servers import NoServer, Server, ServerDirectory
from edge_client.settings import DeviceSettings
from sled.printable import printable

log = logging.getLogger("sled.device")

# How often servers that could not be reached, or went silent, are asked again.
PROBE_S = 3.0


class ServerChoice:
    """`settings()` gives the device's settings as they are now (a live change applies to a
    request still waiting for a server)."""

    def __init__(self, directory: ServerDirectory, state: DeviceState,
                 settings: Callable[[], DeviceSettings]) -> None:
        self.directory, self.state, self.settings = directory, state, settings

    async def for_request(self) -> Server | None:
        """A compatible server, waiting up to reconnect_s for one; None means draft alone
        (unverified_fallback). DeviceError("unavailable") when none came."""
        give_up = time.monotonic() + self.settings().reconnect_s
        while True:
            try:
                return self.directory.pick()
            except NoServer as exc:
                settings = self.settings()
                if settings.unverified_fallback:
                    return None
                left = give_up - time.monotonic()
                if left <= 0:
                    raise DeviceError("unavailable", f"{exc} (waited {settings.reconnect_s:g} s)")
                self.state.set("waiting", str(exc))
                await self.directory.wait_changed(min(left, PROBE_S))

    def failover(self, lost: Server) -> Server:
        """The server to use after `lost` lost a session: another compatible one that did not go
        silent when there is one (the directory moves on), else the same (it may be restarting)
        or, when that went silent, the best of the silent ones."""
        self.directory.failed(lost)
        try:
            return self.directory.pick(besides=lost)
        except NoServer:
            return lost

    def went_silent(self, server: Server, detail: str) -> None:
        """A session's server sent no Opened or verdict in time (`detail`): the others come
        first until it answers a session again, and while none answers the device is degraded,
        until this one answers a probe (keep_probing) or a session."""
        self.directory.silent(server, detail)
        self.show()

    def answered(self, server: Server) -> None:
        """A verdict came from `server`: if it had gone silent, it is as good as any again."""
        if server.silent:
            self.directory.answered(server)
            self.show()

    def show(self) -> None:
        """The device's state as the directory has it now: ready on a server, degraded on one
        that went silent and has answered nothing since (the best there is), or waiting."""
        try:
            server = self.directory.pick()
        except NoServer as exc:
            fallback = " (drafting alone: lossy output)" if self.settings().unverified_fallback else ""
            self.state.set("waiting", str(exc) + fallback)
            return
        where = printable(server.id or server.endpoint, 200)
        if server.unheard:
            self.state.set("degraded", f"the verify server {where} went silent (no Opened or verdict "
                                       "in time) and no other compatible server answers")
        elif server.silent:
            self.state.set("ready", f"verifying on {where} (it went silent in a session, and has "
                                    "answered probes since)")
        else:
            self.state.set("ready", f"verifying on {where}")

    async def keep_probing(self, changed: Callable[[], Awaitable[None]]) -> None:
        """Every PROBE_S, probe the servers that were not reachable, not compatible, or silent
        and unheard since, then `changed()`. Runs until cancelled."""
        while True:
            await asyncio.sleep(PROBE_S)
            stale = [s for s in self.directory.servers.values()
                     if s.reachable is not True or s.mismatch or s.unheard]
            await asyncio.gather(*(self.directory.probe(s) for s in stale))
            await changed()


def log_server_event(request_id: str, server: Server, event: ServerEvent) -> None:
    """A session lost its server (one WARNING line) or got one back (one INFO line)."""
    where = printable(server.id or server.endpoint, 200)
    if event.kind == LOST:
        log.warning("request %s: lost the verify server %s after %d tokens (%s); waiting up to "
                    "%g s for it or another to resume", request_id, where,
                    event.committed, event.detail, event.wait_s)
    else:
        log.info("request %s: resumed on %s after %d tokens (%s)", request_id, where,
                 event.committed, event.detail)
