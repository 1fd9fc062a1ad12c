"""The device daemon's core: one drafter, many local requests, a server chosen from the
directory, sessions that survive a lost server, live settings, status and metrics.

The local API (openai_api) and the MQTT control plane (mqtt) sit on top of `Device`:

    device = Device(settings, load_drafter=...)
    await device.start()
    async for chunk in device.stream(Request(prompt_ids=[...], max_tokens=32)):
        ...                                   # chunk.token_ids, chunk.finish_reason
    device.status()                           # what /health and the MQTT status say
    await device.apply({"policy": {"draft_len": 6}})   # live config, validated
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from drafters import bind_target_tokenizer
from drafters.base import Drafter
from edge_client.connection import kept_tokenizer
from edge_client.drafting import SharedDrafter
from edge_client.emulation import LinkEmulation, PacedDrafter, board
from edge_client.proposer import Proposer
from edge_client.result import LOST, RoundStat, ServerEvent
from edge_client.salt import device_salt
from edge_client.security import ChannelSecurity
from edge_client.servers import NoServer, Server, ServerDirectory
from edge_client.server_side import generate_server_side
from edge_client.session import RoundSettings, SessionHooks, Target, generate
from edge_client.settings import DeviceSettings, SettingsError
from edge_client.tokenizer import tokenizer_fingerprint
from edge_client.transport import ServerLost, VerifyError
from edge_client.wire import SessionRequest
from sled.cache import CacheError
from sled.fingerprint import short
from sled.loose import Loose
from sled.printable import printable
from sled.sampling import Sampling

log = logging.getLogger("sled.device")

# How often servers that could not be reached are asked again.
PROBE_S = 3.0


class DeviceError(Exception):
    """A request the device cannot serve. `kind` maps to an HTTP status in the local API:
    invalid (400), unavailable (503), busy (429)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(slots=True)
class Request:
    prompt_ids: list[int]
    max_tokens: int | None = None              # None: the device's max_new_tokens
    sampling: Sampling = Sampling()
    stop_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    request_id: str = ""
    loose: Loose | None = None                 # opt-in loose verification: NOT lossless


@dataclass(frozen=True, slots=True)
class Generation:
    """What one request's generation runs with: its settings as they were when it started,
    and where its tokens and server events go."""
    request: Request
    max_tokens: int
    settings: DeviceSettings
    on_tokens: Callable[[list[int]], None]
    on_server: Callable[[ServerEvent], None]

    def session_request(self, cache_salt: str) -> SessionRequest:
        """What its session asks the server for; cache_salt: the device's own (its sessions
        share a system prompt's cached blocks)."""
        request = self.request
        return SessionRequest(request.prompt_ids, self.max_tokens, request.sampling,
                              request.stop_ids, request.ignore_eos, cache_salt=cache_salt,
                              loose=request.loose)


@dataclass(slots=True)
class Chunk:
    """Tokens committed by one verdict, or drafted alone (lossless=False)."""
    token_ids: list[int]
    finish_reason: str | None = None           # "eos", "stop" or "length" on the last chunk
    # the target's own output; False only for the opt-in lossy modes: drafting alone, and loose
    # verification (Request.loose)
    lossless: bool = True


