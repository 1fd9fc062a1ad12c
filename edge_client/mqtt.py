"""The device's MQTT control plane: status and telemetry out, live settings and generation
requests in, verify servers discovered from their announcements.

Topics under `<prefix>/devices/<id>/` (prefix: settings.mqtt.topic_prefix, "sled" by default):

    status            retained {status..., "online": true}; the last will (and a clean stop)
                      leaves {"id", "online": false, "state": "offline"} there
    telemetry         every mqtt.telemetry_s: the status with drafter, mode, emulation,
                      tokens/s, acceptance, RTT, active sessions and CPU load, plus "time"
                      (Unix seconds)
    config            in: a JSON object of settings changes, applied live (Device.apply)
    config/applied    out: {settings.public()..., "ok": true}, retained (the settings in force);
                      a refused change answers {"ok": false, "error"} NOT retained, so the
                      retained message keeps saying which settings are in force
    requests          in: {"request_id", "prompt" | "prompt_ids", "max_tokens", "temperature",
                      "top_p", "top_k", "seed", "stop_ids", "ignore_eos"}; request_id: one topic
                      level of at most MAX_REQUEST_ID_CHARS (128) characters
    responses/<id>    out: one message per chunk {"request_id", "index", "token_ids", "text"};
                      the last adds "finish_reason", "usage" and "lossless" (false only
                      for the opt-in drafting-alone fallback); a failure is
                      {"request_id", "error", "kind"} (on responses/invalid when the request
                      has no usable request_id, which comes back only as a short escaped excerpt)

and `<prefix>/servers/+`: verify server announcements (verify_server.announce) feed the
directory; {"online": false} or an empty retained payload withdraws a server.

    control = DeviceMqtt(device)        # device.status()["mqtt"] reports on it from now on
    task = asyncio.create_task(control.run())   # reconnects forever; cancel to stop cleanly
    control.connection.connected, control.connection.problem   # the broker link (sled.mqtt)

Requests in flight when the broker connection drops are cancelled (their asker can send them
again); a broker that refuses the credentials is retried slowly while the device keeps serving
its local API.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time

import aiomqtt

from sled.backoff import Backoff
from edge_client.daemon import Device, DeviceError, Request
from edge_client.device_requests import MAX_REQUEST_ID_CHARS
from edge_client.text import OutputText
from sled.wire.endpoint import parse_endpoint
from sled.mqtt import Broker, MqttConnection
from sled.wire.topics import decode, device_topic, encode, is_topic_level, server_topic
from sled.printable import printable
from sled.wire.sampling import Sampling

log = logging.getLogger("sled.device.mqtt")

REQUEST_FIELDS = {"request_id", "prompt", "prompt_ids", "max_tokens", "temperature", "top_p",
                  "top_k", "seed", "stop_ids", "ignore_eos"}


def broker_of(device: Device) -> Broker:
    mqtt = device.settings.mqtt
    return Broker(mqtt.host, mqtt.port, username=mqtt.username,
                  password=mqtt.password.get_secret_value(), tls=mqtt.tls,
                  ca_file=str(mqtt.ca_file) if mqtt.ca_file else None,
                  cert_file=str(mqtt.cert_file) if mqtt.cert_file else None,
                  key_file=str(mqtt.key_file) if mqtt.key_file else None,
                  keepalive_s=mqtt.keepalive_s)


def _tls_name(value) -> str:
    """The certificate name an announcement claims: one printable DNS-like word, else none."""
    name = value if isinstance(value, str) else ""
    if len(name) > 253 or not all(c.isalnum() or c in ".-_*" for c in name):
        raise ValueError(f"tls_name {printable(name, 60)!r} is not a host name")
    return name


class DeviceMqtt:
    """The device's link to the broker; `backoff` spaces its attempts at the broker (default:
    sled.backoff.broker_backoff())."""

    def __init__(self, device: Device, backoff: Backoff | None = None) -> None:
        self.device = device
        self.broker = broker_of(device)
        self.prefix = device.settings.mqtt.topic_prefix
        self.connection = MqttConnection(
            self.broker, f"sled-device-{device.settings.id}", self.topic("status"),
            will=self._offline("the device lost its MQTT connection"),
            goodbye=self._offline("the device stopped"), backoff=backoff,
            meanwhile="the device keeps serving locally", logger=log)
        self._status_changed = asyncio.Event()
        self._servers_changed = asyncio.Event()
        self._config_lock = asyncio.Lock()
        device.mqtt = self
        device.listeners.append(self._status_changed.set)

    def topic(self, leaf: str) -> str:
        return device_topic(self.prefix, self.device.settings.id, leaf)

    def summary(self) -> dict:
        return self.connection.summary()

    async def run(self) -> None:
        """Stay connected until cancelled (then say offline); the device serves its local API
        whatever the broker does."""
        await self.connection.run(self._serve)

    async def _serve(self, client: aiomqtt.Client) -> None:
        """One connection's work; returns only by raising (a lost connection, a cancel)."""
        await client.subscribe([(self.topic("config"), 1), (self.topic("requests"), 1),
                                (server_topic(self.prefix), 1)])
        self._status_changed.set()
        jobs: set[asyncio.Task] = set()
        workers = [asyncio.create_task(self._say_status(client)),
                   asyncio.create_task(self._send_telemetry(client)),
                   asyncio.create_task(self._follow_servers()),
                   asyncio.create_task(self._receive(client, jobs))]
        try:
            done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            raise aiomqtt.MqttError("the connection ended")
        finally:
            running = workers + list(jobs)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    # -- what the device says ---------------------------------------------------------------
    def _online(self) -> dict:
        return {**self.device.status(), "online": True}

    def _offline(self, reason: str) -> dict:
        return {"id": self.device.settings.id, "online": False, "state": "offline", "reason": reason}

    async def _say_status(self, client: aiomqtt.Client) -> None:
        """The retained status, again whenever the device's state or settings change."""
        while True:
            await self._status_changed.wait()
            self._status_changed.clear()
            await client.publish(self.topic("status"), encode(self._online()), qos=1, retain=True)

    async def _send_telemetry(self, client: aiomqtt.Client) -> None:
        while True:
            await client.publish(self.topic("telemetry"), encode({**self.device.status(),
                                                                  "time": round(time.time(), 3)}))
            await asyncio.sleep(self.device.settings.mqtt.telemetry_s)

    # -- what the device hears --------------------------------------------------------------
    async def _receive(self, client: aiomqtt.Client, jobs: set[asyncio.Task]) -> None:
        """Dispatch incoming messages; config and requests run as their own tasks so a long
        generation never holds up the next message."""
        async for message in client.messages:
            topic = message.topic.value
            if message.topic.matches(server_topic(self.prefix)):
                self._on_announcement(topic.rsplit("/", 1)[1], message.payload)
            elif topic == self.topic("config"):
                _spawn(jobs, self._on_config(client, message.payload))
            elif topic == self.topic("requests"):
                _spawn(jobs, self._on_request(client, message.payload))

    def _on_announcement(self, server_id: str, payload) -> None:
        directory = self.device.directory
        if not payload:
            directory.withdraw(server_id)           # the retained announcement was cleared
        else:
            try:
                announcement = decode(payload)
                if announcement.get("online") is False:
                    directory.withdraw(server_id)    # a last will or a clean stop
                else:
                    directory.announce(server_id, str(parse_endpoint(announcement.get("endpoint"))),
                                       model=str(announcement.get("model") or ""),
                                       fingerprint=str(announcement.get("fingerprint") or ""),
                                       files_sha256=str(announcement.get("tokenizer_files") or ""),
                                       load=float(announcement.get("load") or 0.0),
                                       tls_name=_tls_name(announcement.get("tls_name")))
            except (ValueError, TypeError) as error:
                log.warning("MQTT: ignoring the announcement of server %s: %s", server_id, error)
                return
        self._servers_changed.set()

    async def _follow_servers(self) -> None:
        """Let the device re-choose its server after announcements (coalesced)."""
        while True:
            await self._servers_changed.wait()
            self._servers_changed.clear()
            try:
                await self.device.servers_changed()
            except Exception:
                log.exception("MQTT: could not take in the announced servers")

    async def _on_config(self, client: aiomqtt.Client, payload) -> None:
        if not payload:
            return                                   # a retained config was cleared
        async with self._config_lock:                # changes apply in the order they came
            try:
                applied = await self.device.apply(decode(payload))
            except ValueError as error:              # SettingsError is a ValueError
                log.warning("MQTT: config refused: %s", error)
                await client.publish(self.topic("config/applied"),
                                     encode({"ok": False, "error": str(error)}), qos=1)
                return
            log.info("MQTT: config applied")
            await client.publish(self.topic("config/applied"), encode({**applied.public(), "ok": True}),
                                 qos=1, retain=True)

    async def _on_request(self, client: aiomqtt.Client, payload) -> None:
        asked_id = None
        try:
            message = decode(payload)
            asked_id = message.get("request_id")
            await self._stream(client, parse_request(message, self.device.tokenizer))
        except ValueError as error:
            await self._respond_error(client, asked_id, "invalid", str(error))
        except DeviceError as error:
            await self._respond_error(client, asked_id, error.kind, error.message)
        except aiomqtt.MqttError:
            raise
        except Exception as error:
            log.exception("MQTT: request %s failed", _shown(asked_id))
            await self._respond_error(client, asked_id, "internal",
                                      f"{type(error).__name__}: {printable(str(error), 200)}")

    async def _stream(self, client: aiomqtt.Client, request: Request) -> None:
        """One message per chunk of committed tokens; the last carries how it ended."""
        topic = self.topic(f"responses/{request.request_id}")
        text = OutputText(self.device.tokenizer)
        index, produced, lossless = 0, 0, True
        async for chunk in self.device.stream(request):
            produced += len(chunk.token_ids)
            lossless = lossless and chunk.lossless
            if not chunk.token_ids and chunk.finish_reason is None:
                continue
            text.add(chunk.token_ids)
            message = {"request_id": request.request_id, "index": index, "token_ids": chunk.token_ids,
                       "text": text.take(final=chunk.finish_reason is not None)}
            if chunk.finish_reason is not None:
                message.update(finish_reason=chunk.finish_reason, lossless=lossless, usage={
                    "prompt_tokens": len(request.prompt_ids), "completion_tokens": produced,
                    "total_tokens": len(request.prompt_ids) + produced})
            await client.publish(topic, encode(message), qos=1)
            index += 1

    async def _respond_error(self, client: aiomqtt.Client, request_id, kind: str, error: str) -> None:
        """On the request's own topic when its id can be one; else on responses/invalid, where
        the id comes back only as a short printable excerpt (a 200 KB object is not echoed)."""
        usable = usable_request_id(request_id)
        topic = self.topic(f"responses/{request_id if usable else 'invalid'}")
        shown = request_id if usable or request_id is None else _shown(request_id)
        await client.publish(topic, encode({"request_id": shown, "error": error, "kind": kind}),
                             qos=1)


