"""`sled device --config FILE [--key value ...]`: the daemon a Pi or Jetson runs.

It loads the drafter, finds a verify server, serves the local OpenAI-compatible API and, when a
broker is configured, joins the MQTT control plane. Settings come from the file, SLED_DEVICE_*
variables and flags (edge_client.settings); a bad one stops start-up with its name (exit 2).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys

from edge_client.daemon import Device
from edge_client.mqtt import DeviceMqtt
from edge_client.openai_api import check_exposure, start_api
from edge_client.settings import SettingsError, cli_help, load_settings
from sled.flags import one_line
from sled_cli.logs import configure_logging
from sled_cli.main import interrupted

USAGE = """usage: sled device [--config FILE.toml|FILE.yaml] [--KEY VALUE ...]

Runs the device daemon. Every setting is a key in the config file, a SLED_DEVICE_* variable
and a flag (flags win over variables, variables over the file):
"""

log = logging.getLogger("sled.device")


def run_device_daemon(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(USAGE + cli_help())
        return 0
    config, rest = _config_flag(argv)
    configure_logging(logging.INFO)
    try:
        settings = load_settings(config, rest)
    except SettingsError as exc:
        print(f"sled device: {one_line(exc)}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve_device(settings))
    except SettingsError as exc:
        print(f"sled device: {one_line(exc)}", file=sys.stderr)
        return 2


def _config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """Split --config FILE (or --config=FILE) from the settings flags."""
    rest, config, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" and i + 1 < len(argv):
            config, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return config, rest


async def serve_device(settings, ready: asyncio.Event | None = None) -> int:
    """Run until SIGINT/SIGTERM: the device, its local API and (optionally) MQTT. Exit status 0
    after SIGTERM, 130 after Ctrl-C (SIGINT), with one line. An API open to the network with
    no api_key (and no api_open) is refused before the drafter loads (SettingsError)."""
    await asyncio.to_thread(check_exposure, settings.host, settings)
    try:
        device = Device(settings)
        await device.start()
    except (ValueError, OSError) as exc:
        print(f"sled device: cannot start: {exc}", file=sys.stderr)
        return 2
    runner, port = await start_api(device, settings.host, settings.port)
    tasks = []
    if settings.mqtt.enabled:
        tasks.append(asyncio.create_task(DeviceMqtt(device).run()))
    print(f"sled device {settings.id}: OpenAI-compatible API on http://{settings.host}:{port}/v1 "
          f"({device.state}: {device.reason})", flush=True)
    stop, signals = asyncio.Event(), []
    loop = asyncio.get_running_loop()

    def stop_on(sig: int) -> None:
        signals.append(sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_on, sig)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runner.cleanup()
        await device.close()
    if signals[:1] == [signal.SIGINT]:
        return interrupted("sled device")
    return 0


def run(argv: list[str]) -> int:
    """`sled device ...`: main hands over the words after `device`, flags named after settings."""
    return run_device_daemon(argv)
