"""What one fleet run measures, per (mode, N), the same for the real-time emulation (`sled bench
serve`) and the fleet simulator (`sled lab simulate`): system throughput (tokens / makespan),
per-device tokens/s (p5, p50, p95; p5 is the rate 95% of devices reach or beat), time per
output token (p50, p95; a verdict's tokens share its gap), time to first token, target forward
passes per output token, and how many outputs differ from what they must be."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from lab.bench.report import percentile


@dataclass(slots=True)
class FleetRun:
    """One fleet of N devices in one mode: each device's result and what it should have been."""
    mode: str
    devices: int
    results: list            # [N] GenerationResult
    expected: list[list[int]]
    makespan_s: float
    forward_passes: float


def tpot_samples(token_times: list[float]) -> list[float]:
    """Per-token time per output token (s) from arrival stamps, the first verdict's tokens
    excluded: a verdict of m tokens arriving g after the previous one gives m samples of g / m.
    Example: [0.1, 0.3, 0.3, 0.4] -> [0.1, 0.1, 0.1]."""
    runs: list[list] = []                  # [arrival, tokens] per verdict
    for stamp in token_times:
        if runs and runs[-1][0] == stamp:
            runs[-1][1] += 1
        else:
            runs.append([stamp, 1])
    samples: list[float] = []
    for (before, _), (stamp, m) in zip(runs, runs[1:]):
        samples += [(stamp - before) / m] * m
    return samples


def summarize(run: FleetRun) -> dict:
    """The metrics of one fleet run (times in ms, rates in tokens/s)."""
    results = run.results
    tokens = sum(len(r.token_ids) for r in results)
    rates = [len(r.token_ids) / r.elapsed_s for r in results]
    tpot = [s * 1e3 for r in results for s in tpot_samples(r.token_times)] or [0.0]
    ttft = [r.token_times[0] * 1e3 for r in results if r.token_times] or [math.inf]   # none came
    verified = sum(r.draft_tokens for r in results)
    return {
        "mode": run.mode, "devices": run.devices, "tokens": tokens,
        "makespan_s": run.makespan_s, "throughput": tokens / run.makespan_s,
        "device_tps_p5": percentile(rates, 5), "device_tps_p50": percentile(rates, 50),
        "device_tps_p95": percentile(rates, 95), "device_tps_mean": statistics.fmean(rates),
        "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p95": percentile(tpot, 95),
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p95": percentile(ttft, 95),
        "forward_passes": run.forward_passes, "passes_per_token": run.forward_passes / tokens if tokens else math.inf,
        "acceptance_rate": sum(r.accepted_tokens for r in results) / verified if verified else None,
        "mismatches": sum(r.token_ids != want for r, want in zip(results, run.expected)),
        # the share of tokens the server produced itself (its own modes, or a moved session's)
        "served_share": (sum(n for r in results for where, n in r.placements.items()
                             if where != "device") / tokens) if tokens else 0.0,
    }


def add_ratios(rows: list[dict]) -> None:
    """On each sled row, its system throughput over centralized's at the same N, and (rows
    that count GPU time) its GPU-seconds per token over centralized's."""
    central = {r["devices"]: r for r in rows if r["mode"] == "centralized"}
    for r in rows:
        other = central.get(r["devices"])
        if r["mode"] != "sled" or other is None:
            continue
        if other["throughput"]:
            r["throughput_vs_centralized"] = r["throughput"] / other["throughput"]
        if other.get("gpu_s_per_1k"):
            r["gpu_s_vs_centralized"] = r["gpu_s_per_1k"] / other["gpu_s_per_1k"]