def _spawn(jobs: set[asyncio.Task], work) -> None:
    """Run one message's work; a job that ends early is forgotten (its failure already logged or
    answered; a lost connection shows up in the message loop too)."""
    def forget(task: asyncio.Task) -> None:
        jobs.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("MQTT: a job ended with %r", task.exception())

    task = asyncio.create_task(work)
    jobs.add(task)
    task.add_done_callback(forget)


# -- requests -----------------------------------------------------------------------------
def parse_request(message: dict, tokenizer) -> Request:
    """A Request from an MQTT request message; DeviceError("invalid") names what is wrong."""
    unknown = sorted(set(message) - REQUEST_FIELDS)
    if unknown:
        shown = ", ".join(printable(name, 64) for name in unknown[:8])
        raise DeviceError("invalid", f"unknown field {shown}{' ...' if len(unknown) > 8 else ''} "
                                     f"(known: {', '.join(sorted(REQUEST_FIELDS))})")
    try:
        request_id = check_request_id(message.get("request_id"))
        sampling = Sampling(temperature=_number(message, "temperature", 0.0),
                            top_k=_integer(message, "top_k", 0), top_p=_number(message, "top_p", 1.0),
                            seed=_integer(message, "seed", None))
    except ValueError as error:
        raise DeviceError("invalid", str(error)) from None
    ignore_eos = message.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise DeviceError("invalid", f"ignore_eos must be true or false, got {_shown(ignore_eos)}")
    return Request(_prompt_ids(message, tokenizer), max_tokens=_integer(message, "max_tokens", None),
                   sampling=sampling, stop_ids=_ids(message, "stop_ids", []), ignore_eos=ignore_eos,
                   request_id=request_id)


