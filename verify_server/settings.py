"""The verify server's settings: one validated model, read from a TOML or YAML file, SLED_SERVE_*
variables and `sled serve` flags (in rising priority). Defaults live here and nowhere else.

Every key has all three spellings:

    max_sessions = 64               SLED_SERVE_MAX_SESSIONS=64          --max-sessions 64
    kv_budget = "4GiB"              SLED_SERVE_KV_BUDGET=4GiB           --kv-budget 4GiB

A few keys have a second name kept from earlier releases: `max_draft_tokens` (the name of the
limit on the wire, ServerLimits.max_draft_tokens) was `max_draft_len`, and still reads as a key,
a variable and a flag (`--max-draft-len`). An unknown key or a bad value stops start-up with one line per key that names
where the value came from (`SettingsError`).
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic_settings
from pydantic import (Field, SecretStr, ValidationError, ValidationInfo, field_validator,
                      model_validator)
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict

from sled.wire.endpoint import parse_endpoint
from sled.settings_files import SettingsError, file_source, settings_file
from verify_server.gpu_memory import gpu_memory
from verify_server.origin import CERT_HEADER, cert_header_name, proxy_network
from verify_server.step_costs import load_profile

ENV_PREFIX = "SLED_SERVE_"
VARINT_BYTES, FLOAT_BYTES = 5, 4     # the most a uint32 id takes on the wire; a float prob
FIELD_OVERHEAD = 16                  # tags and lengths of one q position
MESSAGE_MARGIN = 64 << 10            # stop ids (validation.MAX_STOP_IDS), strings, sampling, framing
SESSIONS_PARTS = 4                   # by default a device may hold a quarter of the sessions
ANNOUNCE = "MQTT announcements"   # the flag group of the announcement keys
ACCESS = "access"                  # the flag group of TLS, device tokens and quotas
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10,
              "mib": 1 << 20, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648; plain numbers are bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in SIZE_UNITS:
        raise ValueError(f"cannot read size {text!r}: use e.g. 512MiB, 2GiB or a byte count")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


def _announce(default: Any = None, description: str = "", **kwargs: Any) -> Any:
    return Field(default, description=description, json_schema_extra={"group": ANNOUNCE}, **kwargs)


def _access(default: Any = None, description: str = "", extra: dict | None = None,
            **kwargs: Any) -> Any:
    return Field(default, description=description,
                 json_schema_extra={"group": ACCESS, **(extra or {})}, **kwargs)


class ServerSettings(BaseSettings):
    """Everything `sled serve` needs; in-process servers (tests) pass only the limits they change."""
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # --- the target ---
    model: str = Field("", description="target: a built-in alias, local path or HF id "
                                       "(safetensors), or synthetic:NAME (a Gemma 3 shape with "
                                       "random weights: gemma3-1b, gemma3-4b, gemma3-12b, ...); "
                                       "required by sled serve")
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = Field(
        "float32", description="float32, float64, bfloat16 or float16")
    device: str = Field("cpu", description="torch device, e.g. cuda:0")
    tp: int = Field(1, ge=1, le=64, description="split the target over this many GPUs of this "
                    "machine (tensor parallelism: ranks 0..N-1 on cuda:0..N-1, or N CPU processes "
                    "with --device cpu); under torchrun, give it --nproc-per-node N")
    trust_remote_code: bool = Field(False, description="run the model repo's own code")
    context_length: int | None = Field(None, ge=2, description="cap below the model's limit")
    sat: bool = Field(True, description="serve the target's semantic adaptive tokens, if it has "
                                        "any")
    sat_adapter: str | None = Field(
        None, description="SAT adapter (sat_adapter.safetensors) for self-drafting and lookahead "
                          "(default: the one shipped for a built-in target, or one beside the model)")
    sat_off_above: int = Field(0, ge=0, description="self-drafting sessions (server-sat mode) "
                               "decode plainly, without SAT slots, while more than this many "
                               "sessions are open; their drafting resumes when the load falls "
                               "(0 = never switched off)")
    placement: Literal["fixed", "latency", "gpu"] = Field(
        "fixed", description="where a movable session's next tokens come from as the load "
        "changes (verify_server.placement): fixed, the mode it opened with; latency, the server "
        "serves it while the GPU has room; gpu, its device drafts unless it falls under the SLO")
    placement_slo_rate: float = Field(5.0, gt=0, description="tokens/s a device should get: "
                                      "the placement policy's SLO")
    placement_low: float = Field(0.5, gt=0, lt=1, description="the GPU's load (sled_step_load) "
                                 "under which the server serves movable sessions itself")
    placement_high: float = Field(0.8, gt=0, lt=1, description="the GPU's load past which the "
                                  "server hands movable sessions back to their devices")
    # --- where it listens ---
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port")
    metrics_port: int | None = Field(None, ge=0, le=65535,
                                     description="serve Prometheus /metrics here")
    # --- access: TLS, device tokens, quotas ---
    tls_cert: str | None = _access(None, "serve TLS with this certificate (PEM; with --tls-key)")
    tls_key: str | None = _access(None, "the certificate's private key (PEM)")
    tls_client_ca: str | None = _access(
        None, "mutual TLS: refuse, at the handshake, clients without a certificate this CA signed")
    auth_tokens: str | None = _access(
        None, "device tokens, one 'DEVICE_ID TOKEN [cert=NAME] [sessions=N] [tokens_per_s=R]' "
              "a line (sled certs writes one); every call must carry one; re-read on SIGHUP")
    reflection: bool = _access(True, "serve gRPC reflection (the service's schema)")
    trusted_proxies: Annotated[tuple[str, ...], NoDecode] = _access(
        (), "a proxy in front of this server (HAProxy, Envoy: an address or CIDR network, IPv4 "
            "or IPv6; repeat it or give a comma list) whose x-forwarded-for and "
            "--proxy-cert-header name the devices it carries; from anyone else they are ignored "
            "(default: none)", extra={"flags": ["--trusted-proxy"], "metavar": "ADDR",
                                      "repeatable": True})
    proxy_cert_header: str = _access(
        "", "the header in which a --trusted-proxy that terminates mutual TLS names the client "
            f"certificate it verified, having removed any its client sent ({CERT_HEADER} in "
            "deploy/haproxy.cfg; x-forwarded-client-cert: Envoy's format) (default: none: names "
            "come only from certificates this server verifies)", extra={"metavar": "HEADER"})
    require_identity: bool = _access(
        False, "refuse (UNAUTHENTICATED) a call that neither a token nor a client certificate "
               "names, rather than telling its device by its host (a trusted proxy's forwarded "
               "one, else the peer's)")
    caller_prefix_v4: int = _access(
        32, "leading bits of an IPv4 address that tell one caller without a token or "
            "certificate from another: its quotas, its bounds on streams, calls, GetTokenizer "
            "replies and KV (its prefix cache stays its own address's) (32: each address; 24: a "
            "/24 is one caller)", ge=1, le=32)
    caller_prefix_v6: int = _access(
        64, "the same for an IPv6 address: one host may hold a whole /64, so a LAN's devices "
            "without tokens share one (128: each address)", ge=1, le=128)
    loopback_one_caller: bool = _access(
        True, "every loopback address (127.0.0.0/8 and ::1, any of which a local user may dial "
              "from) is one caller without a token or certificate; off: the prefixes tell them "
              "apart")
    quota_sessions: int | None = _access(
        None, "open sessions per device before RESOURCE_EXHAUSTED (default: a quarter of "
              "max_sessions, at least 1, for a device its token or certificate names; a host "
              "without either is held only when this is set; 0 = only max_sessions)", ge=0)
    quota_tokens_per_s: float = _access(0.0, "tokens per second through the target per device: "
                                             "prompt + draft tokens (0 = no quota)", ge=0)
    quota_burst_s: float = _access(2.0, "seconds of quota_tokens_per_s a device may spend at "
                                        "once", gt=0)
    quota_wait_s: float = _access(2.0, "longest a device's work is held to keep it within its "
                                       "rate; past that it is refused", ge=0)
    # --- limits ---
    max_sessions: int = Field(256, ge=1, description="open sessions before RESOURCE_EXHAUSTED")
    max_draft_tokens: int = Field(
        32, ge=1, description="most tokens in one draft (a chain's length, a tree's nodes) "
        "verified in one round", json_schema_extra={"flags": ["--max-draft-len"],
                                                    "was": "max_draft_len"})
    max_q_support: int = Field(64, ge=1, description="(id, prob) pairs per draft position in "
                                                     "sampling mode")
    max_batch_sessions: int = Field(64, ge=1, description="sessions in one forward pass")
    max_step_tokens: int = Field(2048, ge=1, description="tokens per batched forward; longer "
                                                         "prompts are prefilled in chunks")
    max_message_bytes: int | None = Field(
        None, ge=1, description="larger gRPC messages get RESOURCE_EXHAUSTED (default: what the "
                                "longest valid message needs, from the context length and draft "
                                "limits)", json_schema_extra={"metavar": "SIZE"})
    max_tokenizer_calls: int = Field(8, ge=1, description="GetTokenizer replies being sent at "
                                                        "once before RESOURCE_EXHAUSTED")
    max_tokenizer_calls_per_device: int = Field(2, ge=1, description="GetTokenizer replies one "
                                                "device (token or certificate) may hold at once, "
                                                "until each call is over")
    max_tokenizer_calls_per_host: int = Field(4, ge=1, description="GetTokenizer replies one "
                                              "host without a token or certificate (its address "
                                              "block: a NAT's devices together) may hold at once")
    tokenizer_stall_timeout: float = Field(20.0, gt=0, description="seconds a GetTokenizer reply "
                                           "may wait on a client that reads nothing before it "
                                           "ends (DEADLINE_EXCEEDED) and frees its slot")
    tokenizer_min_rate: int = Field(
        64 << 10, ge=1, description="bytes per second a GetTokenizer reply must be read at, on "
        "average from its start after tokenizer_rate_grace seconds; a slower reader's reply "
        "ends (DEADLINE_EXCEEDED) and frees its slot", json_schema_extra={"metavar": "SIZE"})
    tokenizer_rate_grace: float = Field(10.0, ge=0, description="seconds of a GetTokenizer reply "
                                        "not held to tokenizer_min_rate (a connection's start)")
    idle_timeout: float = Field(300.0, ge=0, description="seconds a session may idle before its "
                                                         "KV is freed (0 = never)")
    open_timeout: float = Field(10.0, gt=0, description="seconds a call may go without its first "
                                "message (a Generate stream: its Open; a reflection stream: each "
                                "next one) before it is ended (DEADLINE_EXCEEDED)")
    max_streams_per_device: int = Field(256, ge=1, description="Generate streams one device may "
                                        "hold at once, opened or not (a device: its token, its "
                                        "certificate name, else its host)")
    max_calls_per_device: int = Field(256, ge=1, description="calls other than Generate one "
                                      "device may hold at once (GetModelInfo, GetTokenizer, "
                                      "health, reflection) before RESOURCE_EXHAUSTED")
    max_watch_streams: int = Field(1024, ge=1, description="Health.Watch streams open at once, "
                                   "all callers together, before RESOURCE_EXHAUSTED")
    max_streams_per_connection: int = Field(
        1024, ge=1, description="calls one connection may have open at once (HTTP/2's "
        "max_concurrent_streams, gRPC's too; a daemon's many sessions share one): a client's "
        "next call waits until one ends, so what a client that never reads holds is bounded per "
        "connection")
    # --- the KV cache ---
    kv_budget: int | None = Field(None, ge=1, description="KV cache size, e.g. 2GiB or 512MiB "
                                  "(default: --kv-fraction of free memory)",
                                  json_schema_extra={"metavar": "SIZE"})
    kv_fraction: float = Field(0.25, gt=0.0, le=0.95, description="KV cache as a fraction of "
                                                                  "free device memory")
    kv_block_tokens: int = Field(16, ge=1, description="tokens per KV block")
    kv_windows: bool = Field(True, description="a model's sliding-window layers (Gemma 3) keep "
                             "only their window of KV, in blocks of their own; off: every layer "
                             "keeps every token (the padded engine, a split server and --emulate "
                             "always do)")
    kv_share: float | None = Field(None, gt=0.0, le=1.0, description="fraction of the KV cache one "
                                   "device's sessions may reserve (default: an equal part per "
                                   "device of --auth-tokens, all of it without tokens)")
    admission_queue: int = Field(64, ge=0, description="sessions that may wait at once, inside "
                                 "their Open, for KV when the whole KV cache is full, admitted "
                                 "in arrival order as other sessions free theirs; past it a "
                                 "session is refused (RESOURCE_EXHAUSTED); waiting sessions "
                                 "count against --max-sessions (0 = refuse at once)")
    admission_wait: float = Field(30.0, gt=0, description="longest seconds a session waits for "
                                  "KV in the admission queue before it is refused "
                                  "(RESOURCE_EXHAUSTED); the wait is part of its device's time "
                                  "to first token")
    engine: Literal["auto", "paged", "flex", "padded"] = Field(
        "auto", description="paged: SDPA over each row's gathered KV; flex: FlexAttention over "
                            "the KV pool in place, in static step shapes (for CUDA); padded: the "
                            "generic fallback (auto: flex on CUDA, paged on CPU, padded for a "
                            "model without transformers' attention interface)")
    flex_splits: Literal["torch", "auto"] = Field(
        "torch", description="how the flex engine's decode kernel splits each row's KV blocks "
                             "on CUDA: torch's own count, with full context blocks where rows "
                             "fill the GPU; or auto, enough splits for 4 programs on every "
                             "multiprocessor, cut from each row's own blocks (the same output "
                             "either way)")
    overlap_steps: Literal["auto", "on", "off"] = Field(
        "auto", description="launch each step before the last one is decided, so the host's "
                            "planning and deciding run while the device computes (auto: where "
                            "the engine's forward returns before its kernels end, flex on CUDA; "
                            "a step with sampling or loose rows is always decided first)")
    emulate: str | None = Field(
        None, description="hold every step to a step-cost profile's time, so this server paces "
                          "itself like the GPU the profile was measured on (the target still "
                          "computes every token): a shipped profile (h100-llama8b-hf-graph) or "
                          "a profile file (sled bench engine --write-profile); a profile that "
                          "knows its GPU's memory also sizes the KV cache as that GPU would "
                          "(leave out --kv-budget)",
        json_schema_extra={"metavar": "PROFILE"})
    # --- MQTT announcements (off without mqtt_host) ---
    mqtt_host: str = _announce("", "broker host")
    mqtt_port: int | None = _announce(None, "broker port (default 1883, 8883 with TLS)",
                                      ge=1, le=65535)
    mqtt_username: str = _announce("", "broker user name")
    mqtt_password: SecretStr = Field(
        default_factory=lambda: SecretStr(os.environ.get("SLED_MQTT_PASSWORD", "")),
        description="broker password (default: $SLED_MQTT_PASSWORD)",
        json_schema_extra={"group": ANNOUNCE})
    mqtt_tls: bool = _announce(False, "connect with TLS (system CAs unless --mqtt-ca-file)")
    mqtt_ca_file: str | None = _announce(None, "CA bundle for the broker's certificate "
                                               "(implies TLS)")
    mqtt_cert_file: str | None = _announce(None, "client certificate (implies TLS)")
    mqtt_key_file: str | None = _announce(None, "the client certificate's key")
    mqtt_topic_prefix: str = _announce("sled", "topic prefix")
    server_id: str | None = _announce(None, "id in the announcement topic (default: HOSTNAME-PORT)")
    announce_endpoint: str | None = _announce(
        None, "HOST:PORT devices should dial (default: host:port, this machine's name for 0.0.0.0)")
    announce_interval: float = _announce(5.0, "seconds between announcements", gt=0)
    announce_tls_name: str = _announce("", "the name on --tls-cert devices should check, when "
                                           "it is not the announced endpoint's host")

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _proxy_networks(cls, value: Any) -> tuple[str, ...]:
        """Addresses and networks, as a list or comma lists (a repeated flag, a variable)."""
        items = [value] if isinstance(value, str) else list(value or ())
        entries = [part for item in items for part in str(item).split(",") if part.strip()]
        return tuple(str(proxy_network(entry)) for entry in entries)

    @field_validator("proxy_cert_header")
    @classmethod
    def _cert_header(cls, value: str) -> str:
        return cert_header_name(value)

    @field_validator("kv_budget", "max_message_bytes", "tokenizer_min_rate", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return parse_size(value) if isinstance(value, str) else value

    def device_sessions(self) -> int:
        """Open sessions one device (named by its token or certificate) may hold: quota_sessions,
        by default a quarter of max_sessions (at least 1); 0: only max_sessions."""
        if self.quota_sessions is None:
            return max(self.max_sessions // SESSIONS_PARTS, 1)
        return self.quota_sessions

    def receive_limit(self, context_length: int) -> int:
        """The largest message the server reads: max_message_bytes, else what a valid one can
        need: a prompt filling the context plus a full draft with its q (varint ids of up to 5
        bytes, 4-byte probs), plus room for the small fields."""
        if self.max_message_bytes is not None:
            return self.max_message_bytes
        prompt = context_length * VARINT_BYTES
        q_position = self.max_q_support * (VARINT_BYTES + FLOAT_BYTES) + FIELD_OVERHEAD
        draft = self.max_draft_tokens * (VARINT_BYTES + q_position)
        return prompt + draft + MESSAGE_MARGIN

    @field_validator("max_step_tokens")
    @classmethod
    def _holds_a_draft(cls, value: int, info: ValidationInfo) -> int:
        max_draft_tokens = info.data.get("max_draft_tokens")
        if max_draft_tokens is not None and value < max_draft_tokens + 1:
            raise ValueError(f"max_step_tokens ({value}) must hold a full draft + 1 "
                             f"({max_draft_tokens + 1})")
        return value

    @field_validator("emulate")
    @classmethod
    def _profile(cls, value: str | None) -> str | None:
        if value:
            load_profile(value)         # refused here, before the target loads
        return value or None

    @field_validator("announce_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            parse_endpoint(value, "announce endpoint")
        return value

    @model_validator(mode="after")
    def _one_kv_budget(self) -> "ServerSettings":
        """A profile that knows its GPU's memory sizes the KV cache itself (gpu_memory)."""
        if self.emulate:
            gpu = gpu_memory(load_profile(self.emulate))
            tokens = gpu.kv_tokens()      # ValueError when the weights leave no room
            if tokens is not None and self.kv_budget is not None:
                raise ValueError(f"kv_budget and emulate both size the KV cache: the profile's "
                                 f"GPU holds {tokens} tokens of KV; leave out --kv-budget")
        return self

    @model_validator(mode="after")
    def _placement_band(self) -> "ServerSettings":
        if self.placement_low >= self.placement_high:
            raise ValueError(f"placement_low ({self.placement_low:g}) must be under "
                             f"placement_high ({self.placement_high:g}): the server serves "
                             "sessions under the one and hands them back past the other")
        return self

    @model_validator(mode="after")
    def _tls_pairs(self) -> "ServerSettings":
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both (--tls-cert FILE "
                             "--tls-key FILE) or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs TLS: give --tls-cert and --tls-key")
        return self

    @model_validator(mode="after")
    def _identity_possible(self) -> "ServerSettings":
        """require_identity with nothing that names a device would refuse every call."""
        names = self.auth_tokens or self.tls_client_ca or (self.trusted_proxies
                                                           and self.proxy_cert_header)
        if self.require_identity and not names:
            raise ValueError("require_identity refuses every call when nothing names a device: "
                             "add --auth-tokens, --tls-client-ca, or --trusted-proxy with "
                             f"--proxy-cert-header (e.g. {CERT_HEADER}) for a proxy that verifies "
                             "client certificates")
        return self

    @model_validator(mode="after")
    def _header_of_a_proxy(self) -> "ServerSettings":
        """A certificate header is read only from a trusted proxy: without one it names no one."""
        if self.proxy_cert_header and not self.trusted_proxies:
            raise ValueError(f"proxy_cert_header ({self.proxy_cert_header}) is believed only from "
                             "a --trusted-proxy: add the proxy's address, or leave the header out")
        return self

    @field_validator("tls_cert", "tls_key", "tls_client_ca", "auth_tokens",
                     "mqtt_ca_file", "mqtt_cert_file", "mqtt_key_file", "sat_adapter",
                     "server_id", "announce_endpoint", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value


# --- reading the settings ---------------------------------------------------------------------------

# A key's name from an earlier release -> its name now (a file's key, a variable, a flag's dest).
OLD_KEYS = {(field.json_schema_extra or {})["was"]: name
            for name, field in ServerSettings.model_fields.items()
            if "was" in (field.json_schema_extra or {})}


def flag_spellings(name: str) -> list[str]:
    """The flags of key `name`: --kebab-name first, then any kept from earlier releases."""
    extra = ServerSettings.model_fields[name].json_schema_extra or {}
    return ["--" + name.replace("_", "-"), *extra.get("flags", [])]


def load_settings(config_file: str | Path | None = None,
                  flags: Mapping[str, Any] | None = None) -> ServerSettings:
    """Read the file (TOML or YAML by extension), then SLED_SERVE_* variables, then `flags`
    (key -> value as given on the command line); later sources win key by key."""
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for origin, layer in _sources(config_file, flags or {}):
        both = [old for old, key in OLD_KEYS.items() if old in layer and key in layer]
        if both:
            raise SettingsError(f"{origin(both[0])} and {origin(OLD_KEYS[both[0]])} name the same "
                                f"setting ({OLD_KEYS[both[0]]}; {both[0]} is its old name): give one")
        for key, value in layer.items():
            values[OLD_KEYS.get(key, key)] = value
            origins[OLD_KEYS.get(key, key)] = origin(key)
    try:
        return ServerSettings(**values)
    except ValidationError as exc:
        raise SettingsError(describe(exc, values, origins)) from None


def _sources(config_file, flags) -> list[tuple[Callable[[str], str], Mapping[str, Any]]]:
    """(how to name a key's origin, its values), lowest priority first."""
    sources: list[tuple[Callable[[str], str], Mapping[str, Any]]] = []
    path = settings_file(config_file)
    if path is not None:
        sources.append((lambda key: str(path), _read_file(path)))
    sources.append((lambda key: ENV_PREFIX + key.upper(), _read_env()))
    sources.append((lambda key: " / ".join(flag_spellings(key)) if key in ServerSettings.model_fields
                    else key, flags))
    return sources


def _read_file(path: Path) -> dict[str, Any]:
    try:
        return file_source(ServerSettings, path)()
    except (ValueError, OSError, pydantic_settings.SettingsError) as exc:
        raise SettingsError(f"cannot read server settings from {path}: {exc}") from None


def _read_env() -> dict[str, Any]:
    """SLED_SERVE_* variables by key; one that names no key is kept, so it is refused."""
    found = dict(EnvSettingsSource(ServerSettings)())
    for name in os.environ:
        key = name[len(ENV_PREFIX):].lower()
        if name.upper().startswith(ENV_PREFIX) and key not in ServerSettings.model_fields:
            found[key] = os.environ[name]
    return found


def describe(exc: ValidationError, values: Mapping[str, Any], origins: Mapping[str, str]) -> str:
    """One line per bad key: `kv_budget = '12 parsecs' (--kv-budget): cannot read size ...`."""
    lines = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"]) or "(settings)"
        where = origins.get(key, "default")
        if error["type"] == "extra_forbidden":
            lines.append(f"  {key} ({where}): unknown key (not a setting of sled serve)")
            continue
        message = error["msg"].removeprefix("Value error, ")
        shown = f" = {values[key]!r}" if key in values and "password" not in key else ""
        lines.append(f"  {key}{shown} ({where}): {message}")
    return "bad server settings:\n" + "\n".join(lines)
