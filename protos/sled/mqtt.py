"""The MQTT side of the contract, shared by verify servers and devices: the topic layout, one way
to reach a broker (credentials, TLS, last will) and messages that say what a broker refused.

    <prefix>/servers/<server_id>                     retained announcement of a verify server
    <prefix>/devices/<device_id>/status              retained device status (last will: offline)
    <prefix>/devices/<device_id>/telemetry           every few seconds
    <prefix>/devices/<device_id>/config              settings changes in ...
    <prefix>/devices/<device_id>/config/applied      ... and what became of them out
    <prefix>/devices/<device_id>/requests            generation requests in ...
    <prefix>/devices/<device_id>/responses/<id>      ... and their streamed tokens out

Payloads are UTF-8 JSON objects; an empty retained payload clears a topic.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

import aiomqtt

DEFAULT_PREFIX = "sled"

# CONNACK codes for refused credentials: MQTT 3.1.1 (4, 5) and their MQTT 5 reason codes.
REFUSED_CREDENTIALS = {4, 5, 134, 135}


def server_topic(prefix: str, server_id: str = "+") -> str:
    return f"{prefix}/servers/{server_id}"


def device_topic(prefix: str, device_id: str, leaf: str) -> str:
    return f"{prefix}/devices/{device_id}/{leaf}"


def topic_safe(name: str) -> bool:
    """Whether `name` can be one topic level (no separators or wildcards)."""
    return bool(name) and not any(c in name for c in "/#+\0")


def encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode(payload) -> dict:
    """A JSON object from a payload; ValueError says what is wrong with it."""
    if isinstance(payload, (bytes, bytearray)):
        try:
            payload = payload.decode()
        except UnicodeDecodeError:
            raise ValueError("the payload is not UTF-8 text") from None
    try:
        message = json.loads(payload)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the payload is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ValueError(f"the payload must be a JSON object, got {type(message).__name__}")
    return message


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

    def client(self, identifier: str, will: aiomqtt.Will | None = None) -> aiomqtt.Client:
        tls = aiomqtt.TLSParameters(ca_certs=self.ca_file, certfile=self.cert_file,
                                    keyfile=self.key_file) if self.uses_tls else None
        return aiomqtt.Client(self.host, self.port, username=self.username or None,
                              password=self.password or None, identifier=identifier, will=will,
                              keepalive=self.keepalive_s, timeout=self.timeout_s, tls_params=tls)


def refused_credentials(error: BaseException) -> bool:
    """The broker answered the CONNECT with 'bad username or password' / 'not authorized'."""
    code = getattr(error, "rc", None)
    code = getattr(code, "value", code)
    return isinstance(error, aiomqtt.MqttCodeError) and code in REFUSED_CREDENTIALS


def describe(error: BaseException, broker: Broker) -> str:
    """One line for logs and status that names the broker and what went wrong."""
    if refused_credentials(error):
        who = f"user {broker.username!r}" if broker.username else "anonymous clients"
        return (f"MQTT broker {broker.address} refused the credentials ({who}): {error}; "
                f"check the MQTT username and password")
    return f"MQTT broker {broker.address}: {error or type(error).__name__}"


class Backoff:
    """Delays between connection attempts: doubling with jitter up to `most`, and never below
    `after_refusal` once the broker has refused the credentials (retrying fast cannot help)."""

    def __init__(self, first: float = 0.5, most: float = 30.0, after_refusal: float = 30.0) -> None:
        self.first, self.most, self.after_refusal = first, most, after_refusal
        self.current = first

    def next(self, refused: bool = False) -> float:
        delay = self.current * random.uniform(0.8, 1.2)
        self.current = min(self.current * 2, self.most)
        return max(delay, self.after_refusal) if refused else delay

    def reset(self) -> None:
        self.current = self.first
