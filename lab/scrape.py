"""What the server and the devices count, read from their Prometheus /metrics during a phase.

    snapshot = read_metrics("http://127.0.0.1:9100/metrics")   # {sample name: [(labels, value)]}
    forward_passes(snapshot)

    async with Sampler(fleet.server_metrics_urls, devices) as sampler:  # polls every second
        ...                                                             # the phase runs
    phase["server"], phase["devices"] = sampler.server(), sampler.devices()
    phase["replicas"] = sampler.replicas()     # replicas behind a proxy: each one's load

The server's numbers are the sum over its replicas when there are several.

Counters are summed from one poll to the next, so a server restarted in a fault step (its
counters back at zero) adds what it counted before and after. A restart is told by the
counter's `_created` sample (when the process made it) changing, not only by a value going
down. A poll that fails (the component is down) is skipped and counted; a component no poll
reached reports None for its numbers (unknown, not zero) and is named in one warning.
"""
from __future__ import annotations

import asyncio
import logging
import itertools
import math
import time
import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("sled.lab.scrape")

Snapshot = dict[str, list[tuple[dict[str, str], float]]]

# Counters the sampler sums over a phase: the server's, then each device's.
SERVER_COUNTERS = ("sled_forward_passes_total", "sled_forward_seconds_sum",
                   "sled_emulated_steps_total", "sled_emulated_overruns_total",
                   "sled_sessions_total", "sled_emitted_tokens_total")
DEVICE_COUNTERS = ("sled_device_draft_tokens_total", "sled_device_accepted_tokens_total",
                   "sled_device_paced_drafts_total", "sled_device_late_drafts_total")
# When the process made its counters: a new value means a restarted process.
SERVER_CREATED = "sled_forward_passes_created"
DEVICE_CREATED = "sled_device_draft_tokens_created"
# Devices scraped per interval at most: a fleet of 64 is read every 4th interval (its counters
# are summed between reads, so only restarts between two reads would go unseen for longer).
DEVICES_PER_POLL = 16
POSITION_DRAFTED = "sled_device_position_drafted_total"
POSITION_ACCEPTED = "sled_device_position_accepted_total"


def parse_metrics(text: str) -> Snapshot:
    """Every sample of a Prometheus text page, by sample name."""
    samples: Snapshot = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((dict(sample.labels), float(sample.value)))
    return dict(samples)


def read_metrics(url: str, timeout: float = 3.0) -> Snapshot:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse_metrics(response.read().decode())


def value(snapshot: Snapshot, name: str, **labels: str) -> float:
    """The sum of a sample's values whose labels include `labels` (0 when absent)."""
    return sum(v for found, v in snapshot.get(name, []) if labels.items() <= found.items())


def forward_passes(snapshot: Snapshot) -> float:
    return value(snapshot, "sled_forward_passes_total")


def forward_seconds(snapshot: Snapshot) -> float:
    return value(snapshot, "sled_forward_seconds_sum")


def kv_blocks(snapshot: Snapshot) -> tuple[float, float]:
    """(used, total) KV pool blocks."""
    return value(snapshot, "sled_kv_blocks_used"), value(snapshot, "sled_kv_blocks_total")


def active_sessions(snapshot: Snapshot) -> float:
    return value(snapshot, "sled_active_sessions")


PLACEMENTS = ("device", "server", "server_sat")    # sled_placed_sessions' labels


def placed_sessions(snapshot: Snapshot, placement: str) -> float:
    """Open sessions whose tokens come from `placement` (the server's placement policy)."""
    return value(snapshot, "sled_placed_sessions", placement=placement)


def batch_buckets(snapshot: Snapshot) -> dict[str, float]:
    """sled_batch_size as cumulative counts by upper bound ("1", "2", ..., "+Inf")."""
    return {_bound(labels["le"]): v for labels, v in snapshot.get("sled_batch_size_bucket", [])}


def per_bucket(cumulative: dict[str, float]) -> dict[str, int]:
    """Cumulative histogram counts as counts per bucket, in bound order."""
    counts, below = {}, 0.0
    for bound in sorted(cumulative, key=lambda b: math.inf if b == "+Inf" else float(b)):
        counts[bound] = int(round(cumulative[bound] - below))
        below = cumulative[bound]
    return counts


def positions(snapshot: Snapshot, name: str) -> dict[int, float]:
    """A per-draft-position counter by position (1..k)."""
    return {int(labels["position"]): v for labels, v in snapshot.get(name, []) if "position" in labels}


