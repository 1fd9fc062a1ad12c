"""The fleet a scenario runs on: one server (or replicas behind a proxy), one broker and a
device per slot.

Two backends implement `Fleet`: LocalFleet (lab/fleet_local.py, processes on this machine) and
ComposeFleet (lab/fleet_compose.py, Docker Compose). The runner, the driver, the fault timeline
and the scraper only use what is declared here.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from lab.scenario import DeviceSlot
from sled.mqtt import Broker


@dataclass(frozen=True)
class DeviceHandle:
    """One running device: its slot, its OpenAI-compatible API and its Prometheus /metrics."""
    slot: DeviceSlot
    api_url: str        # e.g. http://127.0.0.1:8411 (the OpenAI base is api_url + "/v1")
    metrics_url: str    # e.g. http://127.0.0.1:8411/metrics

    @property
    def id(self) -> str:
        return self.slot.id


@runtime_checkable
class Fleet(Protocol):
    """A started fleet: the lab reaches devices, server and broker only through this."""
    mode: str                     # "local" or "compose"
    devices: list[DeviceHandle]   # in slot order, filled by start()
    server_metrics_url: str
    server_metrics_urls: list[str]  # one per replica (behind a proxy), else [server_metrics_url]
    broker: Broker                # how the lab logs in (user "lab")
    config_broker: Broker         # how it changes devices' settings (user "lab-config")
    traces_dir: Path              # where the runner writes calibrated traces the devices read

    async def start(self, slots: list[DeviceSlot]) -> None:
        """Bring up broker, server and one device per slot; return when every device is ready."""

    async def stop(self) -> None:
        """Tear everything down; safe to call twice and after a failed start."""

    async def kill_server(self, replica: int = 0) -> None:
        """SIGKILL the verify server, or replica REPLICA behind the proxy (a crash, not a
        shutdown)."""

    async def start_server(self, replica: int = 0) -> None:
        """Start the server (or replica REPLICA) again on the same address and wait until it
        serves."""

    async def stop_broker(self) -> None:
        """Stop the MQTT broker."""

    async def start_broker(self) -> None:
        """Start the broker again on the same address and wait until it accepts logins."""

    def link_emulation(self) -> dict[str, str]:
        """Device id -> "netem" | "user-space": how each device's link profile is applied."""

    def device_machines(self) -> dict[str, str]:
        """Device id -> platform.machine() where its daemon runs (x86_64, aarch64)."""


class FleetStartError(RuntimeError):
    """A component of the fleet did not start (the runner exits 3 with this message)."""
