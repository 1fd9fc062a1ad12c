"""The server announces itself over MQTT so devices find it without configuration.

`<prefix>/servers/<server_id>` holds a retained announcement, republished every `interval_s`:

    {"id": "gpu-1", "endpoint": "10.0.0.2:50051", "model": "gemma3-12b",
     "fingerprint": "sha256:...", "tokenizer_files": "sha256:...", "load": 0.25, "sessions": 16,
     "online": true}

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

from sled.wire.endpoint import parse_endpoint
from sled.backoff import Backoff, broker_backoff
from sled.mqtt import Broker, MqttConnection
from sled.wire.topics import (DEFAULT_PREFIX, check_topic_level, check_topic_prefix, encode,
                              server_topic)
from verify_server.service import VerifierService

log = logging.getLogger("sled.server.announce")


@dataclass(slots=True)
class AnnounceConfig:
    broker: Broker
    server_id: str                   # one topic level: no whitespace, '/', '+' or '#'
    endpoint: str                    # HOST:PORT devices dial
    topic_prefix: str = DEFAULT_PREFIX
    interval_s: float = 5.0
    backoff: Backoff = field(default_factory=broker_backoff)
    tls_name: str = ""               # the name on the server's certificate, when not its host

    def __post_init__(self) -> None:
        check_topic_level(self.server_id, f"server id {self.server_id!r}")
        check_topic_prefix(self.topic_prefix)
        parse_endpoint(self.endpoint, "announce endpoint")
        if self.interval_s <= 0:
            raise ValueError(f"announce interval must be > 0, got {self.interval_s}")


class Announcer:
    def __init__(self, service: VerifierService, config: AnnounceConfig) -> None:
        self.service = service
        self.config = config
        self.topic = server_topic(config.topic_prefix, config.server_id)
        self.connection = MqttConnection(config.broker, f"sled-server-{config.server_id}", self.topic,
                                         will=self.farewell(), backoff=config.backoff,
                                         meanwhile="still serving", logger=log)

    def load(self) -> float:
        """How busy the server is, 0..1: sessions against the limit, or KV committed, the larger."""
        core = self.service.core
        sessions = len(core.sessions) / core.settings.max_sessions
        pool = core.pool
        kv = pool.committed_blocks / pool.usable_blocks if pool.usable_blocks else 1.0
        return round(min(1.0, max(sessions, kv)), 4)

    def announcement(self) -> dict:
        core = self.service.core
        target = core.target
        return {"id": self.config.server_id, "endpoint": self.config.endpoint,
                "model": target.model_id, "fingerprint": target.fingerprint,
                "tokenizer_files": target.tokenizer_files_sha256, "load": self.load(),
                "sessions": len(core.sessions), "online": core.accepting,
                **({"tls_name": self.config.tls_name} if self.config.tls_name else {})}

    def farewell(self) -> dict:
        return {"id": self.config.server_id, "online": False}

    async def run(self) -> None:
        """Announce until cancelled (then say offline); the server keeps serving whatever the
        broker does."""
        await self.connection.run(self._announce)

    async def _announce(self, client: aiomqtt.Client) -> None:
        log.info("announcing %s as %s on %s (%s)", self.config.endpoint, self.config.server_id,
                 self.config.broker.address, self.topic)
        while True:
            await client.publish(self.topic, encode(self.announcement()), qos=1, retain=True)
            await asyncio.sleep(self.config.interval_s)
