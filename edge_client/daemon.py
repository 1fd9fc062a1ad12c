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
import os
import time
import zlib
from collections.abc import AsyncIterator, Callable

import drafters
from drafters.base import Drafter
from edge_client.bootstrap import Bootstrap
from edge_client.device_generation import RequestRunner, Telemetry
from edge_client.device_requests import Chunk, DeviceError, Request, Requests
from edge_client.device_status import DeviceMetrics, DeviceState, Window
from edge_client.emulation import LinkEmulation
from edge_client.security import ChannelSecurity
from edge_client.server_choice import ServerChoice
from edge_client.servers import ServerDirectory
from edge_client.settings import LIVE_KEYS, DeviceSettings, SettingsError

# what other modules import from here (the request and its error live in device_requests)
__all__ = ["Device", "DeviceError", "Request"]


class Device:
    """The device as its local API and its MQTT control plane see it. It composes one
    collaborator per job, each the one owner of its state: Bootstrap (the drafter, the target's
    tokenizer, EOS ids and model name, the cache salt), ServerChoice (the directory: which
    server, failover, probes), Requests (checking, admitting and streaming requests), a
    RequestRunner (generating one: drafted, centralized or drafting alone), DeviceState (state,
    reason, listeners), and the metrics and telemetry window. It keeps the settings in force and
    applies live changes to each collaborator."""

    def __init__(self, settings: DeviceSettings,
                 load_drafter: Callable[[str], Drafter] | None = None,
                 tokenizer=None) -> None:
        self.settings = settings
        # TLS files that cannot be read stop here (ValueError: one line)
        self.directory = ServerDirectory(settings.servers,
                                         security=ChannelSecurity.from_settings(settings))
        self.metrics = DeviceMetrics()
        self.window = Window()
        self.started = time.monotonic()
        self.presence = DeviceState(settings.id)
        self.bootstrap = Bootstrap(self.directory, load_drafter or drafters.load_drafter, tokenizer,
                                   model_id=settings.model_name)
        self.choice = ServerChoice(self.directory, self.presence, lambda: self.settings)
        # the lab's user-space link (its cuts too), seeded per device so runs repeat
        self.link = LinkEmulation(seed=zlib.crc32(settings.id.encode()))
        self.link.configure(settings.emulation)
        self.runner = RequestRunner(self.bootstrap, self.choice, Telemetry(self.metrics, self.window),
                                    self.link, lambda: self.settings)
        self.requests = Requests(self.bootstrap, self.presence, self.metrics, lambda: self.settings,
                                 self.runner.generate)
        self.mqtt = None          # the MQTT control plane (edge_client.mqtt.DeviceMqtt) when one runs
        self._tasks: list[asyncio.Task] = []

    # -- what the collaborators own, as the device's ------------------------------------------
    tokenizer = property(lambda self: self.bootstrap.tokenizer,
                         lambda self, tokenizer: setattr(self.bootstrap, "tokenizer", tokenizer))
    drafter = property(lambda self: self.bootstrap.drafter,
                       lambda self, drafter: setattr(self.bootstrap, "drafter", drafter))
    eos_ids = property(lambda self: self.bootstrap.eos_ids)
    model_id = property(lambda self: self.bootstrap.model_id)
    cache_salt = property(lambda self: self.bootstrap.cache_salt,
                          doc="secret to this device (edge_client.salt), known from start()")
    ready = property(lambda self: self.bootstrap.ready)
    state = property(lambda self: self.presence.state)
    reason = property(lambda self: self.presence.reason)
    listeners = property(lambda self: self.presence.listeners,
                         doc="told when settings or state change")

    # -- life cycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Load the drafter and find the servers; a missing server is not fatal (the device
        keeps trying and says why in its status)."""
        await self.bootstrap.load(self.settings)
        await self.directory.probe_all()
        await self._bootstrap()
        self._tasks.append(asyncio.create_task(self.choice.keep_probing(self.servers_changed)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.directory.close()

    async def _bootstrap(self) -> None:
        """Take what is still missing (tokenizer, EOS ids, model name) from a compatible server."""
        self.presence.set(*await self.bootstrap.from_server(self.settings))

    async def servers_changed(self) -> None:
        """The directory changed (probes, MQTT announcements): finish start-up through a newly
        usable server, or say again which server is in use."""
        if not self.ready or not self.eos_ids:
            await self._bootstrap()
        else:
            self.choice.show()

    # -- requests -------------------------------------------------------------------------
    def stream(self, request: Request) -> AsyncIterator[Chunk]:
        """Generate one request, yielding each verdict's committed tokens as they arrive."""
        return self.requests.stream(request)

    async def complete(self, request: Request) -> tuple[list[int], str, bool]:
        """The whole output: (token ids, finish reason, lossless)."""
        tokens, finish, lossless = [], "", True
        async for chunk in self.stream(request):
            tokens.extend(chunk.token_ids)
            lossless = lossless and chunk.lossless
            finish = chunk.finish_reason or finish
        return tokens, finish, lossless

    # -- settings and status --------------------------------------------------------------
    async def apply(self, changes: dict) -> DeviceSettings:
        """Validate and apply a settings change without a restart; new requests use it at once.
        A bad change raises SettingsError and leaves everything as it was."""
        fixed = sorted(set(changes) - LIVE_KEYS)
        if fixed:
            raise SettingsError(f"{', '.join(fixed)} cannot change while running: restart sled device "
                                f"(live keys: {', '.join(sorted(LIVE_KEYS))})")
        updated = self.settings.updated(changes)
        if updated.drafter != self.settings.drafter:
            self.drafter = await self.bootstrap.other_drafter(updated.drafter)
        if updated.servers != self.settings.servers:
            self.directory.configure(updated.servers)
            await self.directory.probe_all()
        if updated.max_sessions != self.settings.max_sessions:
            self.requests.resize(updated.max_sessions)
        self.settings = updated
        self.link.configure(updated.emulation)      # a cut fails the open streams at once
        self.choice.show()
        self.presence.tell()
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
            "active_sessions": self.requests.active,
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
