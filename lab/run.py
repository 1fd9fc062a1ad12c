"""`sled lab run SCENARIO`: run a scenario on a fleet (processes here, or Docker Compose), sled
and then the centralized baseline for each fleet size, then write results.json and the report.

    sled lab run smoke                       # lab-results/smoke-<time>/report.html
    sled lab run my.yaml --out runs --run first --fleet compose

Exit status: 0 ok, 1 a greedy output differed from the target's, 2 a bad flag, scenario or
workload, 3 a component of the fleet did not start, 130 Ctrl-C.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import aiomqtt
from rich.console import Console
from rich.live import Live

from lab import drive, scrape
from lab.arch import ArchUnavailable, emulation_ready, foreign_slots, slot_arch
from lab.faults import publish_configs, run_faults
from lab.health import wait_health
from lab.fleet import Fleet, FleetStartError
from lab.fleet_compose import ComposeFleet
from lab.fleet_local import LocalFleet
from lab.oracle import target_references
from verify_server.flags import served_settings
from lab.report import build_report, load_report
from lab.results import Results, greedy_mismatches, phase_totals
from lab.scenario import Scenario, ScenarioError, load_scenario
from lab.traces.calibrated import write_traces
from lab.workload import load_workload

PREFIX = "sled"
# "chat": short questions a phone or a kiosk would ask (the workload's built-in chat set).
class PhaseProgress:
    """The live line of a phase: requests done, tokens, errors, elapsed. drive() reports each
    finished request with `progress(record)` (or request_done) and streamed tokens with tokens(n)."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total = label, total
        self.done = self.streamed = self.errors = 0
        self.streaming = False      # tokens(n) was called: count those, not the records'
        self.started = time.monotonic()

    def __call__(self, record) -> None:
        self.request_done(record)

    def request_done(self, record) -> None:
        self.done += 1
        self.errors += 1 if getattr(record, "error", None) else 0
        if not self.streaming:
            self.streamed += len(getattr(record, "token_ids", None) or [])

    def tokens(self, n: int) -> None:
        self.streaming = True
        self.streamed += n

    def line(self) -> str:
        total = f"/{self.total}" if self.total else ""
        return (f"{self.label}: {self.done}{total} requests, {self.streamed} tokens, "
                f"{self.errors} errors, {time.monotonic() - self.started:.0f} s")

    @contextlib.asynccontextmanager
    async def live(self):
        """A rich live line on stderr, refreshed twice a second while the phase runs."""
        with Live(self.line(), console=Console(stderr=True), transient=True) as live:
            async def refresh() -> None:
                while True:
                    live.update(self.line())
                    await asyncio.sleep(0.5)

            task = asyncio.create_task(refresh())
            try:
                yield self
            finally:
                task.cancel()


def phase_line(text: str) -> None:
    print(f"sled lab run: {text}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="a built-in scenario (smoke, fleet16, poisson, faults) "
                                         "or a path to a scenario YAML file")
    parser.add_argument("--out", default="lab-results", metavar="DIR",
                        help="where the run's folder goes (default: lab-results)")
    parser.add_argument("--fleet", choices=("local", "compose"), default="local",
                        help="processes on this machine, or Docker Compose (default: local)")
    parser.add_argument("--run", default=None, metavar="NAME",
                        help="the run's folder name under --out (default: scenario-time)")
    parser.add_argument("--beside", default=None, metavar="RUN_DIR",
                        help="a finished run's folder: the report draws its sled vs centralized "
                             "next to this run's (e.g. this machine's own server beside an "
                             "emulated GPU)")


def run(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.scenario)
        if args.fleet == "local":
            local_arch_ready(scenario, args.scenario)
        prompts = scenario_prompts(scenario)
        beside = load_report(Path(args.beside)) if args.beside else None
    except (ScenarioError, ArchUnavailable, ValueError, OSError) as exc:
        return _fail(str(exc), 2)
    name = args.run or f"{scenario.name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    folder = Path(args.out) / name
    folder.mkdir(parents=True, exist_ok=True)
    logging.getLogger("mqtt").setLevel(logging.ERROR)   # paho's "N pending publish calls" per burst
    return asyncio.run(run_scenario(scenario, prompts, folder, args.fleet, beside))


def _fail(message: str, code: int) -> int:
    print(f"sled lab run: {message}", file=sys.stderr, flush=True)
    return code


