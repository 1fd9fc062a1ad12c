"""The device daemon's settings: one validated model, read from a TOML or YAML file, the
environment and command-line flags (in rising priority).

Every key has all three spellings. Nested keys join with "." in flags and "__" in variables:

    [policy]                      SLED_DEVICE_POLICY__DRAFT_LEN=6     --policy.draft-len 6
    draft_len = 6

An unknown key or a bad value stops start-up with a message that names the key and where it
came from (`SettingsError`).
"""
from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
import pydantic_settings
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from edge_client.emulation import board, check_link
from sled.wire.endpoint import parse_endpoint
from sled.wire.topics import DEFAULT_PREFIX, check_topic_level, check_topic_prefix
from sled.settings_files import SettingsError, file_source, settings_file

ENV_PREFIX = "SLED_DEVICE_"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PolicySettings(Section):
    """How each session drafts."""
    # "adaptive": the k with the most expected tokens/s; "auto": the server's suggestion; or a fixed k
    draft_len: Literal["adaptive", "auto"] | int = "adaptive"
    max_draft_len: int = Field(16, ge=1, le=64)
    # stop a draft early when the drafter's top probability falls below this (0: never)
    min_confidence: float = Field(0.0, ge=0.0, lt=1.0)
    # keep drafting on the optimistic path while a verdict is in flight
    pipeline: bool = True
    # SAT hints asked per verdict (a SAT-tuned target)
    lookahead: int = Field(0, ge=0, le=16)
    # "measured": a draft starts with the hints only while they beat the drafter; "always"
    hints: Literal["measured", "always"] = "measured"
    # candidates per draft position: > 1 sends greedy drafts as trees (cacheback and model drafters)
    tree: int = Field(1, ge=1, le=4)

    @field_validator("draft_len")
    @classmethod
    def _positive(cls, value):
        if isinstance(value, int) and not 1 <= value <= 64:
            raise ValueError("a fixed draft_len must be between 1 and 64")
        return value


class MqttSettings(Section):
    """The MQTT control plane; leave host empty to run without a broker."""
    host: str = ""
    port: int = Field(1883, ge=1, le=65535)
    username: str = ""
    password: SecretStr = SecretStr("")
    tls: bool = False
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    keepalive_s: int = Field(15, ge=2, le=3600)
    telemetry_s: float = Field(10.0, gt=0)
    topic_prefix: str = DEFAULT_PREFIX

    @field_validator("topic_prefix")
    @classmethod
    def _topic_levels(cls, value: str) -> str:
        return check_topic_prefix(value)

    @field_validator("ca_file", "cert_file", "key_file", mode="before")
    @classmethod
    def _empty_is_none(cls, value):
        return None if value == "" else value

    @property
    def enabled(self) -> bool:
        return bool(self.host)


class EmulationSettings(Section):
    """Lab emulation (sled lab): a board's drafting speed and a network link, in user space."""
    # a device profile (lab.profiles: "pi5", "pi4:draft_ms_per_token=50"): pads each draft to
    # the board's time; "" = drafting as fast as this machine does
    device: str = ""
    # a link profile ("wifi", "lte:rtt_ms=60"): the session streams get its delays; "" = none
    link: str = ""
    # the link is cut: open streams fail as with a lost connection, new ones wait for it
    link_down: bool = False

    @field_validator("device")
    @classmethod
    def _device_profile(cls, value: str) -> str:
        if value:
            board(value)                # a ValueError names the bad profile
        return value

    @field_validator("link")
    @classmethod
    def _link_profile(cls, value: str) -> str:
        if value:
            check_link(value)
        return value


# A device id is one MQTT topic level and part of the broker client id: kept short.
MAX_DEVICE_ID_CHARS = 128
# a browser origin as api_origins lists it: scheme://host[:port], no path
ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://(\[[0-9A-Fa-f:.]+\]|[^\s/:@\[\]]+)(:\d{1,5})?")


