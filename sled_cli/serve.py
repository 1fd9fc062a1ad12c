"""`sled serve`: load the target and serve it until interrupted.

Its flags are the keys of the server's settings (verify_server.settings.ServerSettings), made
from the fields in verify_server.flags: each key is also a line of --config FILE and a
SLED_SERVE_* variable.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys

from sled.extras import require_extra
from sled.flags import one_line
from sled.models import first_use_note
from sled.mqtt import Broker
from sled.progress import phase
from verify_server.announce import AnnounceConfig
from verify_server.auth import access_of
from verify_server.flags import add_arguments  # noqa: F401 (sled's main builds the parser from it)
from verify_server.settings import ServerSettings, SettingsError, load_settings
from verify_server.synthetic import is_synthetic, shape_of

def run(args: argparse.Namespace) -> int:
    require_extra("server", "the verify server")
    flags = {name: getattr(args, name) for name in ServerSettings.model_fields if hasattr(args, name)}
    try:
        settings = load_settings(args.config, flags)
        if not settings.model:
            raise SettingsError("model: required: give --model, SLED_SERVE_MODEL or model = ... "
                                "in --config FILE")
        announce = announce_config(settings)
        check_synthetic(settings.model)
        access_of(settings)     # TLS and token files: one line now, not after the target loads
    except ValueError as exc:
        print(f"sled serve: {one_line(exc)}", file=sys.stderr)
        return 2
    with phase("target", f"loading {settings.model}{first_use_note(settings.model)}"):
        # torch and transformers load here: part of the timed target phase, under its spinner
        from verify_server.accelerator import check_device
        from verify_server.ranks import split
        from verify_server.follower import follow_leader
        from verify_server.server import serve_forever
        from verify_server.target import load_target, locate_target
        ranks = None
        try:
            check_device(settings.device, settings.dtype)   # before any rank starts
            located = locate_target(settings.model)
            ranks = split(settings, sys.argv[1:])
            target = load_target(settings, located)
        # e.g. a device torch lacks, a model neither here nor on the hub, one that does not
        # split over --tp N ranks
        except ValueError as exc:
            if ranks is None or ranks.leads:   # every rank refuses alike: one line, rank 0's
                print(f"sled serve: {one_line(exc)}", file=sys.stderr)
            if ranks is not None:
                ranks.end()
            return 2
    if ranks is not None and not ranks.leads:
        follow_leader(target, ranks, max_rows=settings.max_batch_sessions,
                      max_step_tokens=settings.max_step_tokens,
                      block_tokens=settings.kv_block_tokens, engine=settings.engine,
                      flex_splits=settings.flex_splits)
        ranks.end()
        return 0
    steady_emulation(settings, target)
    try:
        # Ctrl-C cancels serve_forever, which stops the server (the port is free again) and
        # reaches sled_cli.main as KeyboardInterrupt: one line, exit 130
        asyncio.run(serve_forever(target, settings, announce=announce, ranks=ranks))
    except ValueError as exc:   # e.g. a KV budget too small for one block
        print(f"sled serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:      # e.g. the port is in use
        print(f"sled serve: {exc}", file=sys.stderr)
        return 1
    finally:
        if ranks is not None:
            ranks.end()
    return 0


def steady_emulation(settings: ServerSettings, target) -> None:
    """An emulated server (--emulate) computing on the CPU takes one torch thread, unless
    OMP_NUM_THREADS says otherwise: a step split across threads waits for the slowest, and on a
    machine whose cores the devices share that one is often descheduled, which overruns the
    profile's time (8 lab devices: 60 of 637 steps overran on 2 threads, 2 of 641 on one)."""
    import torch   # loaded with the target (run), not at start

    if settings.emulate and target.model.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
        print("sled serve: emulating on the CPU with one torch thread per step (steadier than "
              "several on cores the devices share; OMP_NUM_THREADS chooses otherwise)",
              file=sys.stderr, flush=True)


def check_synthetic(model: str) -> None:
    """A synthetic:NAME target names a known shape (ValueError before anything loads)."""
    if is_synthetic(model):
        shape_of(model)


def announce_config(settings: ServerSettings):
    """The MQTT announcement settings; None without mqtt_host."""
    if not settings.mqtt_host:
        return None
    s = settings
    tls = s.mqtt_tls or bool(s.mqtt_ca_file or s.mqtt_cert_file)
    broker = Broker(s.mqtt_host, s.mqtt_port or (8883 if tls else 1883), username=s.mqtt_username,
                    password=s.mqtt_password.get_secret_value(), tls=tls, ca_file=s.mqtt_ca_file,
                    cert_file=s.mqtt_cert_file, key_file=s.mqtt_key_file)
    dialed = socket.gethostname() if s.host in ("", "0.0.0.0", "::", "[::]") else s.host
    endpoint = s.announce_endpoint or f"{dialed}:{s.port}"
    return AnnounceConfig(broker, s.server_id or f"{socket.gethostname()}-{s.port}", endpoint,
                          topic_prefix=s.mqtt_topic_prefix, interval_s=s.announce_interval,
                          tls_name=s.announce_tls_name)
