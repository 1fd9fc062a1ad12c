"""Power and price assumptions for the lab's cost figures: what a device draws idle and while
drafting, what the server draws and costs per hour, what a kWh costs.

Every number below is an assumption (the kind of public figure it rests on is named beside
it), not a measurement in this lab; only the server's draw is measured, read with nvidia-smi
from the one GPU the server uses (index 0 unless told) when it runs on a GPU.

Cost rule (lab/report/energy.py): cost = server price per hour x hours; a rented server's
hourly price already includes its power, so no electricity is added for it. Electricity is
charged only for the owned device boards' drafting energy. A scenario overrides any of them with its `costs:` mapping:

    costs:
      electricity_per_kwh: 0.30
      server_price_per_hour: 2.50
      devices: {pi5: {busy_watts: 9.0}}

An unknown key raises ValueError naming it.
"""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

LIFETIME_HOURS = 3 * 365 * 24   # assumption: a board is written off over three years of use


@dataclass(frozen=True)
class DevicePower:
    idle_watts: float
    busy_watts: float           # while drafting
    price_per_hour: float = 0.0  # board list price amortised over LIFETIME_HOURS
    source: str = ""


def _devices() -> Mapping[str, DevicePower]:
    return MappingProxyType({
        # Raspberry Pi 4 B (4 GB): about 2.7 W idle and 6.4 W with all cores loaded, as reviews
        # measuring the board's draw at the wall socket under a CPU stress test report; list
        # price 55 USD. Assumptions.
        "pi4": DevicePower(2.7, 6.4, 55.0 / LIFETIME_HOURS,
                           "assumption: wall-socket draw idle / all-core stress test in Pi 4 B reviews; "
                           "55 USD list price"),
        # Raspberry Pi 5 (8 GB): about 2.7 W idle and 8.8 W with all cores loaded (wall-socket
        # draw under a CPU stress test, as board reviews report); list price 80 USD. Assumptions.
        "pi5": DevicePower(2.7, 8.8, 80.0 / LIFETIME_HOURS,
                           "assumption: wall-socket draw idle / all-core stress test in Pi 5 reviews; "
                           "80 USD list price"),
        # Jetson Orin Nano 8 GB: the 15 W power mode's budget (a configured cap, not a
        # measurement) as the busy figure, about 5 W idle; 249 USD is the list price of the
        # "Super" developer kit. Assumptions.
        "orin-nano": DevicePower(5.0, 15.0, 249.0 / LIFETIME_HOURS,
                                 "assumption: the 15 W power-mode cap of the Orin Nano; 249 USD list price "
                                 "of the Orin Nano Super developer kit"),
        # no board (drafting on the host): nothing drawn beyond the server's own figure
        "instant": DevicePower(0.0, 0.0, 0.0, "no board: drafting on the host"),
    })


@dataclass(frozen=True)
class CostAssumptions:
    devices: Mapping[str, DevicePower] = field(default_factory=_devices)
    # assumption: an H100 SXM's 700 W maximum thermal design power from the datasheet (a ceiling,
    # not a measured draw)
    gpu_server_watts: float = 700.0
    # assumption: a small CPU-only server under load (no GPU)
    cpu_server_watts: float = 200.0
    # assumption: the order of public on-demand list prices for one H100 GPU hour at GPU clouds
    gpu_server_price_per_hour: float = 3.00
    # assumption: a small CPU cloud instance's on-demand list price per hour
    cpu_server_price_per_hour: float = 0.20
    # assumption: a typical retail electricity price, USD per kWh (near a US residential average)
    electricity_per_kwh: float = 0.15

    def device(self, spec: str) -> DevicePower:
        """The figures of a device profile spec ("pi5" or "pi5:draft_ms_per_token=15")."""
        name = spec.partition(":")[0]
        if name not in self.devices:
            raise ValueError(f"no power figures for device profile {name!r}; "
                             f"known: {', '.join(self.devices)} (add them under costs.devices)")
        return self.devices[name]

    def server_watts(self, gpu: bool) -> float:
        return self.gpu_server_watts if gpu else self.cpu_server_watts

    def server_price_per_hour(self, gpu: bool) -> float:
        return self.gpu_server_price_per_hour if gpu else self.cpu_server_price_per_hour

    def table(self) -> list[dict]:
        """Every assumption as rows {"name", "value", "unit", "source"} for the report."""
        rows = [
            {"name": "gpu_server_watts", "value": self.gpu_server_watts, "unit": "W",
             "source": "assumption: H100 SXM datasheet maximum TDP (700 W), a ceiling not a measurement"},
            {"name": "cpu_server_watts", "value": self.cpu_server_watts, "unit": "W",
             "source": "assumption: a small CPU server under load"},
            {"name": "gpu_server_price_per_hour", "value": self.gpu_server_price_per_hour,
             "unit": "USD/h", "source": "assumption: order of on-demand list prices for one rented H100 GPU "
             "hour (includes its power)"},
            {"name": "cpu_server_price_per_hour", "value": self.cpu_server_price_per_hour,
             "unit": "USD/h", "source": "assumption: a small CPU cloud instance's on-demand list price "
             "(includes its power)"},
            {"name": "electricity_per_kwh", "value": self.electricity_per_kwh, "unit": "USD/kWh",
             "source": "assumption: typical retail electricity price (near a US residential average); "
             "charged for device drafting energy only"}]
        for name, power in self.devices.items():
            for key, unit in (("idle_watts", "W"), ("busy_watts", "W"), ("price_per_hour", "USD/h")):
                rows.append({"name": f"{name}.{key}", "value": round(getattr(power, key), 6),
                             "unit": unit, "source": power.source or "scenario override"})
        return rows


