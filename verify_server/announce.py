"""The server announces itself over MQTT so devices find it without configuration.

`<prefix>/servers/<server_id>` holds a retained announcement, republished every `interval_s`:

    {"id": "gpu-1", "endpoint": "10.0.0.2:50051", "model": "gemma3-12b",
     "fingerprint": "sha256:...", "load": 0.25, "sessions": 16, "online": true}

load is in [0, 1]: the larger of open sessions / max_sessions and the KV pool's committed
fraction. The last will, and a clean stop, leave {"id", "online": false} there instead.

    announcer = Announcer(running.service, AnnounceConfig(Broker("broker"), "gpu-1", "10.0.0.2:50051"))
    task = asyncio.create_task(announcer.run())   # reconnects forever; cancel to say offline
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import aiomqtt

from sled.mqtt import DEFAULT_PREFIX, Backoff, Broker, describe, encode, refused_credentials, server_topic
from verify_server.service import VerifierService

log = logging.getLogger("sled.server.announce")


@dataclass(slots=True)
class AnnounceConfig:
    broker: Broker
    server_id: str                   # one topic level: no '/', '+' or '#'
    endpoint: str                    # HOST:PORT devices dial
    topic_prefix: str = DEFAULT_PREFIX
    interval_s: float = 5.0
    backoff: Backoff = field(default_factory=Backoff)

    def __post_init__(self) -> None:
        if not self.server_id or any(c in self.server_id for c in "/+#"):
            raise ValueError(f"server id {self.server_id!r} must be non-empty without '/', '+' or '#'")
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"announce endpoint {self.endpoint!r} is not HOST:PORT")
        if self.interval_s <= 0:
            raise ValueError(f"announce interval must be > 0, got {self.interval_s}")


class Announcer:
    def __init__(self, service: VerifierService, config: AnnounceConfig) -> None:
        self.service = service
        self.config = config
        self.topic = server_topic(config.topic_prefix, config.server_id)
        self.client: aiomqtt.Client | None = None    # the live connection, if any
        self.connected = False
        self.problem = ""                            # what went wrong last ("" once connected)
        self._refused = False

    def load(self) -> float:
        """How busy the server is, 0..1: sessions against the limit, or KV committed, the larger."""
        sessions = len(self.service.sessions) / self.service.config.max_sessions
        pool = self.service.pool
        kv = pool.committed_blocks / pool.usable_blocks if pool.usable_blocks else 1.0
        return round(min(1.0, max(sessions, kv)), 4)

    def announcement(self) -> dict:
        target = self.service.target
        return {"id": self.config.server_id, "endpoint": self.config.endpoint,
                "model": target.model_id, "fingerprint": target.fingerprint, "load": self.load(),
                "sessions": len(self.service.sessions), "online": self.service.accepting}

    def farewell(self) -> dict:
        return {"id": self.config.server_id, "online": False}

    async def run(self) -> None:
        """Announce until cancelled, reconnecting with backoff (slowly after refused credentials);
        the server keeps serving whatever the broker does."""
        while True:
            try:
                await self._connection()
            except aiomqtt.MqttError as error:
                self._lost(describe(error, self.config.broker), refused_credentials(error))
            except Exception as error:   # a bad TLS file, a bug: report it and keep trying
                log.exception("announcing over MQTT failed")
                self._lost(describe(error, self.config.broker), False)
            await asyncio.sleep(self.config.backoff.next(self._refused))

    async def _connection(self) -> None:
        will = aiomqtt.Will(self.topic, encode(self.farewell()), qos=1, retain=True)
        async with self.config.broker.client(f"sled-server-{self.config.server_id}", will) as client:
            self.client, self.connected, self.problem, self._refused = client, True, "", False
            self.config.backoff.reset()
            log.info("announcing %s as %s on %s (%s)", self.config.endpoint, self.config.server_id,
                     self.config.broker.address, self.topic)
            try:
                await self._announce(client)
            except asyncio.CancelledError:
                await self._say_offline(client)
                raise
            finally:
                self.client, self.connected = None, False

    async def _announce(self, client: aiomqtt.Client) -> None:
        while True:
            await client.publish(self.topic, encode(self.announcement()), qos=1, retain=True)
            await asyncio.sleep(self.config.interval_s)

    async def _say_offline(self, client: aiomqtt.Client) -> None:
        try:
            await client.publish(self.topic, encode(self.farewell()), qos=1, retain=True, timeout=2.0)
        except aiomqtt.MqttError as error:
            log.warning("could not announce going offline: %s", error)

    def _lost(self, problem: str, refused: bool) -> None:
        if problem != self.problem:
            (log.error if refused else log.warning)("%s (still serving; retrying)", problem)
        self.problem, self._refused, self.connected = problem, refused, False
