"""`sled serve`: load the target and serve it until interrupted."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import sys

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20,
         "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648; plain numbers are bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"cannot read size {text!r}: use e.g. 512MiB, 2GiB or a byte count")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def run_serve(args) -> int:
    from verify_server.config import ServerConfig
    from verify_server.server import serve_forever
    from sled.models import resolve_model
    from verify_server.target import Target

    try:
        config = ServerConfig(max_draft_tokens=args.max_draft_tokens, max_sessions=args.max_sessions,
                              max_batch_sessions=args.max_batch_sessions,
                              context_length=args.context_length,
                              kv_budget_bytes=parse_size(args.kv_budget) if args.kv_budget else None,
                              kv_fraction=args.kv_fraction, kv_block_tokens=args.kv_block_tokens,
                              max_step_tokens=args.max_step_tokens, idle_timeout_s=args.idle_timeout,
                              engine=args.engine)
        announce = announce_config(args)
    except ValueError as exc:
        print(f"sled serve: {exc}", file=sys.stderr)
        return 2
    from sled.models import builtin_sat_adapter

    adapter = args.sat_adapter
    if adapter is None and not args.no_sat:
        adapter = builtin_sat_adapter(args.model)
    target = Target.load(resolve_model(args.model), dtype=args.dtype, device=args.device,
                         trust_remote_code=args.trust_remote_code, context_length=args.context_length,
                         name=args.model, sat_adapter=None if args.no_sat else adapter)
    if args.no_sat:
        target.sat = None
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_forever(target, config, args.host, args.port, args.metrics_port,
                                      announce=announce))
    except ValueError as exc:   # e.g. a KV budget too small for one block
        print(f"sled serve: {exc}", file=sys.stderr)
        return 2
    return 0


def announce_config(args):
    """The MQTT announcement settings from the flags; None without --mqtt-host."""
    if not args.mqtt_host:
        return None
    from sled.mqtt import Broker
    from verify_server.announce import AnnounceConfig

    tls = args.mqtt_tls or bool(args.mqtt_ca_file or args.mqtt_cert_file)
    broker = Broker(args.mqtt_host, args.mqtt_port or (8883 if tls else 1883),
                    username=args.mqtt_username, password=args.mqtt_password, tls=tls,
                    ca_file=args.mqtt_ca_file, cert_file=args.mqtt_cert_file, key_file=args.mqtt_key_file)
    dialed = socket.gethostname() if args.host in ("", "0.0.0.0", "::", "[::]") else args.host
    endpoint = args.announce_endpoint or f"{dialed}:{args.port}"
    return AnnounceConfig(broker, args.server_id or f"{socket.gethostname()}-{args.port}", endpoint,
                          topic_prefix=args.mqtt_topic_prefix, interval_s=args.announce_interval)


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="target: local path or HF id (safetensors)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
    parser.add_argument("--dtype", default="float32", help="float32, float64, bfloat16, float16")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda:0")
    parser.add_argument("--trust-remote-code", action="store_true", help="run the model repo's own code")
    parser.add_argument("--max-sessions", type=int, default=256)
    parser.add_argument("--max-draft-tokens", type=int, default=32)
    parser.add_argument("--max-batch-sessions", type=int, default=64)
    parser.add_argument("--context-length", type=int, default=None, help="cap below the model's limit")
    parser.add_argument("--kv-budget", default=None,
                        help="KV cache size, e.g. 2GiB or 512MiB (default: --kv-fraction of free memory)")
    parser.add_argument("--kv-fraction", type=float, default=0.25,
                        help="KV cache as a fraction of free device memory (default 0.25)")
    parser.add_argument("--kv-block-tokens", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-step-tokens", type=int, default=2048,
                        help="tokens per batched forward; longer prompts are prefilled in chunks")
    parser.add_argument("--idle-timeout", type=float, default=300.0,
                        help="seconds a session may idle before its KV is freed (0 = never)")
    parser.add_argument("--sat-adapter", default=None,
                        help="SAT adapter (sat_adapter.safetensors) for self-drafting and lookahead "
                        "(default: the one shipped for a built-in target, or one beside the model)")
    parser.add_argument("--no-sat", action="store_true", help="serve without semantic adaptive tokens")
    parser.add_argument("--engine", default="auto", choices=["auto", "paged", "padded"],
                        help="paged KV fast path, or the generic padded fallback (auto: paged if the "
                        "model supports transformers' attention interface)")
    m = parser.add_argument_group("MQTT announcements", "announce this server to devices over MQTT "
                             "(retained on PREFIX/servers/SERVER_ID; off without --mqtt-host)")
    m.add_argument("--mqtt-host", default="", help="broker host")
    m.add_argument("--mqtt-port", type=int, default=None, help="broker port (default 1883, 8883 with TLS)")
    m.add_argument("--mqtt-username", default="")
    m.add_argument("--mqtt-password", default=os.environ.get("SLED_MQTT_PASSWORD", ""),
                        help="(default: $SLED_MQTT_PASSWORD)")
    m.add_argument("--mqtt-tls", action="store_true", help="connect with TLS (system CAs unless "
                        "--mqtt-ca-file)")
    m.add_argument("--mqtt-ca-file", default=None, help="CA bundle for the broker's certificate (implies TLS)")
    m.add_argument("--mqtt-cert-file", default=None, help="client certificate (implies TLS)")
    m.add_argument("--mqtt-key-file", default=None, help="the client certificate's key")
    m.add_argument("--mqtt-topic-prefix", default="sled")
    m.add_argument("--server-id", default=None, help="id in the announcement topic (default: HOSTNAME-PORT)")
    m.add_argument("--announce-endpoint", default=None,
                        help="HOST:PORT devices should dial (default: --host:--port, this machine's "
                        "name for 0.0.0.0)")
    m.add_argument("--announce-interval", type=float, default=5.0, help="seconds between announcements")


def run(args) -> int:
    return run_serve(args)