def _bound(le: str) -> str:
    number = float(le)
    return "+Inf" if math.isinf(number) else f"{number:g}"


class Totals:
    """Counters summed across polls. A restart (a new creation time, or a value lower than the
    last one) starts from zero: all it counted is added. The first poll is the baseline; a
    labelled counter that appears later started at zero."""

    def __init__(self) -> None:
        self.last: dict[str, float] | None = None
        self.created: float | None = None
        self.total: dict[str, float] = defaultdict(float)

    def add(self, counters: dict[str, float], created: float | None = None) -> None:
        restarted = None not in (created, self.created) and created != self.created
        self.created = created if created is not None else self.created
        if self.last is None:
            self.last = dict(counters)
            return
        if restarted:
            self.last = {}
        for key, now in counters.items():
            before = self.last.get(key, 0.0)
            self.total[key] += now - before if now >= before else now
            self.last[key] = now


def created_at(snapshot: Snapshot, name: str) -> float | None:
    """A counter's creation time (Unix seconds) when the page has it."""
    found = snapshot.get(name)
    return found[0][1] if found else None


def server_counters(snapshot: Snapshot) -> dict[str, float]:
    counters = {name: value(snapshot, name) for name in SERVER_COUNTERS}
    counters.update({f"batch:{bound}": v for bound, v in batch_buckets(snapshot).items()})
    return counters


def device_counters(snapshot: Snapshot) -> dict[str, float]:
    counters = {name: value(snapshot, name) for name in DEVICE_COUNTERS}
    for name in (POSITION_DRAFTED, POSITION_ACCEPTED):
        counters.update({f"{name}:{p}": v for p, v in positions(snapshot, name).items()})
    return counters