def local_arch_ready(scenario: Scenario, spec: str) -> None:
    """Devices of another architecture than this machine's run in containers of theirs (once
    this machine can run them at all): ArchUnavailable saying so."""
    foreign = foreign_slots(scenario.slots())
    if foreign:
        emulation_ready(foreign)
        arches = ", ".join(sorted({slot_arch(slot) for slot in foreign}))
        raise ArchUnavailable(f"the {arches} devices ({', '.join(s.id for s in foreign)}) run in "
                              f"containers of their platform, not as processes here: "
                              f"sled lab compose {spec}")


def machines_line(machines: dict[str, str]) -> None:
    """Which machine each device's daemon runs on: x86_64 (dev-00, dev-01), aarch64 (...)."""
    kinds: dict[str, list[str]] = {}
    for device_id, machine in sorted(machines.items()):
        kinds.setdefault(machine, []).append(device_id)
    phase_line("device machines: " + ", ".join(f"{machine} ({', '.join(ids)})"
                                               for machine, ids in kinds.items()))


def scenario_prompts(scenario: Scenario) -> list[str]:
    """The workload's prompts, at most workload.limit."""
    source, limit = scenario.workload.source, scenario.workload.limit
    prompts = load_workload(source)
    return list(prompts[:limit] if limit else prompts)


def make_fleet(kind: str, scenario: Scenario, folder: Path) -> Fleet:
    if kind == "compose":
        return ComposeFleet(scenario, folder)
    # An emulated server stands for a machine of its own: its steps must keep the profile's pace,
    # so the device daemons sharing this machine's cores run only when it leaves one free (64
    # devices at nice 10 overran 46% of the H100's steps; in the background, sled's 0.8%).
    return LocalFleet(scenario.served_target(), folder, server_args=scenario.server.flags,
                      prefix=PREFIX, devices_in_background=bool(scenario.server.emulate),
                      replicas=scenario.server.replicas)


def write_calibrated_traces(scenario: Scenario, references, traces_dir: Path) -> None:
    """Each calibrated pair's traces, along the target's references, into the fleet's traces
    folder, where its devices' daemons read them (lab.traces.calibrated)."""
    if references is None:
        return
    for path in write_traces([slot.drafter for slot in scenario.slots()], references.prompt_ids,
                             references.outputs, references.vocab_size, traces_dir,
                             scenario.target):
        phase_line(f"calibrated traces: {path}")


async def run_scenario(scenario: Scenario, prompts: list[str], folder: Path, kind: str,
                       beside: dict | None = None) -> int:
    """References, fleet up, every phase, fleet down, results and report; the exit status."""
    try:
        references = await greedy_references(scenario, prompts)
    except (ValueError, OSError) as exc:      # a target that cannot be loaded
        return _fail(f"the target's greedy references: {exc}", 2)
    try:
        fleet = make_fleet(kind, scenario, folder)
    except (OSError, ValueError) as exc:
        hint = (" (--fleet compose runs inside the lab container that `sled lab compose` starts)"
                if kind == "compose" else "")
        return _fail(f"cannot set up the fleet: {exc}{hint}", 2)
    results = Results(folder.name, fleet.mode, scenario)
    try:
        write_calibrated_traces(scenario, references, fleet.traces_dir)
        phase_line(f"starting the fleet: {len(scenario.slots())} devices, target "
                   f"{scenario.target}{_behind_proxy(scenario)}")
        await fleet.start(scenario.slots())
        results.link_emulation = fleet.link_emulation()
        results.device_machines = fleet.device_machines()
        machines_line(results.device_machines)
        await run_phases(fleet, scenario, prompts, outputs(references), results)
    except (FleetStartError, TimeoutError, asyncio.TimeoutError, aiomqtt.MqttError) as exc:
        return _fail(f"{exc} (logs in {folder / 'logs'})", 3)
    except Exception as exc:      # anything else a component did: one line, not a traceback
        return _fail(f"the run failed: {type(exc).__name__}: {exc} (logs in {folder / 'logs'})", 3)
    finally:
        await fleet.stop()
    results.server_power = server_power(scenario)
    results.write(folder)
    return finish(results, folder, beside)


def _behind_proxy(scenario: Scenario) -> str:
    replicas = scenario.server.replicas
    return f", {replicas} server replicas behind HAProxy" if replicas > 1 else ""


