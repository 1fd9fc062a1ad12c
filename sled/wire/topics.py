"""The MQTT side of the wire contract: the topic layout, the one check of a topic level and the
payloads (UTF-8 JSON objects; an empty retained payload clears a topic).

    <prefix>/servers/<server_id>                     retained announcement of a verify server
    <prefix>/devices/<device_id>/status              retained device status (last will: offline)
    <prefix>/devices/<device_id>/telemetry           every few seconds
    <prefix>/devices/<device_id>/config              settings changes in ...
    <prefix>/devices/<device_id>/config/applied      ... and what became of them out
    <prefix>/devices/<device_id>/requests            generation requests in ...
    <prefix>/devices/<device_id>/responses/<id>      ... and their streamed tokens out
"""
from __future__ import annotations

import json

DEFAULT_PREFIX = "sled"


def server_topic(prefix: str, server_id: str = "+") -> str:
    return f"{prefix}/servers/{server_id}"


def device_topic(prefix: str, device_id: str, leaf: str) -> str:
    return f"{prefix}/devices/{device_id}/{leaf}"


def is_topic_level(name: object) -> bool:
    """Whether `name` can be one topic level: a non-empty string of printable characters without
    whitespace, the separator '/' or the wildcards '+' and '#'."""
    return isinstance(name, str) and bool(name) and all(
        c.isprintable() and not c.isspace() and c not in "/+#" for c in name)


def check_topic_level(name: object, what: str) -> str:
    """`name` when it can be one topic level (an id: device, server, request); else ValueError."""
    if not is_topic_level(name):
        raise ValueError(f"{what} must be a non-empty string without whitespace, '/', '+' or '#'")
    return name


def check_topic_prefix(prefix: object) -> str:
    """`prefix` when it is one or more topic levels joined by '/' ("sled", "site-3/sled")."""
    if not isinstance(prefix, str) or not all(is_topic_level(level) for level in prefix.split("/")):
        raise ValueError("the topic prefix must be topic levels joined by '/', each non-empty "
                         "without whitespace, '+' or '#'")
    return prefix


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
