"""Round latency of a fleet over time: every device's sled_device_round_trip_seconds histogram
(draft sent -> verdict) scraped every few seconds and summed, then differenced per window, with
the percentiles read from the buckets as Prometheus's histogram_quantile reads them (linear
within a bucket, so a percentile is as fine as the bucket it falls in).

    trips = RoundTrips(fleet.devices)
    await trips.scrape(at_s=5.0)              # every few seconds while the fleet runs
    trips.per_window(60)                      # [{"window", "from_s", "rounds", "p50_ms", "p99_ms"}]
"""
from __future__ import annotations

import asyncio
import math

from lab.scrape import read_metrics

BUCKETS = "sled_device_round_trip_seconds_bucket"


class RoundTrips:
    """Cumulative round-trip bucket counts, summed over the devices, at each scrape. A device
    that cannot be read keeps its last counts (they only grow)."""

    def __init__(self, devices: list) -> None:
        self.devices = list(devices)
        self.last: dict[str, dict[float, float]] = {}
        self.series: list[tuple[float, dict[float, float]]] = []

    async def scrape(self, at_s: float) -> None:
        """Every device's histogram now, summed into the series at at_s."""
        pages = await asyncio.gather(*(_read(handle.metrics_url) for handle in self.devices))
        for handle, page in zip(self.devices, pages):
            if page is not None:
                self.last[handle.id] = {float(labels["le"]): count
                                        for labels, count in page.get(BUCKETS, [])}
        summed: dict[float, float] = {}
        for buckets in self.last.values():
            for bound, count in buckets.items():
                summed[bound] = summed.get(bound, 0.0) + count
        self.series.append((at_s, summed))

    def per_window(self, window_s: float) -> list[dict]:
        """Rounds and round-trip p50/p99 (ms) in each window_s from the first scrape."""
        if len(self.series) < 2:
            return []
        start, end = self.series[0][0], self.series[-1][0]
        windows = []
        for index in range(max(1, math.ceil((end - start) / window_s))):
            low, high = start + index * window_s, min(end, start + (index + 1) * window_s)
            counts = _minus(self._at(high), self._at(low))
            rounds = int(counts.get(math.inf, 0))
            windows.append({"window": index, "from_s": round(low - start, 1),
                            "to_s": round(high - start, 1), "rounds": rounds,
                            "p50_ms": _ms(quantile(0.50, counts)), "p99_ms": _ms(quantile(0.99, counts))})
        return windows

    def _at(self, at_s: float) -> dict[float, float]:
        """The counts of the last scrape at or before at_s."""
        found = self.series[0][1]
        for when, counts in self.series:
            if when > at_s:
                break
            found = counts
        return found


def quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram {upper bound: count}, linear within its bucket:
    quantile(0.5, {0.1: 2, 0.2: 4, inf: 4}) == 0.1. None without observations; one in the
    +Inf bucket is the largest finite bound."""
    bounds = sorted(cumulative)
    total = cumulative.get(math.inf, cumulative[bounds[-1]] if bounds else 0.0)
    if not total:
        return None
    rank, below, lower = q * total, 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        below, lower = count, bound
    return lower


def _minus(now: dict[float, float], before: dict[float, float]) -> dict[float, float]:
    return {bound: max(0.0, count - before.get(bound, 0.0)) for bound, count in now.items()}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


async def _read(url: str):
    try:
        return await asyncio.to_thread(read_metrics, url)
    except Exception:          # a device that does not answer this time keeps its last counts
        return None