class DeviceMetrics:
    """Prometheus metrics of one device (its own registry)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("sled_device_requests", "Local requests by outcome", ["outcome"],
                                registry=r)
        self.prompt_tokens = Counter("sled_device_prompt_tokens", "Prompt tokens received", registry=r)
        self.tokens = Counter("sled_device_generated_tokens", "Tokens generated", ["lossless"],
                              registry=r)
        self.rounds = Counter("sled_device_rounds", "Verify rounds", registry=r)
        self.draft_tokens = Counter("sled_device_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter("sled_device_accepted_tokens", "Draft tokens accepted",
                                       registry=r)
        self.resumes = Counter("sled_device_resumes", "Sessions reopened after a lost server",
                               registry=r)
        self.active = Gauge("sled_device_active_sessions", "Requests being generated", registry=r)
        self.round_trip = Histogram("sled_device_round_trip_seconds", "Draft sent -> verdict",
                                    registry=r)
        self.draft_seconds = Histogram("sled_device_draft_seconds", "Drafting time per round",
                                       registry=r)
        # an emulated board (emulation.device): its paced drafts, and those this machine made late
        self.paced_drafts = Counter("sled_device_paced_drafts", "Drafts paced to the emulated "
                                    "board's speed", registry=r)
        self.late_drafts = Counter("sled_device_late_drafts", "Paced drafts that came more than "
                                   "10% past the board's time (the host could not keep its pace)",
                                   registry=r)
        # per draft position (1..k): how often a draft reached it, and how often it was accepted
        self.position_drafted = Counter("sled_device_position_drafted", "Draft tokens verified at "
                                        "each draft position", ["position"], registry=r)
        self.position_accepted = Counter("sled_device_position_accepted", "Draft tokens accepted "
                                         "at each draft position", ["position"], registry=r)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        found = self.registry.get_sample_value(name, labels or {})
        return 0.0 if found is None else found


class Window:
    """Recent rounds, for telemetry: tokens/s, acceptance and RTT over the last `seconds`."""

    def __init__(self, seconds: float = 30.0) -> None:
        self.seconds = seconds
        self.rounds: deque[tuple[float, RoundStat]] = deque()
        self.tokens: deque[tuple[float, int]] = deque()

    def round(self, stat: RoundStat) -> None:
        self.rounds.append((time.monotonic(), stat))

    def emitted(self, n: int) -> None:
        self.tokens.append((time.monotonic(), n))

    def summary(self) -> dict:
        cut = time.monotonic() - self.seconds
        for q in (self.rounds, self.tokens):
            while q and q[0][0] < cut:
                q.popleft()
        stats = [s for _, s in self.rounds]
        verified = sum(s.verified for s in stats)
        return {
            "tokens_per_s": round(sum(n for _, n in self.tokens) / self.seconds, 3),
            "acceptance": round(sum(s.accepted for s in stats) / verified, 4) if verified else None,
            "rtt_ms": round(sum(s.round_trip_ms for s in stats) / len(stats), 2) if stats else None,
        }


class Device:
    def __init__(self, settings: DeviceSettings,
                 load_drafter: Callable[[str], Drafter] | None = None,
                 tokenizer=None) -> None:
        from drafters import load_drafter as default_loader

        self.settings = settings
        self._load_drafter = load_drafter or default_loader
        self.tokenizer = tokenizer
        self.drafter: SharedDrafter | None = None
        # TLS files that cannot be read stop here (ValueError: one line)
        self.directory = ServerDirectory(settings.servers,
                                         security=ChannelSecurity.from_settings(settings))
        self.metrics = DeviceMetrics()
        self.window = Window()
        self.started = time.monotonic()
        self.state, self.reason = "starting", ""
        self.eos_ids: list[int] = []
        self.model_id = settings.model_name
        self._slots = asyncio.Semaphore(settings.max_sessions)
        self._active = 0
        self._ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self.listeners: list[Callable[[], None]] = []   # told when settings or state change
        self.mqtt = None          # the MQTT control plane (edge_client.mqtt.DeviceMqtt) when one runs
        self.cache_salt = ""      # secret to this device (edge_client.salt), known from start()
        # the lab's user-space link (its cuts too), seeded per device so runs repeat
        self.link = LinkEmulation(seed=zlib.crc32(settings.id.encode()))
        self.link.configure(settings.emulation)

    # -- life cycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Load the drafter and find the servers; a missing server is not fatal (the device
        keeps trying and says why in its status)."""
        self.cache_salt = await asyncio.to_thread(device_salt, self.settings.id)
        self.drafter = SharedDrafter(await asyncio.to_thread(self._load_drafter, self.settings.drafter))
        if self.tokenizer is None and self.settings.tokenizer:
            self.tokenizer = await asyncio.to_thread(_load_tokenizer, self.settings.tokenizer)
        if self.tokenizer is None and self.drafter.tokenizer_fingerprint:
            # a target tokenizer fetched from a server earlier: until a server is reached, for
            # its files may not be the ones that server sends (see _bootstrap)
            self.tokenizer = await asyncio.to_thread(kept_tokenizer, self.drafter.tokenizer_fingerprint)
        self._set_fingerprint()
        self._bind_target_tokenizer(self.drafter)
        await self.directory.probe_all()
        await self._bootstrap()
        self._tasks.append(asyncio.create_task(self._keep_probing()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.directory.close()

    @property
    def ready(self) -> bool:
        return self.tokenizer is not None and self.drafter is not None

    def _set_fingerprint(self) -> None:
        """The tokenizer servers must share: the drafter's own, else the local tokenizer's (the
        fingerprint its files were checked against when it carries one: not hashed again)."""
        own = tokenizer_fingerprint(self.tokenizer) if self.tokenizer is not None else ""
        fingerprint = (self.drafter.tokenizer_fingerprint if self.drafter else None) or own
        self.directory.set_fingerprint(fingerprint)
        if own and own != fingerprint:
            raise SettingsError(f"tokenizer {self.settings.tokenizer or '(cached)'} does not match the "
                                f"drafter {self.settings.drafter}: {short(fingerprint)} expected "
                                f"(xtok:{self.settings.drafter} drafts across tokenizers)")

    def _bind_target_tokenizer(self, drafter: SharedDrafter) -> None:
        """A drafter that drafts across tokenizers (xtok:) gets the target's, once known."""
        if self.tokenizer is not None:
            bind_target_tokenizer(drafter.inner, self.tokenizer)

    async def _bootstrap(self) -> None:
        """Take what is still missing (tokenizer, EOS ids, model name) from a compatible server."""
        try:
            server = self.directory.pick()
        except NoServer as exc:
            self._set_state("waiting", str(exc))
            return
        try:
            info = await server.connect().model_info(timeout=10, wait_for_ready=False)
            if self.tokenizer is None or self._kept_but_not_these(info.tokenizer_files_sha256):
                self.tokenizer = await server.connect().tokenizer()
                self._set_fingerprint()
                self._bind_target_tokenizer(self.drafter)
            self.directory.set_files(getattr(self.tokenizer, "files_sha256", None) or "")
        except grpc.aio.AioRpcError as exc:
            self._set_state("waiting", await server.connect().explain(exc))
            return
        except CacheError as exc:  # its tokenizer was refused: one line, the device keeps waiting
            self._set_state("waiting", str(exc))
            return
        self.eos_ids = list(info.eos_token_ids)
        self.model_id = self.settings.model_name or printable(info.model_id, 200)
        self._set_state("ready", f"verifying on {printable(server.id or server.endpoint, 200)}")

    def _kept_but_not_these(self, files_sha256: str) -> bool:
        """The device's tokenizer is a kept copy of other files than the server's (one
        vocabulary, another normalizer or chat template): the server's files are the ones to use.
        A tokenizer from a local folder (settings.tokenizer) is the operator's and stays."""
        return (not self.settings.tokenizer and getattr(self.tokenizer, "files_sha256", None) is not None
                and not self.directory.files_sha256 and files_sha256 != self.tokenizer.files_sha256)

    async def _keep_probing(self) -> None:
        while True:
            await asyncio.sleep(PROBE_S)
            stale = [s for s in self.directory.servers.values() if s.reachable is not True or s.mismatch]
            await asyncio.gather(*(self.directory.probe(s) for s in stale))
            await self.servers_changed()

    async def servers_changed(self) -> None:
        """The directory changed (probes, MQTT announcements): finish start-up through a newly
        usable server, or say again which server is in use."""
        if not self.ready or not self.eos_ids:
            await self._bootstrap()
        else:
            self._refresh_state()

    def _refresh_state(self) -> None:
        try:
            server = self.directory.pick()
            self._set_state("ready", f"verifying on {printable(server.id or server.endpoint, 200)}")
        except NoServer as exc:
            fallback = " (drafting alone: lossy output)" if self.settings.unverified_fallback else ""
            self._set_state("waiting", str(exc) + fallback)

    def _set_state(self, state: str, reason: str) -> None:
        if (state, reason) != (self.state, self.reason):
            log.info("device %s: %s (%s)", self.settings.id, state, reason)
            self.state, self.reason = state, reason
            self._tell()

    def _tell(self) -> None:
        for listener in list(self.listeners):
            listener()

    # -- requests -------------------------------------------------------------------------
    async def stream(self, request: Request) -> AsyncIterator[Chunk]:
        """Generate one request, yielding each verdict's committed tokens as they arrive."""
        self._validate(request)
        if not request.request_id:
            request.request_id = f"req-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(self._run(request, queue))
        outcome = "error"
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    outcome = "ok"
                    break
        finally:
            if not task.done():
                task.cancel()
                outcome = "cancelled" if outcome == "error" else outcome
            await asyncio.gather(task, return_exceptions=True)
            self.metrics.requests.labels(outcome).inc()

    async def complete(self, request: Request) -> tuple[list[int], str, bool]:
        """The whole output: (token ids, finish reason, lossless)."""
        tokens, finish, lossless = [], "", True
        async for chunk in self.stream(request):
            tokens.extend(chunk.token_ids)
            lossless = lossless and chunk.lossless
            finish = chunk.finish_reason or finish
        return tokens, finish, lossless

    def _validate(self, request: Request) -> None:
        if not self.ready:
            raise DeviceError("unavailable", f"the device is not ready: {self.reason or self.state}")
        if not request.prompt_ids:
            raise DeviceError("invalid", "the prompt is empty")
        vocab = len(self.tokenizer)
        bad = [t for t in itertools.chain(request.prompt_ids, request.stop_ids) if not 0 <= t < vocab]
        if bad:
            raise DeviceError("invalid", f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        # max_tokens travels as a uint32 (MQTT requests reach here unchecked)
        if request.max_tokens is not None and not 1 <= request.max_tokens < 2**32:
            raise DeviceError("invalid", f"max_tokens must be in [1, 2**32), got {request.max_tokens}")
        if request.loose is not None:
            self._validate_loose(request.loose, request.sampling)

    def _validate_loose(self, loose: Loose, sampling: Sampling) -> None:
        """Loose verification: in range, greedy, and a drafter of this device's to check."""
        problem = loose.problem(sampling.greedy)
        if problem is None and self.settings.mode == "server":
            problem = "loose verification checks a drafter's tokens: this device has none (mode server)"
        if problem is not None:
            raise DeviceError("invalid", problem)

    async def _run(self, request: Request, queue: asyncio.Queue) -> None:
        try:
            async with self._slots:
                self._active += 1
                self.metrics.active.inc()
                try:
                    await self._generate(request, queue)
                finally:
                    self._active -= 1
                    self.metrics.active.dec()
        except BaseException as exc:  # handed to the reader, which raises it
            queue.put_nowait(exc)
            if not isinstance(exc, Exception):
                raise

    async def _generate(self, request: Request, queue: asyncio.Queue) -> None:
        settings = self.settings        # this request keeps the settings it started with
        max_tokens = request.max_tokens or settings.max_new_tokens
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        committed: list[int] = []
        server = await self._server_for(request)
        if server is None:   # no server, and drafting alone (lossy) was asked for
            await self._draft_alone(request, request.prompt_ids, max_tokens, queue)
            return
        current = {"server": server}

        def reopen():
            # The last attempt lost its server: prefer another compatible one (the directory
            # moves on failover).
            self.directory.failed(current["server"])
            try:
                current["server"] = self.directory.pick()
            except NoServer:
                pass           # keep waiting on the same one (it may be restarting)
            return current["server"].stub

        def on_tokens(tokens: list[int]) -> None:
            committed.extend(tokens)
            lossless = request.loose is None
            self.metrics.tokens.labels(lossless=str(lossless).lower()).inc(len(tokens))
            self.window.emitted(len(tokens))
            queue.put_nowait(Chunk(list(tokens), lossless=lossless))

        def on_server(event: ServerEvent) -> None:
            self._log_server_event(request, current["server"], event)

        generation = Generation(request, max_tokens, settings, on_tokens, on_server)
        try:
            if settings.mode == "server":
                result = await self._centralized(server, generation)
            else:
                result = await self._drafted(server, generation, reopen)
        except VerifyError as exc:
            if exc.code == grpc.StatusCode.UNAVAILABLE and settings.unverified_fallback:
                await self._draft_alone(request, request.prompt_ids + committed,
                                        max_tokens - len(committed), queue)
                return
            if isinstance(exc, ServerLost):
                raise DeviceError("unavailable", f"lost the verify server: {exc.message}") from None
            raise DeviceError(_kind(exc), f"the verify server refused: {exc}") from None
        self.metrics.resumes.inc(result.resumes)
        queue.put_nowait(Chunk([], result.finish_reason))

    async def _drafted(self, server: Server, generation: Generation, reopen: Callable[[], object]):
        """The device drafts, the server verifies (mode "draft")."""
        settings = generation.settings
        policy = settings.policy
        return await generate(
            server.stub, self._session_drafter(settings), generation.session_request(self.cache_salt),
            RoundSettings(
                draft_len=policy.draft_len, max_draft_len=policy.max_draft_len,
                min_confidence=policy.min_confidence, pipeline=policy.pipeline,
                lookahead=policy.lookahead, hints=policy.hints, tree=policy.tree,
                max_tree_tokens=server.max_draft_tokens or 32, reconnect_s=settings.reconnect_s),
            target=Target(server.fingerprint or None, server.model), transport=self.link.transport(),
            hooks=SessionHooks(reopen_on=reopen, on_tokens=generation.on_tokens,
                               on_round=self._count_round, on_server=generation.on_server))

    async def _centralized(self, server: Server, generation: Generation):
        """The server generates every token, the device only streams them (mode "server": the
        centralized baseline). The first open waits for a server (or a cut link) up to
        reconnect_s, as a drafting session's does."""
        request = replace(generation.session_request(self.cache_salt), loose=None)  # no drafts to check
        return await generate_server_side(
            server.stub, request,
            hooks=SessionHooks(on_tokens=generation.on_tokens, on_server=generation.on_server),
            transport=self.link.transport(), reconnect_s=generation.settings.reconnect_s,
            wait_first=True)

    def _session_drafter(self, settings: DeviceSettings):
        """The shared drafter, paced to the emulated board's speed when there is one."""
        if not settings.emulation.device:
            return self.drafter
        return PacedDrafter(self.drafter, board(settings.emulation.device),
                            on_paced=self._count_paced)

    def _count_paced(self, late: bool) -> None:
        self.metrics.paced_drafts.inc()
        if late:
            self.metrics.late_drafts.inc()

    def _count_round(self, stat: RoundStat) -> None:
        """One round of any session, in the metrics and the telemetry window."""
        self.metrics.rounds.inc()
        self.metrics.draft_tokens.inc(stat.verified)
        self.metrics.accepted_tokens.inc(stat.accepted)
        for position in range(1, stat.verified + 1):      # positions 1..verified were drafted,
            self.metrics.position_drafted.labels(str(position)).inc()
        for position in range(1, stat.accepted + 1):      # 1..accepted accepted
            self.metrics.position_accepted.labels(str(position)).inc()
        self.metrics.round_trip.observe(stat.round_trip_ms / 1e3)
        self.metrics.draft_seconds.observe(stat.draft_ms / 1e3)
        self.window.round(stat)

    def _log_server_event(self, request: Request, server: Server, event: ServerEvent) -> None:
        """A session lost its server (one WARNING line) or got one back (one INFO line)."""
        where = printable(server.id or server.endpoint, 200)
        if event.kind == LOST:
            log.warning("request %s: lost the verify server %s after %d tokens (%s); waiting up to "
                        "%g s for it or another to resume", request.request_id, where,
                        event.committed, event.detail, event.wait_s)
        else:
            log.info("request %s: resumed on %s after %d tokens (%s)", request.request_id, where,
                     event.committed, event.detail)

    async def _server_for(self, request: Request) -> Server | None:
        """A compatible server, waiting up to reconnect_s for one; None means draft alone."""
        give_up = time.monotonic() + self.settings.reconnect_s
        while True:
            try:
                return self.directory.pick()
            except NoServer as exc:
                if self.settings.unverified_fallback:
                    return None
                left = give_up - time.monotonic()
                if left <= 0:
                    raise DeviceError("unavailable", f"{exc} (waited {self.settings.reconnect_s:g} s)")
                self._set_state("waiting", str(exc))
                await self.directory.wait_changed(min(left, PROBE_S))

    async def _draft_alone(self, request: Request, context: list[int], budget: int,
                           queue: asyncio.Queue) -> None:
        """No server: the drafter's own tokens (at the emulated board's pace, when there is
        one), marked lossless=False (opt-in only)."""
        proposer = Proposer(self._session_drafter(self.settings), request.sampling)
        context = list(context)
        ends = set(request.stop_ids) | (set() if request.ignore_eos else set(self.eos_ids))
        for produced in range(1, budget + 1):
            proposal = await proposer.propose(context, 1)
            token = proposal.token_ids[0]
            context.append(token)
            self.metrics.tokens.labels(lossless="false").inc()
            self.window.emitted(1)
            finish = "eos" if token in self.eos_ids and not request.ignore_eos else \
                "stop" if token in ends else "length" if produced == budget else None
            queue.put_nowait(Chunk([token], finish, lossless=False))
            if finish:
                return
        queue.put_nowait(Chunk([], "length", lossless=False))

    # -- settings and status --------------------------------------------------------------
    async def apply(self, changes: dict) -> DeviceSettings:
        """Validate and apply a settings change without a restart; new requests use it at once.
        A bad change raises SettingsError and leaves everything as it was."""
        from edge_client.settings import LIVE_KEYS

        fixed = sorted(set(changes) - LIVE_KEYS)
        if fixed:
            raise SettingsError(f"{', '.join(fixed)} cannot change while running: restart sled device "
                                f"(live keys: {', '.join(sorted(LIVE_KEYS))})")
        updated = self.settings.updated(changes)
        if updated.drafter != self.settings.drafter:
            try:
                drafter = SharedDrafter(await asyncio.to_thread(self._load_drafter, updated.drafter))
            except (ValueError, OSError) as exc:
                raise SettingsError(f"drafter {updated.drafter!r} cannot be loaded: {exc}") from None
            if drafter.tokenizer_fingerprint and self.tokenizer is not None and \
                    drafter.tokenizer_fingerprint != tokenizer_fingerprint(self.tokenizer):
                raise SettingsError(f"drafter {updated.drafter!r} has another tokenizer "
                                    f"({short(drafter.tokenizer_fingerprint)}) than this device's "
                                    f"target (xtok:{updated.drafter} drafts across tokenizers)")
            self._bind_target_tokenizer(drafter)
            self.drafter = drafter
        if updated.servers != self.settings.servers:
            self.directory.configure(updated.servers)
            await self.directory.probe_all()
        if updated.max_sessions != self.settings.max_sessions:
            self._slots = asyncio.Semaphore(updated.max_sessions)
        self.settings = updated
        self.link.configure(updated.emulation)      # a cut fails the open streams at once
        self._refresh_state()
        self._tell()
        return updated

    def status(self) -> dict:
        """What /health and MQTT telemetry report."""
        load = os.getloadavg()[0] / (os.cpu_count() or 1) if hasattr(os, "getloadavg") else None
        return {
            "id": self.settings.id,
            "state": self.state,
            "reason": self.reason,
            "model": self.model_id,
            "drafter": self.settings.drafter,
            "mode": self.settings.mode,
            "emulation": self.emulation_status(),
            "active_sessions": self._active,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "cpu_load": round(load, 3) if load is not None else None,
            "servers": self.directory.summary(),
            "mqtt": self.mqtt.summary() if self.mqtt is not None else None,
            **self.window.summary(),
        }

    def emulation_status(self) -> dict:
        """What the lab emulates here: the board, the link, whether it is cut, and how."""
        emulation = self.settings.emulation
        return {"device": emulation.device, "link": emulation.link, "link_down": emulation.link_down,
                "kind": self.link.kind}


def _kind(error: VerifyError) -> str:
    if error.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return "invalid"
    if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "busy"
    return "unavailable"


def _load_tokenizer(path: str):
    """The tokenizer of a local folder (what transformers' save_pretrained writes)."""
    from edge_client.tokenizer import DeviceTokenizer

    folder = Path(path).expanduser()
    if not folder.exists():
        raise SettingsError(f"tokenizer folder {path} does not exist")
    if not (folder / "tokenizer.json").is_file():
        raise SettingsError(f"tokenizer folder {path} has no tokenizer.json: the device needs one "
                            f"(transformers' save_pretrained writes it)")
    try:
        return DeviceTokenizer.load(folder)
    except Exception as exc:  # tokenizers raises plain Exception on a malformed file
        raise SettingsError(f"cannot load the tokenizer in {path}: {printable(str(exc), 200)}") from None

