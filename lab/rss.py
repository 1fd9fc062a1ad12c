"""The memory of a local fleet over time: the verify server and every device daemon, found among
this process's children (`sled serve`, and `sled device` by its SLED_DEVICE_ID), their RSS
sampled with psutil.

    series = RssSeries()
    series.sample(at_s=12.5)                  # every few seconds while the fleet runs
    series.server_growth(window_s=60)         # the last server process, first window -> last
    series.device_growth(window_s=60)         # each device, first window -> last

A server restarted in a fault step is a new process: its growth is counted from its own first
window, so a restart is not taken for a shrink (or a leak).
"""
from __future__ import annotations

import statistics

import psutil

MIB = 1 << 20


def fleet_processes() -> dict[str, psutil.Process]:
    """This process's `sled serve` child as "server", its `sled device` children by device id."""
    found: dict[str, psutil.Process] = {}
    for child in psutil.Process().children(recursive=True):
        try:
            command = child.cmdline()
            if "sled_cli.main" not in command[:3]:
                continue
            role = command[command.index("sled_cli.main") + 1]
            if role == "serve":
                found["server"] = child
            elif role == "device":
                found[child.environ().get("SLED_DEVICE_ID", f"pid-{child.pid}")] = child
        except (psutil.Error, IndexError):
            continue            # gone between the listing and the look
    return found


class RssSeries:
    """RSS samples of the server and the devices: {"at_s", "server_pid", "server_mib",
    "devices_mib": {id: MiB}} each."""

    def __init__(self) -> None:
        self.samples: list[dict] = []

    def sample(self, at_s: float) -> None:
        """One sample of every fleet process found now (one that is down is left out)."""
        rss = {}
        processes = fleet_processes()
        for name, process in processes.items():
            try:
                rss[name] = process.memory_info().rss / MIB
            except psutil.Error:
                continue
        server = processes.get("server")
        self.samples.append({"at_s": round(at_s, 1),
                             "server_pid": server.pid if server and "server" in rss else None,
                             "server_mib": round(rss.pop("server"), 1) if "server" in rss else None,
                             "devices_mib": {name: round(mib, 1) for name, mib in sorted(rss.items())}})

    def server_growth(self, window_s: float, serving_since_s: float = 0.0) -> dict:
        """The last server process's RSS from serving_since_s (a restarted one loads its target
        first): mean of its first window, of the last window, growth %, the span between them,
        and how many server processes were seen (restarts + 1)."""
        pids = list(dict.fromkeys(s["server_pid"] for s in self.samples if s["server_pid"]))
        if not pids:
            return {"processes": 0}
        points = [(s["at_s"], s["server_mib"]) for s in self.samples
                  if s["server_pid"] == pids[-1] and s["at_s"] >= serving_since_s]
        return {"processes": len(pids), **growth(points, window_s)}

    def device_growth(self, window_s: float) -> dict:
        """Each device's RSS growth from its first window to its last: the median and the largest,
        and the growth of all devices' RSS together."""
        names = sorted({name for s in self.samples for name in s["devices_mib"]})
        each = [growth([(s["at_s"], s["devices_mib"][n]) for s in self.samples
                        if n in s["devices_mib"]], window_s) for n in names]
        each = [g for g in each if g.get("growth_pct") is not None]
        totals = [(s["at_s"], sum(s["devices_mib"].values())) for s in self.samples if s["devices_mib"]]
        if not each:
            return {"devices": 0}
        return {"devices": len(each),
                "first_mib_mean": round(statistics.fmean(g["first_mib"] for g in each), 1),
                "last_mib_mean": round(statistics.fmean(g["last_mib"] for g in each), 1),
                "growth_pct_median": round(statistics.median(g["growth_pct"] for g in each), 2),
                "growth_pct_max": round(max(g["growth_pct"] for g in each), 2),
                "total": growth(totals, window_s)}


def growth(points: list[tuple[float, float]], window_s: float) -> dict:
    """Mean of the values in the first window_s of the points and in the last, and the growth
    between them in percent: growth([(0, 100), (60, 100), (120, 104)], 30) -> +4%."""
    if not points:
        return {"growth_pct": None}
    start, end = points[0][0], points[-1][0]
    first = statistics.fmean(v for t, v in points if t <= start + window_s)
    last = statistics.fmean(v for t, v in points if t >= end - window_s)
    return {"first_mib": round(first, 1), "last_mib": round(last, 1),
            "growth_pct": round(100 * (last - first) / first, 2) if first else None,
            "from_s": start, "to_s": end}
