"""A verify server on simulated time: sled's own service, core and scheduler, with the engine
replaced by the profile (lab.sim.engine).

Everything a real server decides is decided by its own code: which sessions are admitted and
within which device's share of the KV (sized to the profiled GPU's memory), the order and the
budget of each step (the scheduler's plan), deadlines, the end of a round. Only the step itself
differs: it runs on the loop and lasts the profile's time for its rows, and its argmax comes
from the sessions' scripts.

    server = simulated_server(profile, settings, scripts)   # inside the simulation's loop
    stub = server.stub("ipv4:10.0.0.7:50000")                # a device's calls
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lab.sim.engine import HostCost, ScriptedEngine, SelfDraft, bookkeeping_pool
from lab.sim.stub import LocalStub
from verify_server.auth import access_of
from verify_server.gpu_memory import gpu_memory
from verify_server.metrics import Metrics
from verify_server.scheduler import Outcome, Scheduler, Work, run_step
from verify_server.sdsat import SatSpec
from verify_server.service import VerifierService
from verify_server.settings import ServerSettings
from verify_server.shapes import shape_of, windows
from verify_server.step_costs import StepProfile
from verify_server.target import Target

FINGERPRINT = "simulated"      # the tokenizer a simulated target has: none; traces carry none


class SimulatedScheduler(Scheduler):
    """The server's scheduler (its plan, budget, deadlines and replies) whose step runs on the
    loop and then takes the engine's simulated time: one step at a time (the profile's time is
    a step's kernels and the host's, `HostCost`, in series)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, overlap=False, **kwargs)

    async def execute(self, plan: list[tuple[Work, int]]) -> list[Outcome | None]:
        outcomes = run_step(self.engine, plan)
        await asyncio.sleep(self.engine.seconds)
        return outcomes


@dataclass
class SimulatedServer:
    service: VerifierService
    scheduler: SimulatedScheduler
    engine: ScriptedEngine
    metrics: Metrics

    @property
    def fingerprint(self) -> str:
        """The served tokenizer's fingerprint, as a device's target knows it."""
        return self.service.core.target.fingerprint

    def stub(self, peer: str) -> LocalStub:
        return LocalStub(self.service, peer)

    def forward_passes(self) -> float:
        return self.metrics.value("sled_forward_passes_total")

    def busy_seconds(self) -> float:
        """Simulated seconds the GPU spent in steps so far (the host's own time is not the
        GPU's)."""
        return self.engine.gpu_seconds

    async def stop(self) -> None:
        await self.scheduler.stop()


def kv_tokens(profile: StepProfile, settings: ServerSettings) -> int:
    """Tokens of KV the profiled GPU holds after the weights; without a known memory, what
    --kv-budget holds of the profile's model. ValueError when neither is known."""
    gpu = gpu_memory(profile)
    tokens = gpu.kv_tokens()
    if tokens is not None:
        return tokens
    if settings.kv_budget and gpu.kv_bytes_per_token:
        return settings.kv_budget // gpu.kv_bytes_per_token
    raise ValueError(f"step profile {profile.name}: the GPU's memory is unknown (no gpu block, "
                     "and its device or model is not one sled knows): give its gpu block "
                     "(memory_bytes, weight_bytes, kv_bytes_per_token)")


def kv_windows(profile: StepProfile, settings: ServerSettings) -> tuple[int | None, ...]:
    """Each layer's sliding window of the profile's model, where its pool keeps only the
    window (--kv-windows, a model of a known shape with windows); () otherwise."""
    shape = shape_of(str(profile.provenance.get("model", "")))
    return windows(shape) if settings.kv_windows and shape is not None else ()


def head_slots(drafts: SelfDraft | None) -> SatSpec | None:
    """The SAT slots a self-drafting simulated target carries: one per guess of its head (their
    ids are never read: the engine answers them from the scripts)."""
    if drafts is None:
        return None
    return SatSpec(slots=drafts.slots, token_ids=[0] * drafts.slots, source="simulated draft head")


def simulated_server(profile: StepProfile, settings: ServerSettings,
                     scripts: Mapping[tuple[int, ...], Sequence[int]], vocab_size: int,
                     context_length: int = 131072,
                     fingerprint: str | None = None,
                     host: HostCost = HostCost(),
                     drafts: SelfDraft | None = None) -> SimulatedServer:
    """A server held to `profile` serving the sessions `scripts` names (prompt[:-1] -> output),
    started on the running loop; `fingerprint`: the tokenizer its drafts were made in (recorded
    traces carry one; calibrated ones none); `drafts`: a target that drafts for itself
    (GENERATION_MODE_SERVER_SAT sessions), with the draft head `drafts` simulates."""
    metrics = Metrics()
    pool = bookkeeping_pool(kv_tokens(profile, settings), settings.kv_block_tokens,
                            kv_windows(profile, settings), settings.max_step_tokens)
    engine = ScriptedEngine(profile, pool, scripts, host, drafts=drafts, vocab_size=vocab_size)
    target = Target(model=None, tokenizer=None, model_id=f"simulated:{profile.name}",
                    vocab_size=vocab_size, eos_ids=(), context_length=context_length,
                    fingerprint=fingerprint or FINGERPRINT, sat=head_slots(drafts))
    metrics.watch_pool(pool)
    scheduler = SimulatedScheduler(engine, metrics, settings.max_batch_sessions,
                                   settings.max_step_tokens)
    scheduler.start()
    gate, _ = access_of(settings)
    return SimulatedServer(VerifierService(target, scheduler, settings, metrics, gate), scheduler,
                           engine, metrics)