class Sampler:
    """Polls the server (each replica, behind a proxy) and every device during a phase; the
    deltas and time series come out in the shape of the results document's "server", "devices"
    and "replicas" entries."""

    def __init__(self, server_url: str | list[str], devices: list, interval_s: float = 1.0) -> None:
        self.server_urls = [server_url] if isinstance(server_url, str) else list(server_url)
        self.handles, self.interval_s = list(devices), interval_s
        self.replica_totals = [Totals() for _ in self.server_urls]
        self.replica_polls = [{"ok": 0, "failed": 0} for _ in self.server_urls]
        self.device_totals = {handle.slot.id: Totals() for handle in self.handles}
        self.kv_used: list[list[float]] = []
        self.sessions: list[list[float]] = []
        self.placed: list[list[float]] = []   # [at, device, server, server_sat] sessions open
        self.kv_total = 0
        self.started = 0.0
        self.polls = {name: {"ok": 0, "failed": 0}               # by component: server, device ids
                      for name in ["server", *self.device_totals]}
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "Sampler":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self) -> None:
        self.started = time.monotonic()
        await self.poll()                        # the baseline
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.poll()                        # what the last second counted
        never = [name for name, count in self.polls.items() if not count["ok"]]
        if never:
            log.warning("no metrics could be read from %s during the phase (%d polls each): "
                        "their numbers are unknown", ", ".join(never), self.polls[never[0]]["failed"])

    async def _run(self) -> None:
        """The server every interval; the devices every device_every-th one, so a large fleet's
        scrapes do not take the cores its devices and server share."""
        device_every = max(1, math.ceil(len(self.handles) / DEVICES_PER_POLL))
        for tick in itertools.count(1):
            await asyncio.sleep(self.interval_s)
            await self.poll(devices=tick % device_every == 0)

    async def poll(self, devices: bool = True) -> None:
        """One scrape of the server's replicas and (DEVICES) every device; one that fails is
        skipped."""
        handles = self.handles if devices else []
        pages = await asyncio.gather(*(_fetch(url) for url in self.server_urls),
                                     *(_fetch(h.metrics_url) for h in handles))
        at = round(time.monotonic() - self.started, 3)
        servers, pages = pages[:len(self.server_urls)], pages[len(self.server_urls):]
        self._take_servers(at, servers)
        for handle, page in zip(handles, pages):
            self._count(handle.slot.id, page)
            if page is not None:
                self.device_totals[handle.slot.id].add(device_counters(page), created_at(page, DEVICE_CREATED))

    def _count(self, name: str, page: Snapshot | None) -> None:
        self.polls[name]["ok" if page is not None else "failed"] += 1

    def reached(self, name: str) -> bool:
        return self.polls[name]["ok"] > 0

    def _take_servers(self, at: float, pages: list[Snapshot | None]) -> None:
        """Each replica's counters; KV blocks and open sessions summed over those that answered
        (the server counts as read when any did)."""
        read = [page for page in pages if page is not None]
        self._count("server", read[0] if read else None)
        for i, page in enumerate(pages):
            self.replica_polls[i]["ok" if page is not None else "failed"] += 1
            if page is not None:
                self.replica_totals[i].add(server_counters(page), created_at(page, SERVER_CREATED))
        if not read:
            return
        used = sum(kv_blocks(page)[0] for page in read)
        total = sum(kv_blocks(page)[1] for page in read)
        self.kv_used.append([at, int(used)])
        self.sessions.append([at, int(sum(active_sessions(page) for page in read))])
        self.placed.append([at, *(int(sum(placed_sessions(page, where) for page in read))
                                  for where in PLACEMENTS)])
        self.kv_total = max(self.kv_total, int(total))

    @property
    def server_totals(self) -> Totals:
        """The counters summed over the replicas (the one server's when there is one)."""
        summed = Totals()
        for replica in self.replica_totals:
            for key, total in replica.total.items():
                summed.total[key] += total
        return summed

    def server(self) -> dict:
        totals = self.server_totals.total
        batches = {key.split(":", 1)[1]: v for key, v in totals.items() if key.startswith("batch:")}
        known = self.reached("server")              # else every number is unknown (None)
        counts = _counts(totals, known, forward_passes="sled_forward_passes_total",
                         # an emulated server's steps and those whose real compute overran
                         emulated_steps="sled_emulated_steps_total",
                         emulated_overruns="sled_emulated_overruns_total")
        return {**counts,
                "forward_seconds": totals.get("sled_forward_seconds_sum", 0.0) if known else None,
                "batch_sizes": per_bucket(batches), "kv_blocks_used": self.kv_used,
                "kv_blocks_total": self.kv_total if known else None, "active_sessions": self.sessions,
                "placed_sessions": self.placed,
                "polls": dict(self.polls["server"])}

    def replicas(self) -> list[dict]:
        """Each replica's load over the phase: sessions opened (resumed ones included), tokens
        it committed, its forward passes (None: never read)."""
        return [{"replica": i, **_counts(totals.total, polls["ok"] > 0,
                                         sessions="sled_sessions_total",
                                         tokens="sled_emitted_tokens_total",
                                         forward_passes="sled_forward_passes_total"),
                 "polls": dict(polls)}
                for i, (totals, polls) in enumerate(zip(self.replica_totals, self.replica_polls))]

    def devices(self) -> dict:
        return {handle.slot.id: self._device(handle) for handle in self.handles}

    def _device(self, handle) -> dict:
        totals = self.device_totals[handle.slot.id].total
        known = self.reached(handle.slot.id)        # else drafted/accepted are unknown (None)
        counts = _counts(totals, known, drafted="sled_device_draft_tokens_total",
                         accepted="sled_device_accepted_tokens_total",
                         # drafts paced to the emulated board, and those this host made late
                         paced_drafts="sled_device_paced_drafts_total",
                         late_drafts="sled_device_late_drafts_total")
        return {"profile": handle.slot.device, "link": handle.slot.link, "drafter": handle.slot.drafter,
                "position_drafted": _by_position(totals, POSITION_DRAFTED),
                "position_accepted": _by_position(totals, POSITION_ACCEPTED),
                **counts, "polls": dict(self.polls[handle.slot.id])}


def _counts(totals: dict[str, float], known: bool, **names: str) -> dict[str, int | None]:
    """key -> the counter NAME's total as a whole number (None: the component was never read)."""
    return {key: int(round(totals.get(name, 0.0))) if known else None for key, name in names.items()}


def _by_position(totals: dict[str, float], name: str) -> list[int]:
    """Counts for positions 1..k (k: the highest position seen) as a list."""
    found = {int(key.rsplit(":", 1)[1]): v for key, v in totals.items() if key.startswith(name + ":")}
    return [int(round(found.get(p, 0.0))) for p in range(1, max(found, default=0) + 1)]


async def _fetch(url: str) -> Snapshot | None:
    try:
        return await asyncio.to_thread(read_metrics, url)
    except Exception as error:      # down during a fault step, or not up yet: skip this poll
        log.debug("scrape of %s skipped: %s", url, error)
        return None
