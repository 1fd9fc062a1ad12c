"""Which verify server a device uses: the configured ones and the ones announced over MQTT,
filtered to those whose tokenizer matches, least loaded first; a server that fails is avoided
until it answers again, and one that went silent on a session comes after every other until it
answers a session again (a probe it answers says only that it is up, not that it verifies).

    directory = ServerDirectory(["10.0.0.2:50051"], fingerprint="sha256:...")
    await directory.probe_all()            # GetModelInfo: model, tokenizer, reachable or not
    server = directory.pick()              # raises NoServer with the reason when none fits
    directory.failed(server)               # a session lost it: prefer the others for a while
    directory.silent(server, "no verdict ...")   # it went silent: the others first, until it answers
    await directory.probe(server)          # it answers: no longer unheard, still after the others
    directory.answered(server)             # a session's verdict came: as good as any again
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from edge_client.connection import Connection
from edge_client.security import ChannelSecurity
from sled.wire.fingerprint import short
from sled.printable import printable

log = logging.getLogger("sled.device")

# How long a server that failed a session is passed over while another compatible one is up.
AVOID_S = 30.0


class NoServer(Exception):
    """No compatible verify server is reachable; the message says what was tried and why."""


@dataclass(slots=True)
class Server:
    endpoint: str                       # HOST:PORT
    id: str = ""                        # the announced id (MQTT), else the endpoint
    source: str = "config"              # "config" or "mqtt"
    model: str = ""
    fingerprint: str = ""               # the target's tokenizer fingerprint ("" until known)
    files_sha256: str = ""              # what its tokenizer files are ("" until known, or unsaid)
    max_draft_tokens: int = 0           # the longest draft it verifies (0 until known)
    vocab_size: int = 0                 # its target's vocabulary (0 until known)
    load: float = 0.0                   # announced load in [0, 1] (0 when unknown)
    online: bool = True                 # announced online (config servers: until probed down)
    reachable: bool | None = None       # last probe: True, False, or None (not probed yet)
    unreachable: str = ""               # why the last probe failed ("" when it answered)
    mismatch: str = ""                  # how its tokenizer differs from the device's ("" if not)
    failed_at: float = 0.0              # monotonic time of the last lost session
    silent: str = ""                    # how it went silent in a session ("" once it answers one)
    silent_at: float = 0.0              # monotonic time it last went silent
    probed_at: float = 0.0              # monotonic time the last probe it answered was sent
    tls_name: str = ""                  # the certificate name it announced ("" = its host)
    untrusted: str = ""                 # why this device will not dial it ("" if it may)
    # the server ids announcing this endpoint online: replicas behind one proxy each announce
    # the proxy's address, and one going away leaves the proxy up while another still says so
    announcers: set[str] = field(default_factory=set)
    connection: Connection | None = field(default=None, repr=False)
    security: ChannelSecurity = field(default_factory=ChannelSecurity, repr=False)

    def connect(self) -> Connection:
        """The connection to this server, made on first use (announced servers start without)."""
        if self.connection is None:
            name = self.security.tls_name(self.endpoint, self.tls_name) or ""
            self.connection = Connection(self.endpoint, self.security, name)
        return self.connection

    @property
    def stub(self):
        return self.connect().stub

    @property
    def unheard(self) -> bool:
        """It went silent in a session and has answered nothing since, not even a probe."""
        return bool(self.silent) and self.probed_at <= self.silent_at

    @property
    def problem(self) -> str:
        """Why it cannot be used ("" when it can, as far as is known)."""
        return self.untrusted or self.mismatch or self.unreachable

    def summary(self) -> dict:
        return {"id": self.id or self.endpoint, "endpoint": self.endpoint, "source": self.source,
                "model": printable(self.model, 200),
                "fingerprint": printable(short(self.fingerprint)) if self.fingerprint else "",
                "load": round(self.load, 3), "online": self.online, "reachable": self.reachable,
                "problem": self.problem, "silent": self.silent}


class ServerDirectory:
    def __init__(self, endpoints: list[str] = (), fingerprint: str = "",
                 security: ChannelSecurity | None = None) -> None:
        self.fingerprint = fingerprint          # the device's tokenizer; "" = accept any
        self.files_sha256 = ""                  # the server files it was made of; "" = any
        self.security = security or ChannelSecurity()   # TLS, token: how every server is dialed
        self.servers: dict[str, Server] = {}    # by endpoint
        self.changed = asyncio.Event()          # set whenever a server comes, goes or changes
        self.configure(endpoints)

    # -- what is known -------------------------------------------------------------------
    def set_fingerprint(self, fingerprint: str) -> None:
        """The device's tokenizer became known (or changed with the drafter): recheck all."""
        self.fingerprint = fingerprint
        for server in self.servers.values():
            self._check(server)
        self._notify()

    def set_files(self, files_sha256: str) -> None:
        """The device encodes text with a server's tokenizer files: only servers that send the
        same files may verify (one vocabulary does not make one text-to-ids)."""
        self.files_sha256 = files_sha256
        for server in self.servers.values():
            self._check(server)
        self._notify()

    def configure(self, endpoints: list[str]) -> None:
        """Set the configured servers (live config): new ones are added, dropped ones removed
        unless MQTT announced them too."""
        for endpoint in endpoints:
            known = self.servers.get(endpoint)
            if known is None or known.source != "config":   # configured now: trusted as such
                self.servers[endpoint] = self._new(endpoint, "config")
                if known is not None:
                    self.servers[endpoint].id, self.servers[endpoint].load = known.id, known.load
        for endpoint, server in list(self.servers.items()):
            if server.source == "config" and endpoint not in endpoints:
                self._drop(endpoint)
        self._notify()

    def announce(self, server_id: str, endpoint: str, model: str = "", fingerprint: str = "",
                 load: float = 0.0, online: bool = True, tls_name: str = "",
                 files_sha256: str = "") -> None:
        """A server's announcement (MQTT, retained): add it or update its state. An announced
        server this device cannot authenticate is listed with why, and never dialed."""
        server = self.servers.get(endpoint) or self.servers.setdefault(
            endpoint, self._new(endpoint, "mqtt", tls_name))
        server.id, server.load = server_id, max(0.0, float(load))
        if online:
            server.announcers.add(server_id)
        else:
            server.announcers.discard(server_id)
        server.online = online or bool(server.announcers)
        if model:
            server.model = model
        if fingerprint:
            server.fingerprint = fingerprint
        if files_sha256:
            server.files_sha256 = files_sha256
        self._check(server)
        self._notify()

    def withdraw(self, server_id: str) -> None:
        """A server said it is going (MQTT last will or a cleared announcement); an endpoint
        another server id still announces (a proxy in front of replicas) stays online."""
        for server in self.servers.values():
            if server.id == server_id or server_id in server.announcers:
                server.announcers.discard(server_id)
                server.online = bool(server.announcers)
        self._notify()

    def failed(self, server: Server) -> None:
        """A session lost this server: pass it over while another compatible one is up."""
        server.failed_at = time.monotonic()
        self._notify()

    def silent(self, server: Server, detail: str) -> None:
        """A session's server sent no Opened or verdict in time: it comes after every server
        that did not, until it answers a session again (answered), and it is unheard until it
        answers a probe sent after this."""
        server.silent = printable(detail, 200) or "it went silent"
        server.silent_at = time.monotonic()
        self._notify()

    def answered(self, server: Server) -> None:
        """A silent server sent a session's verdict: it is chosen as any other again."""
        if server.silent:
            server.silent = ""
            self._notify()

    # -- probing -------------------------------------------------------------------------
    async def probe(self, server: Server, timeout: float = 5.0) -> None:
        """Ask the server for its model info: reachable, model and tokenizer fingerprint. One
        that answers is no longer unheard (it may still come after the others: silent)."""
        if server.untrusted:
            return
        asked = time.monotonic()
        try:
            info = await server.connect().model_info(timeout=timeout, wait_for_ready=False, refresh=True)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            server.reachable, server.unreachable = False, await server.connect().explain(exc)
            self._notify()
            return
        if server.unreachable:
            server.failed_at = 0.0          # it is back: no longer passed over for failing
        server.reachable, server.unreachable, server.probed_at = True, "", asked
        server.model, server.fingerprint = info.model_id, info.tokenizer_fingerprint
        server.files_sha256 = info.tokenizer_files_sha256
        server.max_draft_tokens = info.limits.max_draft_tokens
        server.vocab_size = info.vocab_size
        self._check(server)
        self._notify()

    async def probe_all(self, timeout: float = 5.0) -> None:
        await asyncio.gather(*(self.probe(s, timeout) for s in list(self.servers.values())))

    # -- choosing ------------------------------------------------------------------------
    def compatible(self) -> list[Server]:
        """Usable servers, best first: not silent, not recently failed, then least loaded."""
        now = time.monotonic()
        usable = [s for s in self.servers.values()
                  if s.online and s.reachable is not False and not s.mismatch and not s.untrusted]
        return sorted(usable, key=lambda s: (bool(s.silent), now - s.failed_at < AVOID_S, s.load,
                                             s.endpoint))

    def pick(self, besides: Server | None = None) -> Server:
        """The best compatible server; besides: another than this one that did not go silent,
        when there is one, else the best there is (this one, unless it went silent too)."""
        servers = self.compatible()
        if not servers:
            raise NoServer(self.why_none())
        return next((s for s in servers if s is not besides and not s.silent), servers[0])

    def why_none(self) -> str:
        if not self.servers:
            return "no verify server is configured or announced yet"
        parts = []
        for server in self.servers.values():
            reason = server.problem or ("announced offline" if not server.online else "not reachable")
            parts.append(f"{printable(server.id or server.endpoint, 200)} ({reason})")
        return "no compatible verify server: " + "; ".join(parts)

    async def wait_changed(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def summary(self) -> list[dict]:
        return [s.summary() for s in self.servers.values()]

    async def close(self) -> None:
        for server in self.servers.values():
            if server.connection is not None:
                await server.connection.close()

    # -- internals -----------------------------------------------------------------------
    def _new(self, endpoint: str, source: str, tls_name: str = "") -> Server:
        """A server entry; one this device will not dial says why (security.refusal)."""
        configured = tuple(e for e, s in self.servers.items() if s.source == "config")
        untrusted = self.security.refusal(endpoint, tls_name, announced=source == "mqtt",
                                          configured=configured)
        if untrusted:
            log.warning("server %s: not used: %s", printable(endpoint, 200), untrusted)
        return Server(endpoint, source=source, tls_name=tls_name, untrusted=untrusted,
                      security=self.security)

    def _check(self, server: Server) -> None:
        """A server whose tokenizer differs from the device's can never verify its drafts."""
        mismatch = ""
        if self.fingerprint and server.fingerprint and server.fingerprint != self.fingerprint:
            mismatch = (f"tokenizer {printable(short(server.fingerprint))} does not match this "
                        f"device's {short(self.fingerprint)}: it cannot verify these drafts")
        elif self.files_sha256 and server.files_sha256 and server.files_sha256 != self.files_sha256:
            mismatch = (f"tokenizer files {printable(short(server.files_sha256))} are not the ones this "
                        f"device encodes with ({short(self.files_sha256)}): the same vocabulary, but "
                        "text may become other ids")
        if mismatch and server.mismatch != mismatch:
            log.warning("server %s: %s", server.endpoint, mismatch)
        server.mismatch = mismatch

    def _drop(self, endpoint: str) -> None:
        server = self.servers.pop(endpoint)
        if server.connection is not None:
            asyncio.get_event_loop().create_task(server.connection.close())

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()
