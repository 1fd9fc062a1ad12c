"""The fault timeline of a phase: each step at its at_s from the phase start.

    server_kill     SIGKILL the verify server (behind a proxy: the replica it names), wait down_s,
                    start it again (and wait until it serves)
    broker_restart  stop the broker, wait down_s, start it again
    link_cut        the device's link goes down (MQTT config {"emulation": {"link_down": true}}),
                    down_s later it comes back

Each step gives {"kind", "at_s", "device", "down_s", "done_at_s", "ok", "note"}: ok says the
step happened as asked (the component came back, the device reported its link cut and restored).
"""
from __future__ import annotations

import asyncio
import time
import weakref

from lab.broker import CONFIG_USER
from lab.fleet import DeviceHandle, Fleet
from lab.health import Health, wait_health
from lab.scenario import Fault
from sled.wire.topics import device_topic, encode


async def run_faults(fleet: Fleet, faults: list[Fault], started: float, prefix: str = "sled") -> list[dict]:
    """Every step on its own task, each at `started + at_s` (time.monotonic)."""
    steps = [_timed(fleet, fault, started, prefix) for fault in faults]
    return list(await asyncio.gather(*steps))


async def _timed(fleet: Fleet, fault: Fault, started: float, prefix: str) -> dict:
    await asyncio.sleep(max(0.0, started + fault.at_s - time.monotonic()))
    record = {"kind": fault.kind, "at_s": round(time.monotonic() - started, 3), "device": fault.device,
              "replica": fault.replica, "down_s": fault.down_s, "done_at_s": None, "ok": False, "note": ""}
    try:
        record["note"] = await STEPS[fault.kind](fleet, fault, prefix)
        record["ok"] = True
    except Exception as exc:    # a step that failed is a result to report, not a crash
        record["note"] = f"{type(exc).__name__}: {exc}"
    record["done_at_s"] = round(time.monotonic() - started, 3)
    return record


async def server_kill(fleet: Fleet, fault: Fault, prefix: str) -> str:
    replica = fault.replica or 0
    await fleet.kill_server(replica)
    await asyncio.sleep(fault.down_s)
    begun = time.monotonic()
    await fleet.start_server(replica)
    which = "server" if fault.replica is None else f"replica {fault.replica}"
    return f"{which} killed (SIGKILL), serving again {time.monotonic() - begun:.1f} s after restart"


async def broker_restart(fleet: Fleet, fault: Fault, prefix: str) -> str:
    await fleet.stop_broker()
    await asyncio.sleep(fault.down_s)
    await fleet.start_broker()
    begun = time.monotonic()
    await asyncio.gather(*(wait_health(h.api_url, mqtt_connected,
                                       f"{h.id} did not reconnect to the broker", 120)
                           for h in fleet.devices))
    return f"broker stopped and started again; every device back on it {time.monotonic() - begun:.1f} s later"


async def link_cut(fleet: Fleet, fault: Fault, prefix: str) -> str:
    handle = next(h for h in fleet.devices if h.id == fault.device)
    await set_link_down(fleet, handle, True, prefix)
    await asyncio.sleep(fault.down_s)
    await set_link_down(fleet, handle, False, prefix)
    return f"{handle.id}'s link cut for {fault.down_s:g} s"


STEPS = {"server_kill": server_kill, "broker_restart": broker_restart, "link_cut": link_cut}


async def set_link_down(fleet: Fleet, handle: DeviceHandle, down: bool, prefix: str,
                        timeout_s: float = 10.0) -> None:
    """Publish the live setting, then wait until the device's /health reports it."""
    await publish_config(fleet, handle.id, {"emulation": {"link_down": down}}, prefix)
    await wait_health(handle.api_url,
                      lambda h: (h.status.get("emulation") or {}).get("link_down") == down,
                      f"{handle.id} did not report link_down={down}", timeout_s)


async def publish_config(fleet: Fleet, device_id: str, changes: dict, prefix: str = "sled") -> None:
    """One settings change to a device over MQTT."""
    await publish_configs(fleet, {device_id: changes}, prefix)


async def publish_configs(fleet: Fleet, changes: dict[str, dict], prefix: str = "sled") -> None:
    """Settings changes to devices (device id -> changes) over one MQTT connection as the user
    "lab-config". The broker gives a user one connection at a time, so this loop's publishers
    take turns."""
    async with _config_turn():
        async with fleet.config_broker.client(CONFIG_USER) as client:
            for device_id, change in changes.items():
                await client.publish(device_topic(prefix, device_id, "config"), encode(change),
                                     qos=1)


# One lock per event loop (the lab runs one; tests make one each).
_config_turns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _config_turn() -> asyncio.Lock:
    loop = asyncio.get_running_loop()
    if loop not in _config_turns:
        _config_turns[loop] = asyncio.Lock()
    return _config_turns[loop]


def mqtt_connected(health: Health) -> bool:
    return (health.status.get("mqtt") or {}).get("connected") is True