async def greedy_references(scenario: Scenario, prompts: list[str]):
    """The target's own greedy outputs, with the prompts' ids (lab.oracle.References; None
    when the scenario samples)."""
    if not scenario.sampling.greedy:
        return None
    target = scenario.served_target()
    served = served_settings(target, scenario.server.flags)   # what the server verifies with
    phase_line(f"greedy references: {len(prompts)} prompts on {scenario.target} "
               f"({served.dtype}, {served.device})")
    return await asyncio.to_thread(target_references, target, prompts, scenario.max_tokens,
                                   scenario.server.flags)


def outputs(references) -> list[list[int]] | None:
    """The reference outputs the driver checks against (None when the scenario samples)."""
    return None if references is None else references.outputs


async def run_phases(fleet: Fleet, scenario: Scenario, prompts, references, results: Results) -> None:
    """For each fleet size: sled (with the fault timeline on the largest), then centralized."""
    sizes = scenario.sizes()
    for n in sizes:
        faults = scenario.faults if n == max(sizes) else []
        await run_phase(fleet, scenario, "sled", n, prompts, references, results, faults)
        if scenario.centralized:
            await run_phase(fleet, scenario, "centralized", n, prompts, references, results, [])


async def run_phase(fleet: Fleet, scenario: Scenario, system: str, n: int, prompts, references,
                    results: Results, faults) -> None:
    """One phase: drive the first n devices while the sampler scrapes and faults happen."""
    devices = fleet.devices[:n]
    await set_mode(fleet, devices, "server" if system == "centralized" else "draft")
    progress = PhaseProgress(f"{system} x{n}", n * (scenario.requests or 0))
    sampler = scrape.Sampler(fleet.server_metrics_urls, devices)
    started = time.monotonic()
    async with sampler, progress.live():
        fault_task = asyncio.create_task(run_faults(fleet, faults, started, PREFIX))
        try:
            records = await drive.drive(fleet, scenario, devices, prompts, references, progress,
                                        system=system)
            wall_s = time.monotonic() - started          # the traffic's time, not the faults' tail
            fault_records = await fault_task
        finally:     # a failed or cancelled phase must not leave a fault step to restart a process
            fault_task.cancel()
            await asyncio.gather(fault_task, return_exceptions=True)
    results.faults += fault_records
    phase = results.add_phase(system, n, wall_s, records, sampler.server(), sampler.devices(),
                              sampler.replicas() if len(fleet.server_metrics_urls) > 1 else None)
    phase_line(_summary(phase))


async def set_mode(fleet: Fleet, devices, mode: str) -> None:
    """Switch devices live over MQTT ("draft": sled; "server": centralized) and wait for it."""
    await publish_configs(fleet, {handle.id: {"mode": mode} for handle in devices}, PREFIX)
    await asyncio.gather(*(wait_health(handle.api_url, lambda h: h.status.get("mode") == mode
                                       and h.status.get("state") == "ready",
                                       f"{handle.id} did not switch to mode {mode}", 60)
                           for handle in devices))


def _summary(phase: dict) -> str:
    t = phase_totals(phase)
    return (f"{phase['system']} x{phase['fleet_size']}: {t['requests']} requests, {t['tokens']} tokens, "
            f"{t['errors']} errors, {t['lost_tokens']} lost / {t['duplicated_tokens']} duplicated "
            f"tokens in {phase['wall_s']:.1f} s")


def server_power(scenario: Scenario) -> dict:
    """From lab.costs: the GPU's draw where nvidia-smi reads one, else the documented assumption."""
    try:
        from lab.costs import server_power as measured
    except ImportError:
        return {"source": "assumed", "watts": None}
    return measured(scenario.costs)


def finish(results: Results, folder: Path, beside: dict | None = None) -> int:
    """Write the report; 1 when any greedy output differed from the target's, 3 when a fault
    step or a request failed."""
    document = results.document()
    report = build_report(document, folder, beside)
    mismatches = greedy_mismatches(document)
    failed = [f for f in results.faults if not f["ok"]]
    phase_line(f"report: {report}")
    for fault in failed:
        phase_line(f"fault step {fault['kind']} at {fault['at_s']} s did not complete: {fault['note']}")
    errored = [r for phase in document["phases"] for r in phase["requests"]
               if r.get("error") or r.get("complete") is False]
    if mismatches:
        return _fail(f"{mismatches} greedy outputs differed from the target's (see {report})", 1)
    if failed:
        return _fail(f"{len(failed)} fault steps did not complete (see {report})", 3)
    if errored:
        return _fail(f"{len(errored)} requests failed or ended early, the first: "
                     f"{errored[0].get('error') or 'no finish reason'} (see {report})", 3)
    return 0
