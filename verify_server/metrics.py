"""Prometheus metrics of one server (its own registry, so several servers can share a process)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from verify_server.engines.blocks import BlockPool

BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)   # seconds
MAX_DEVICE_LABELS = 1024    # distinct device labels; later devices are counted as "other"


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.forward_passes = Counter("sled_forward_passes", "Batched target forward passes", registry=r)
        self.overlapped_steps = Counter("sled_overlapped_steps", "Steps launched while the one "
                                        "before them was still undecided (its host work hidden "
                                        "behind the device's)", registry=r)
        self.draft_tokens = Counter("sled_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter("sled_accepted_tokens", "Draft tokens accepted", registry=r)
        self.emitted_tokens = Counter("sled_emitted_tokens", "Tokens committed to sessions", registry=r)
        self.rounds = Counter("sled_rounds", "Verify rounds answered", registry=r)
        self.sessions = Counter("sled_sessions", "Sessions opened", registry=r)
        self.loose_sessions = Counter("sled_loose_sessions", "Sessions opened with loose "
                                      "verification (not lossless)", registry=r)
        self.loose_tokens = Counter("sled_loose_accepted_tokens", "Draft tokens loose sessions "
                                    "kept against the target's own token (not lossless)", registry=r)
        self.errors = Counter("sled_errors", "Sessions ended by an error", ["reason"], registry=r)
        self.forward_tokens = Counter("sled_forward_tokens", "Tokens fed through forward passes",
                                      registry=r)
        self.expired = Counter("sled_expired_work", "Work dropped because its deadline passed",
                               registry=r)
        self.evicted = Counter("sled_evicted_sessions", "Idle sessions whose KV was freed", registry=r)
        self.prefix_hit_tokens = Counter("sled_prefix_cache_hit_tokens",
                                         "Prompt tokens whose KV came from the prefix cache", registry=r)
        self.kv_blocks_used = Gauge("sled_kv_blocks_used", "KV pool blocks in use", registry=r)
        self.kv_blocks_total = Gauge("sled_kv_blocks_total", "KV pool blocks", registry=r)
        self.active_sessions = Gauge("sled_active_sessions", "Sessions open now", registry=r)
        self.kv_tokens = Gauge("sled_kv_tokens", "Tokens held in session KV caches", registry=r)
        self._admission(r)
        self._placement(r)
        self.batch_size = Histogram("sled_batch_size", "Sessions per forward pass",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.forward_seconds = Histogram("sled_forward_seconds", "Forward pass + acceptance "
                                         "time (emulating a device: the profile's step time)",
                                         registry=r)
        # an emulated server (sled serve --emulate): steps held to a profile's time, and those
        # whose real compute took longer than the profile allows
        self.emulated_steps = Counter("sled_emulated_steps", "Steps held to the step-cost "
                                      "profile's time (sled serve --emulate)", registry=r)
        self.emulated_overruns = Counter("sled_emulated_overruns", "Emulated steps whose real "
                                         "compute took longer than the profile's time", registry=r)
        self.emulated_overrun_seconds = Counter("sled_emulated_overrun_seconds", "Time emulated "
                                                "steps ran past the profile's time", registry=r)
        # per device (its token's or certificate's name; "anonymous" without either)
        self.device_sessions = Counter("sled_device_sessions", "Sessions opened per device",
                                       ["device"], registry=r)
        self.device_tokens = Counter("sled_device_tokens", "Tokens through the target per "
                                     "device (prompt + draft + 1), what its quota counts",
                                     ["device"], registry=r)
        self.auth_refusals = Counter("sled_auth_refusals", "Calls refused for their identity",
                                     ["reason"], registry=r)
        self._device_labels: set[str] = set()

    def _admission(self, r: CollectorRegistry) -> None:
        """Sessions waiting for KV when the whole cache is full (verify_server.admission)."""
        self.admission_waiting = Gauge("sled_admission_waiting", "Sessions waiting in the "
                                       "admission queue for KV now", registry=r)
        self.admission_wait = Histogram("sled_admission_wait_seconds", "Seconds a session "
                                        "waited in the admission queue before its KV was "
                                        "reserved (part of its time to first token)",
                                        buckets=WAIT_BUCKETS, registry=r)
        self.admission_refusals = Counter("sled_admission_refusals", "Sessions refused for KV "
                                          "past a bound of the admission queue: queue (it was "
                                          "full) or wait (they waited the longest allowed)",
                                          ["bound"], registry=r)

    def _placement(self, r: CollectorRegistry) -> None:
        """Where sessions' tokens come from (verify_server.placement)."""
        self.placed_sessions = Gauge("sled_placed_sessions", "Sessions open now by where their "
                                     "tokens come from: device, server or server_sat",
                                     ["placement"], registry=r)
        self.placement_moves = Counter("sled_placement_moves", "Sessions moved by the placement "
                                       "policy, by where they went", ["to"], registry=r)
        self.step_load = Gauge("sled_step_load", "The GPU's recent load as the placement "
                               "policy reads it: the share of the last seconds spent in steps "
                               "past what its lightest step takes (0..1)", registry=r)
        self.stale_drafts = Counter("sled_stale_drafts", "Drafts of a moved session for a round "
                                    "already past, dropped unanswered", registry=r)

    def device_label(self, device: str) -> str:
        """The device's label: its own name for the first MAX_DEVICE_LABELS devices, so the
        label set stays bounded whatever names certificates carry."""
        if device in self._device_labels:
            return device
        if len(self._device_labels) >= MAX_DEVICE_LABELS:
            return "other"
        self._device_labels.add(device)
        return device

    def count_round(self, verified: int, accepted: int, emitted: int, loose: int = 0) -> None:
        """loose: accepted tokens a loose session kept against the target's argmax."""
        self.rounds.inc()
        if loose:
            self.loose_tokens.inc(loose)
        self.draft_tokens.inc(verified)
        self.accepted_tokens.inc(accepted)
        self.emitted_tokens.inc(emitted)

    def watch_pool(self, pool: BlockPool) -> None:
        """The KV gauges read the pool when scraped, so no code path has to keep them current."""
        self.kv_blocks_total.set_function(lambda: pool.usable_blocks)
        self.kv_blocks_used.set_function(lambda: pool.used_blocks)
        self.kv_tokens.set_function(lambda: pool.held_tokens)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of a sample, e.g. value("sled_forward_passes_total")."""
        found = self.registry.get_sample_value(name, labels or {})
        return 0.0 if found is None else found

    def serve_http(self, port: int, addr: str = "127.0.0.1"):
        """Expose /metrics; returns the (server, thread) pair from prometheus_client."""
        return start_http_server(port, addr=addr, registry=self.registry)
