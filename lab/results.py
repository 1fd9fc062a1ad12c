"""The results document a lab run writes (results.json) and the report reads.

    {"run", "mode", "scenario", "started_at", "machine", "link_emulation", "device_machines",
     "phases": [{"system", "fleet_size", "wall_s", "requests", "server", "devices",
                 "replicas" (several servers behind a proxy: each one's load)}],
     "faults": [...], "server_power": {"source", "watts"}}

The runner adds phases as they end; write() puts the document beside the report.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from lab.report.summary import lossless_detail
from lab.scenario import Scenario


def machine() -> dict:
    """Where the run ran: cores, memory, platform, GPU (None without one)."""
    return {"cpus": os.cpu_count(), "memory_gb": _memory_gb(), "platform": platform.platform(),
            "gpu": gpu_name()}


def _memory_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def gpu_name() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None


def record_dict(record) -> dict:
    """A RequestRecord (dataclass) or an already plain dict."""
    return dataclasses.asdict(record) if dataclasses.is_dataclass(record) else dict(record)


@dataclasses.dataclass
class Results:
    run: str
    mode: str
    scenario: Scenario
    started_at: str = dataclasses.field(
        default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    machine: dict = dataclasses.field(default_factory=machine)
    link_emulation: dict = dataclasses.field(default_factory=dict)
    device_machines: dict = dataclasses.field(default_factory=dict)   # id -> x86_64, aarch64
    phases: list[dict] = dataclasses.field(default_factory=list)
    faults: list[dict] = dataclasses.field(default_factory=list)
    server_power: dict = dataclasses.field(default_factory=lambda: {"source": "assumed", "watts": None})

    def add_phase(self, system: str, fleet_size: int, wall_s: float, requests: list,
                  server: dict, devices: dict, replicas: list[dict] | None = None) -> dict:
        phase = {"system": system, "fleet_size": fleet_size, "wall_s": round(wall_s, 3),
                 "requests": [record_dict(r) for r in requests], "server": server,
                 "devices": devices}
        if replicas is not None:
            phase["replicas"] = replicas
        self.phases.append(phase)
        return phase

    def document(self) -> dict:
        return {"run": self.run, "mode": self.mode,
                "scenario": self.scenario.model_dump(mode="json"), "started_at": self.started_at,
                "machine": self.machine, "link_emulation": self.link_emulation,
                "device_machines": self.device_machines,
                "phases": self.phases, "faults": self.faults, "server_power": self.server_power}

    def write(self, folder: Path) -> Path:
        path = Path(folder) / "results.json"
        path.write_text(json.dumps(self.document(), indent=1) + "\n")
        return path


def greedy_mismatches(document: dict) -> int:
    """Requests whose greedy output differed from the target's (an errored request whose tokens
    are a prefix of the reference is not judged): the report's own count."""
    return lossless_detail(document)["mismatched"]


def phase_totals(phase: dict) -> dict:
    """Requests, tokens, errors and lost/duplicated tokens of one phase (the summary line)."""
    requests = phase["requests"]
    return {"requests": len(requests),
            "tokens": sum(len(r.get("token_ids") or []) for r in requests),
            "errors": sum(1 for r in requests if r.get("error")),
            "lost_tokens": sum(r.get("lost_tokens") or 0 for r in requests),
            "duplicated_tokens": sum(r.get("duplicated_tokens") or 0 for r in requests)}