def usable_request_id(request_id) -> bool:
    """Whether a request id can name its responses' topic and be echoed in each of them."""
    return is_topic_level(request_id) and len(request_id) <= MAX_REQUEST_ID_CHARS


def check_request_id(request_id) -> str:
    """REQUEST_ID when usable; else ValueError saying what one must be (never echoing it)."""
    if not usable_request_id(request_id):
        raise ValueError(f"request_id must be a string of 1 to {MAX_REQUEST_ID_CHARS} printable "
                         f"characters without whitespace, '/', '+' or '#'")
    return request_id


def _prompt_ids(message: dict, tokenizer) -> list[int]:
    if ("prompt" in message) == ("prompt_ids" in message):
        raise DeviceError("invalid", "give exactly one of prompt (text) and prompt_ids")
    if "prompt_ids" in message:
        return _ids(message, "prompt_ids", [])
    prompt = message["prompt"]
    if not isinstance(prompt, str):
        raise DeviceError("invalid", f"prompt must be text, got {type(prompt).__name__}")
    if tokenizer is None:
        raise DeviceError("unavailable", "the device has no tokenizer yet: send prompt_ids")
    return list(tokenizer(prompt).input_ids)


def _integer(message: dict, key: str, default):
    value = message.get(key, default)
    if value is default or value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise DeviceError("invalid", f"{key} must be an integer, got {_shown(value)}")
    return value


def _number(message: dict, key: str, default: float) -> float:
    value = message.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DeviceError("invalid", f"{key} must be a number, got {_shown(value)}")
    try:
        number = float(value)
    except OverflowError:   # an integer beyond float's range (10**400)
        number = math.inf
    if not math.isfinite(number):
        raise DeviceError("invalid", f"{key} must be a finite number, got {_shown(value)}")
    return number


def _shown(value) -> str:
    """A value the asker sent, as it appears in an answer: its repr, escaped and cut short."""
    return printable(repr(value), 64)


def _ids(message: dict, key: str, default: list[int]) -> list[int]:
    value = message.get(key, default)
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise DeviceError("invalid", f"{key} must be a list of token ids (integers)")
    return list(value)
