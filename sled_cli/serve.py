"""`sled serve`: load the target and serve it until interrupted."""
from __future__ import annotations

import asyncio
import contextlib
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