def assumptions(overrides: Mapping[str, Any] | None = None) -> CostAssumptions:
    """The documented assumptions with a scenario's `costs:` overrides applied."""
    base = CostAssumptions()
    overrides = dict(overrides or {})
    device_overrides = overrides.pop("devices", None) or {}
    known = {f.name for f in dataclasses.fields(base)} - {"devices"}
    for key in overrides:
        if key not in known:
            raise ValueError(f"unknown costs key {key!r}; known: devices, {', '.join(sorted(known))}")
    changes = {key: float(value) for key, value in overrides.items()}
    return dataclasses.replace(base, devices=_device_overrides(base.devices, device_overrides), **changes)


def _device_overrides(devices: Mapping[str, DevicePower], overrides: Mapping[str, Any]) -> Mapping[str, DevicePower]:
    """costs.devices: {profile: {idle_watts, busy_watts, price_per_hour}}; a new profile needs both watts."""
    table = dict(devices)
    known = {"idle_watts", "busy_watts", "price_per_hour"}
    for name, values in overrides.items():
        if not isinstance(values, Mapping):
            raise ValueError(f"costs.devices.{name} must be a mapping of {', '.join(sorted(known))}")
        for key in values:
            if key not in known:
                raise ValueError(f"unknown costs key 'devices.{name}.{key}'; known: {', '.join(sorted(known))}")
        current = table.get(name)
        if current is None and not {"idle_watts", "busy_watts"} <= set(values):
            raise ValueError(f"costs.devices.{name}: a new device profile needs idle_watts and busy_watts")
        current = current or DevicePower(0.0, 0.0)
        table[name] = dataclasses.replace(current, source="scenario override",
                                          **{k: float(v) for k, v in values.items()})
    return MappingProxyType(table)


def server_power(overrides: Mapping[str, Any] | None = None, timeout_s: float = 5.0,
                 gpu_index: int = 0) -> dict:
    """The server's draw: power.draw of the GPU the server uses (gpu_index) from nvidia-smi when
    it reads one, else the assumption (the GPU figure when nvidia-smi exists, the CPU figure when
    it does not). Call it during phases and keep the readings as "samples" for a mean."""
    costs = assumptions(overrides)
    if not shutil.which("nvidia-smi"):
        return {"source": "assumed", "watts": costs.cpu_server_watts}
    watts = _nvidia_smi_watts(timeout_s, gpu_index)
    if watts is None:
        return {"source": "assumed", "watts": costs.gpu_server_watts}
    return {"source": "nvidia-smi", "watts": watts}


def _nvidia_smi_watts(timeout_s: float, gpu_index: int = 0) -> float | None:
    """The power.draw of one GPU (by index), or None when nvidia-smi cannot say."""
    try:
        out = subprocess.run(["nvidia-smi", f"--id={gpu_index}", "--query-gpu=power.draw",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout_s).stdout
        values = [float(line) for line in out.split() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return round(values[0], 1) if values else None
