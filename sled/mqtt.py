"""MQTT connections, shared by verify servers and devices: one way to reach a broker
(credentials, TLS, last will), one connection that stays up (MqttConnection) and messages that
say what a broker refused. The topics and payloads they carry: sled.wire.topics."""
from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiomqtt
from aiomqtt.exceptions import MqttConnectError

from sled.backoff import Backoff, broker_backoff
from sled.wire.topics import encode

log = logging.getLogger("sled.mqtt")

# CONNACK codes for refused credentials: MQTT 3.1.1 (4, 5) and their MQTT 5 reason codes.
REFUSED_CREDENTIALS = {4, 5, 134, 135}


@dataclass(frozen=True, slots=True)
class Broker:
    """Where the broker is and how to log in; `client()` makes one connection attempt's client."""
    host: str
    port: int = 1883
    username: str = ""
    password: str = ""
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    keepalive_s: int = 15
    timeout_s: float = 5.0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.ca_file or self.cert_file)

    def client(self, identifier: str, will: aiomqtt.Will | None = None) -> "Client":
        tls = aiomqtt.TLSParameters(ca_certs=self.ca_file, certfile=self.cert_file,
                                    keyfile=self.key_file) if self.uses_tls else None
        return Client(self.host, self.port, username=self.username or None,
                      password=self.password or None, identifier=identifier, will=will,
                      keepalive=self.keepalive_s, timeout=self.timeout_s, tls_params=tls)


class Client(aiomqtt.Client):
    """aiomqtt's client, except that a cancel stays a cancel. Two places lose one:

    - aiomqtt waits for each step (connect, a QoS 1 publish, subscribe, disconnect) with
      asyncio.wait_for, which before Python 3.12 returns the step's result and drops the cancel
      when the cancel lands as the step completes. A loop that publishes every interval (the
      server's announcer, the device's telemetry) then goes on publishing after its clean stop,
      and whoever awaits it (sled serve's shutdown, the device's close) waits forever.
    - aiomqtt's __aexit__ waits for the broker connection to end, and when paho reports that end
      as unclean (a reset or closed socket while the DISCONNECT goes out) it raises
      MqttCodeError("Unexpected disconnection") in place of the CancelledError it was handed. A
      loop that reconnects on MqttError (MqttConnection, the lab's listener) then takes its own
      cancel for a lost broker and connects again.
    """

    async def _wait_for(self, fut: Awaitable, timeout: float | None):
        if timeout is None:
            timeout = self.timeout
        step = asyncio.ensure_future(fut)
        try:
            done, _ = await asyncio.wait({step}, timeout=None if timeout == math.inf else timeout)
        except asyncio.CancelledError:      # raised whether or not the step has just completed
            step.cancel()
            raise
        if not done:
            step.cancel()
            raise aiomqtt.MqttError("Operation timed out")
        return step.result()

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            await super().__aexit__(exc_type, exc, tb)
        except aiomqtt.MqttError:
            if exc_type is None or not issubclass(exc_type, asyncio.CancelledError):
                raise
            log.debug("MQTT: the connection ended uncleanly while cancelled")


def refused_credentials(error: BaseException) -> bool:
    """The broker answered the CONNECT with 'bad username or password' / 'not authorized'."""
    code = getattr(error, "rc", None)
    code = getattr(code, "value", code)
    return isinstance(error, MqttConnectError) and code in REFUSED_CREDENTIALS   # a CONNACK, not a lost link


def describe(error: BaseException, broker: Broker) -> str:
    """One line for logs and status that names the broker and what went wrong."""
    if refused_credentials(error):
        who = f"user {broker.username!r}" if broker.username else "anonymous clients"
        return (f"MQTT broker {broker.address} refused the credentials ({who}): {error}; "
                f"check the MQTT username and password")
    return f"MQTT broker {broker.address}: {error or type(error).__name__}"


class MqttConnection:
    """One client's connection to the broker, kept up until cancelled.

    run(work) connects with a last will (`will` retained on `presence_topic`), hands the client
    to `work`, which returns only by raising, and when the connection is lost records the problem,
    backs off (slowly after refused credentials) and connects again. A cancel, the clean stop,
    leaves `goodbye` (default: the will) on the same retained topic before it propagates.

        connection = MqttConnection(broker, "sled-server-gpu-1", "sled/servers/gpu-1",
                                    will={"id": "gpu-1", "online": False})
        task = asyncio.create_task(connection.run(announce))   # announce(client) publishes
    """

    def __init__(self, broker: Broker, identifier: str, presence_topic: str, will: dict,
                 goodbye: dict | None = None, backoff: Backoff | None = None,
                 meanwhile: str = "", logger: logging.Logger = log) -> None:
        self.broker, self.identifier, self.presence_topic = broker, identifier, presence_topic
        self.will, self.goodbye = will, will if goodbye is None else goodbye
        self.backoff = backoff or broker_backoff()
        self.meanwhile = meanwhile             # what goes on without the broker, for the log
        self.log = logger
        self.client: aiomqtt.Client | None = None    # the live connection, if any
        self.connected = False
        self.problem = ""                      # what went wrong last ("" once connected)
        self.refused = False                   # the last attempt's credentials were refused

    def summary(self) -> dict:
        return {"broker": self.broker.address, "connected": self.connected, "problem": self.problem}

    async def run(self, work: Callable[[aiomqtt.Client], Awaitable[None]]) -> None:
        """Stay connected and working until cancelled."""
        while True:
            try:
                await self._session(work)
            except aiomqtt.MqttError as error:
                self._lost(error)
            except Exception as error:   # a bad TLS file, a bug: report it and keep trying
                self.log.exception("MQTT connection %s failed", self.identifier)
                self._lost(error)
            await asyncio.sleep(self.backoff.next(self.refused))

    async def _session(self, work: Callable[[aiomqtt.Client], Awaitable[None]]) -> None:
        """One connection: connect with the will, work, say goodbye when cancelled."""
        will = aiomqtt.Will(self.presence_topic, encode(self.will), qos=1, retain=True)
        async with self.broker.client(self.identifier, will) as client:
            self._connected(client)
            try:
                await work(client)
            except asyncio.CancelledError:
                await self._say_goodbye(client)
                raise
            finally:
                self.client, self.connected = None, False

    def _connected(self, client: aiomqtt.Client) -> None:
        self.client, self.connected, self.problem, self.refused = client, True, "", False
        self.backoff.reset()
        self.log.info("MQTT: connected to %s as %s", self.broker.address, self.identifier)

    def _lost(self, error: BaseException) -> None:
        """Record what went wrong; log it once, as an error when the credentials were refused."""
        problem, refused = describe(error, self.broker), refused_credentials(error)
        if problem != self.problem:
            meanwhile = f"{self.meanwhile}; " if self.meanwhile else ""
            (self.log.error if refused else self.log.warning)("%s (%sretrying)", problem, meanwhile)
        self.problem, self.refused, self.connected = problem, refused, False

    async def _say_goodbye(self, client: aiomqtt.Client) -> None:
        """A clean stop leaves the same kind of retained message the last will would."""
        try:
            await client.publish(self.presence_topic, encode(self.goodbye), qos=1, retain=True,
                                 timeout=2.0)
        except aiomqtt.MqttError as error:
            self.log.warning("MQTT: could not say offline on %s: %s", self.presence_topic, error)
