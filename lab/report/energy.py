"""Energy per token and cost per million tokens per device profile, sled vs centralized.

Both systems use the phase of their largest fleet size. Centralized: the server's energy and
time only (the devices sit idle either way). Sled: the server's share per token plus the
drafting energy of that profile's devices (busy watts x drafted tokens x the profile's
per-token drafting time) per token they received. Device boards are owned in both systems, so
their amortised price is listed as an assumption but left out of both totals.

Cost rule: cost = the server's price per hour x the phase's hours (a rented server's hourly
price already includes its power, so no electricity is added for it) + electricity for the
devices' drafting energy (owned boards) at electricity_per_kwh.

Drafting energy counts verified drafted tokens x the profile's per-token drafting time: it
undercounts drafts discarded in pipelined rounds and leaves out per-round overhead.

GPU or CPU server: the results' `server_device` when present, else the scenario's server args
(`--device cuda...` means GPU); a GPU on the machine alone does not make the server use it.
Server power: the mean of `server_power.samples` taken during the phases when present, else
`server_power.watts`, else the assumption for that kind of server.
"""
from __future__ import annotations

from collections import defaultdict

from lab.costs import CostAssumptions, assumptions
from lab.profiles import device_profile


def server_on_gpu(results: dict) -> bool:
    """Whether the server ran on a GPU: results' server_device, else its --device flag."""
    device = results.get("server_device")
    if device is None:
        args = [str(a) for a in (((results.get("scenario") or {}).get("server") or {}).get("args") or [])]
        for i, arg in enumerate(args):
            if arg.startswith("--device="):
                device = arg.partition("=")[2]
            elif arg == "--device" and i + 1 < len(args):
                device = args[i + 1]
    return str(device or "cpu").startswith("cuda")


def server_watts(results: dict, table: CostAssumptions, gpu: bool) -> tuple[float, str]:
    """(watts, source): mean of samples during phases, else the one reading, else the assumption."""
    power = results.get("server_power") or {}
    samples = [float(w) for w in (power.get("samples") or []) if w is not None]
    if gpu and samples:
        return round(sum(samples) / len(samples), 3), f"{power.get('source') or 'measured'} (mean of {len(samples)} samples)"
    if gpu and power.get("watts") is not None and power.get("source") not in (None, "assumed"):
        return float(power["watts"]), power["source"]
    return table.server_watts(gpu), "assumed"


def costs(results: dict) -> dict:
    table = assumptions((results.get("scenario") or {}).get("costs") or {})
    gpu = server_on_gpu(results)
    watts, source = server_watts(results, table, gpu)
    server = {"watts": watts, "source": source, "price_per_hour": table.server_price_per_hour(gpu), "gpu": gpu}
    largest = {}
    for phase in results["phases"]:
        if phase["fleet_size"] >= largest.get(phase["system"], {}).get("fleet_size", 0):
            largest[phase["system"]] = phase
    profiles = sorted({d.get("profile") for p in results["phases"] for d in (p.get("devices") or {}).values()}
                      | {r.get("profile") for p in results["phases"] for r in p["requests"]} - {None})
    per_profile = {name: {system: _profile_cost(phase, name, server, table)
                          for system, phase in sorted(largest.items())} for name in profiles}
    return {"server": server, "per_profile": per_profile, "assumptions": table.table(),
            "rule": "server price/h x hours (includes its power) + device drafting energy x electricity price"}


def _server_share(phase: dict, server: dict) -> tuple[float, float] | None:
    """(joules per token, USD per token) of the server over the phase."""
    tokens = sum(len(r.get("token_ids") or []) for r in phase["requests"])
    wall = phase.get("wall_s") or 0.0
    if not tokens or wall <= 0:
        return None
    return server["watts"] * wall / tokens, server["price_per_hour"] * wall / 3600 / tokens


def _profile_cost(phase: dict, profile: str, server: dict, table: CostAssumptions) -> dict | None:
    share = _server_share(phase, server)
    if share is None:
        return None
    joules, usd = share
    device_joules = _drafting_joules_per_token(phase, profile, table) if phase["system"] == "sled" else 0.0
    if device_joules is None:
        return None
    energy = joules + device_joules
    usd += device_joules / 3.6e6 * table.electricity_per_kwh  # owned boards pay for their power
    return {"energy_j_per_token": round(energy, 6), "server_j_per_token": round(joules, 6),
            "device_j_per_token": round(device_joules, 6), "usd_per_million_tokens": round(usd * 1e6, 6)}


def _drafting_joules_per_token(phase: dict, profile: str, table: CostAssumptions) -> float | None:
    """Drafting energy of the profile's devices per token those devices received."""
    tokens = defaultdict(int)
    for r in phase["requests"]:
        tokens[r.get("device")] += len(r.get("token_ids") or [])
    mine = {d: dev for d, dev in (phase.get("devices") or {}).items() if dev.get("profile") == profile}
    received = sum(tokens[d] for d in mine)
    if not received:
        return None
    seconds = sum((dev.get("drafted") or 0) * device_profile(profile).draft_ms_per_token / 1e3
                  for dev in mine.values())
    return table.device(profile).busy_watts * seconds / received