class DeviceSettings(BaseSettings):
    """Everything `sled device` needs; defaults run a local n-gram device against one server."""
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__",
                                      extra="forbid", validate_assignment=True)

    id: str = Field(default_factory=socket.gethostname, max_length=MAX_DEVICE_ID_CHARS)  # one MQTT topic level
    # verify servers, HOST:PORT; MQTT announcements add more
    servers: list[str] = Field(default_factory=lambda: ["127.0.0.1:50051"])
    drafter: str = "ngram"
    # the target's tokenizer: a local folder, or empty to fetch it from a server (cached on disk)
    tokenizer: str = ""
    # the local OpenAI-compatible API (port 0: any free port)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # the model name /v1/models lists and requests may use (default: the server's model id)
    model_name: str = ""
    max_sessions: int = Field(16, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    # how long a session waits for a server (first open or resume) before it fails
    reconnect_s: float = Field(30.0, ge=0)
    # how long a server may take to answer a session's open (its prefill, queued behind other
    # work) and each draft with its verdict; silent longer, it is treated as lost (resume)
    open_timeout_s: float = Field(120.0, gt=0)
    verdict_timeout_s: float = Field(60.0, gt=0)
    # how many times a request reopens on a server that went silent, or dropped the session
    # without a verdict; the next time ends the request (503, an MQTT error) unless another
    # compatible server takes it
    silent_retries: int = Field(1, ge=0)
    # how long fetching the target's tokenizer from a server may take, all files together
    tokenizer_timeout_s: float = Field(60.0, gt=0)
    # with no server reachable, go on with the drafter alone: lossy, marked "lossless": false
    unverified_fallback: bool = False
    # "draft": this device drafts and the server verifies; "server": the server generates every
    # token (centralized serving, the lab's baseline)
    mode: Literal["draft", "server"] = "draft"
    # --- the verify servers' transport and this device's identity ---
    # CA bundle that signs the servers' certificates: set, every server is dialed with TLS and
    # must prove it holds a certificate this CA signed ("" = plaintext gRPC)
    server_ca: Path | None = None
    # this device's certificate and key, for servers that ask for one (mutual TLS)
    client_cert: Path | None = None
    client_key: Path | None = None
    # names a server's certificate may carry (an announced server naming another is never
    # used); empty: the name dialed (the endpoint's host)
    server_names: list[str] = Field(default_factory=list)
    # the bearer token this device sends on every call (sled serve --auth-tokens)
    token: SecretStr = SecretStr("")
    # --- the local API's access ---
    # clients of the local API must send `Authorization: Bearer API_KEY` ("" = no key)
    api_key: SecretStr = SecretStr("")
    # serve a non-loopback host without an api_key (refused otherwise)
    api_open: bool = False
    # Host names the API answers to besides IP literals, localhost and `host` (with no api_key
    # any other is a 403: DNS rebinding), e.g. ["pi5-kitchen.lan"]
    api_hosts: list[str] = Field(default_factory=list)
    # browser origins (SCHEME://HOST[:PORT]) whose pages may call the API, with CORS; with no
    # api_key a request from any other origin is a 403
    api_origins: list[str] = Field(default_factory=list)
    policy: PolicySettings = PolicySettings()
    mqtt: MqttSettings = MqttSettings()
    emulation: EmulationSettings = EmulationSettings()

    @field_validator("id")
    @classmethod
    def _topic_level(cls, value: str) -> str:
        return check_topic_level(value, "the device id")

    @field_validator("server_ca", "client_cert", "client_key", mode="before")
    @classmethod
    def _no_file(cls, value):
        return None if value == "" else value

    @field_validator("servers")
    @classmethod
    def _endpoints(cls, value: list[str]) -> list[str]:
        return [str(parse_endpoint(address, "server")) for address in value]

    @field_validator("api_hosts")
    @classmethod
    def _host_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not name or any(c.isspace() or c in "/@" for c in name):
                raise ValueError(f"{name!r} is not a host name (e.g. \"pi5-kitchen.lan\")")
        return value

    @field_validator("api_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            if not ORIGIN.fullmatch(origin.rstrip("/")):
                raise ValueError(f"{origin!r} is not an origin: SCHEME://HOST[:PORT], "
                                 f"e.g. \"http://localhost:3000\"")
        return value

    def public(self) -> dict[str, Any]:
        """The settings as plain data with secrets masked (status, the MQTT echo)."""
        data = self.model_dump(mode="json")
        for section, key in (("mqtt", "password"), (None, "token"), (None, "api_key")):
            values = data[section] if section else data
            if values[key]:
                values[key] = "**********"
        return data

    def updated(self, changes: dict[str, Any]) -> "DeviceSettings":
        """A validated copy with `changes` (nested dicts merge key by key) applied."""
        merged = _merge(self.model_dump(), changes)
        try:
            return type(self).model_validate(merged)
        except ValidationError as exc:
            raise SettingsError(describe(exc, "the update")) from None


# Keys that take effect at once when changed at run time; the rest need a restart.
LIVE_KEYS = {"servers", "drafter", "policy", "max_new_tokens", "reconnect_s", "unverified_fallback",
             "max_sessions", "mode", "emulation", "open_timeout_s", "verdict_timeout_s",
             "silent_retries"}


def _merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def describe(exc: ValidationError, origin: str) -> str:
    """One line per bad key: `policy.draft_len: ... (got 'x')`."""
    lines = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"] if not isinstance(part, int)) or "(root)"
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown key (not a setting of sled device)"
        got = error.get("input")
        shown = "" if error["type"] == "extra_forbidden" or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {key}: {message}{shown}")
    return f"bad device settings in {origin}:\n" + "\n".join(lines)


def load_settings(config_file: str | Path | None = None, args: list[str] | None = None,
                  **overrides: Any) -> DeviceSettings:
    """Read the file (TOML or YAML by extension), then SLED_DEVICE_* variables, then the flags
    in `args` (`--mqtt.host broker`), then keyword overrides (tests)."""
    path = settings_file(config_file)

    class FromSources(DeviceSettings):
        @classmethod
        def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                       init_settings: PydanticBaseSettingsSource,
                                       env_settings: PydanticBaseSettingsSource,
                                       dotenv_settings: PydanticBaseSettingsSource,
                                       file_secret_settings: PydanticBaseSettingsSource):
            sources: list[PydanticBaseSettingsSource] = [init_settings]
            if args:
                sources.append(CliSettingsSource(settings_cls, cli_parse_args=args,
                                                 cli_kebab_case=True, cli_exit_on_error=False,
                                                 cli_prog_name="sled device"))
            sources.append(env_settings)
            if path is not None:
                sources.append(file_source(settings_cls, path))
            return tuple(sources)

    origin = f"{path}, SLED_DEVICE_* variables or flags" if path else "SLED_DEVICE_* variables or flags"
    try:
        loaded = FromSources(**overrides)
    except ValidationError as exc:
        raise SettingsError(describe(exc, origin)) from None
    except (ValueError, OSError, pydantic_settings.SettingsError) as exc:
        # unreadable TOML/YAML, a malformed variable, an unknown flag
        raise SettingsError(f"cannot read device settings from {origin}: {exc}") from None
    return DeviceSettings.model_validate(loaded.model_dump())


def cli_help() -> str:
    """The flags every key has (for `sled device --help`)."""
    rows = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.")
                continue
            flag = f"--{prefix}{name}".replace("_", "-")
            env = ENV_PREFIX + (prefix.replace(".", "__") + name).upper()
            default = field.get_default(call_default_factory=True)
            if isinstance(default, SecretStr) or default in (None, ""):
                shown = ""
            else:
                shown = f" (default {default})"
            rows.append(f"  {flag:30s} {env}{shown}")

    walk(DeviceSettings, "")
    return "\n".join(rows)
