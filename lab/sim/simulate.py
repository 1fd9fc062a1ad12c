"""`sled lab simulate SCENARIO`: a scenario's fleet on simulated time, sled against centralized
serving, for fleets of 1 to thousands of devices in seconds.

The server is sled's own service, core and scheduler (lab.sim.server) held to a step-cost
profile (the scenario's server.emulate, or --profile), its KV cache the profiled GPU's memory;
the devices are sled's own device sessions drafting from the scenario's calibrated pairs at
their boards' speed over their links (lab.sim.fleet). Everything runs on a virtual clock
(lab.sim.loop): a run is deterministic under --seed and takes the time its Python takes.

Per (mode, N), as `sled bench serve` reports them: system throughput, per-device tokens/s,
time per output token, time to first token (admission waits included); and what a buyer asks
besides: the share of the time the GPU was busy, GPU-seconds and energy (at the board's power)
per 1k tokens, and the sessions the KV cache refused for a while. Capacity: the largest N
whose p5 device meets the SLO's tokens/s and whose p95 time to first token meets its ttft_s.

    sled lab simulate fleet-h100 --fleet-sizes 1,16,64,256 --context 2048

Exit status: 0 ok, 1 an output differed from its script (the server decided a round wrong),
2 a bad flag, scenario or profile.
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path

from rich.progress import Progress
from rich.table import Table

from edge_client.session import RoundSettings
from lab.bench.harness import bench_console, rotated
from lab.bench.report import percentile, save_figure, subplots
from lab.fleet_metrics import FleetRun, add_ratios, summarize
from lab.profiles import device_profile, link_profile
from lab.scenario import Scenario, ScenarioError, load_scenario
from lab.sim.engine import ACCEPTANCE, DRAFTS, HEAD_COST, HostCost, SelfDraft
from lab.sim.fleet import SimDevice, SimRequest, run_fleet
from lab.sim.loop import simulate
from lab.sim.server import SimulatedServer, simulated_server
from lab.traces.calibrated import MAX_K, SEED, is_calibrated, load_calibration
from lab.traces.format import Trace, TraceSet
from lab.traces.synthetic import SyntheticDrafter, synthetic_trace_set
from sled import clock
from sled.flags import one_line, positive_int
from verify_server.flags import served_settings
from verify_server.gpu_memory import describe as describe_memory
from verify_server.gpu_memory import gpu_memory
from verify_server.step_costs import StepProfile, load_profile

MODES = ("sled", "centralized", "centralized-spec", "adaptive")
SELF_DRAFTING = ("centralized-spec", "adaptive")    # servers with a draft head of their own
SPEC_OFF_ABOVE = 32      # TensorRT-LLM's example schedule switches speculation off at batch 33+
VOCAB = 32000            # the scripts' token ids: any vocabulary does, nothing is decoded
MAX_FLEET = 4096
LOOPBACK = "127.0.0.1"


def add_arguments(parser) -> None:
    parser.add_argument("scenario", help="a built-in scenario name or a YAML file")
    parser.add_argument("--profile", default=None, help="the step-cost profile both modes are "
                        "held to (default: the scenario's server.emulate)")
    parser.add_argument("--centralized-profile", default=None, help="hold centralized serving "
                        "to another profile (default: the same as sled)")
    parser.add_argument("--prefill-profile", default=None, help="charge every mode's prefill "
                        "chunks as this profile charges them (prefill is the same work in every "
                        "mode: e.g. a published engine's, where sled's own profile measured none)")
    parser.add_argument("--fleet-sizes", default=None, help="comma-separated fleet sizes up to "
                        f"{MAX_FLEET} (default: the scenario's); past the scenario's fleet its "
                        "devices repeat in order")
    parser.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="TOKENS",
                        help="every request's answer this many tokens (default: the scenario's "
                        "max_tokens)")
    parser.add_argument("--context", type=int, default=None, metavar="TOKENS",
                        help="every prompt this many tokens (default: the workload's prompts, "
                        "as the target's tokenizer counts them)")
    parser.add_argument("--modes", default="sled,centralized", help="which of " + ",".join(MODES)
                        + " (centralized-spec: the server drafts for itself with an EAGLE-class "
                        "head, on centralized's profile; adaptive: sled's server with that head "
                        "and --placement latency, moving sessions between the devices' drafts "
                        "and its own as its load changes)")
    parser.add_argument("--spec-acceptance", type=float, default=ACCEPTANCE, metavar="A",
                        help="centralized-spec: the chance each of the head's guesses is the "
                        f"target's token (default {ACCEPTANCE}: EAGLE-3's published 1.65x at "
                        "batch 1 with K=2)")
    parser.add_argument("--spec-head-cost", type=float, default=HEAD_COST, metavar="SHARE",
                        help="centralized-spec: a head pass's time, as a share of a one-token "
                        f"decode step of the same rows (default {HEAD_COST})")
    parser.add_argument("--spec-drafts", type=int, default=DRAFTS, metavar="K",
                        help=f"centralized-spec: the head's guesses per pass (default {DRAFTS})")
    parser.add_argument("--spec-off-above", type=int, default=SPEC_OFF_ABOVE, metavar="N",
                        help="centralized-spec: the server's --sat-off-above, past which its "
                        f"sessions decode plainly (default {SPEC_OFF_ABOVE}; 0: never off)")
    parser.add_argument("--draft-len", type=int, default=4, help="tokens per draft")
    parser.add_argument("--seed", type=int, default=0, help="the links' jitter and the scripts")
    parser.add_argument("--host-cost", default="0,0", metavar="STEP_MS,ROW_MS",
                        help="the server host's own time a step and a session in it, beside the "
                             "profile's GPU time, in both modes (default none: a host that keeps "
                             "up; `sled bench serve --emulate P --simulate` measures this one's)")
    parser.add_argument("--refine", type=int, default=2, help="halvings of the gap between each "
                        "mode's capacity and the next size of the sweep (a run each)")
    parser.add_argument("--out", default=None, help="results folder (default: "
                        "lab-results/simulate-NAME-TIME)")


def run(args) -> int:
    console = bench_console()
    try:
        plan = _plan(args)
    except (ScenarioError, ValueError, OSError) as exc:
        print(f"sled lab simulate: {one_line(exc)}", file=sys.stderr)
        return 2
    scenario, profiles, sizes, modes = plan
    prompts = _prompts(scenario, args)
    traces = _traces(scenario, prompts, args.seed)
    started = time.perf_counter()
    rows = sweep(scenario, profiles, sizes, modes, traces, args, console)
    wall = time.perf_counter() - started
    report = _report(scenario, profiles, rows, args, wall, prompts)
    console.print(_table(rows, report["setup"]))
    for line in report["lines"]:
        console.print(line, highlight=False)
    out = Path(args.out or f"lab-results/simulate-{scenario.name}-"
               f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({**report, "results": rows}, indent=1))
    _plot(rows, out / "simulate.png", report["setup"])
    console.print(f"wrote {out / 'results.json'} and {out / 'simulate.png'}")
    lossy = [r for r in rows if r["mismatches"]]
    for r in lossy:
        console.print(f"[red]{r['mode']} with {r['devices']} devices: {r['mismatches']} "
                      "output(s) differ from their scripts[/]")
    return 1 if lossy else 0


# --- what to run ------------------------------------------------------------------------------

def _plan(args) -> tuple[Scenario, dict[str, StepProfile], list[int], list[str]]:
    """The scenario, each mode's profile, the fleet sizes and the modes; ValueError (one line)
    for what the simulator cannot run."""
    scenario = load_scenario(args.scenario)
    if args.max_new_tokens:
        scenario = scenario.model_copy(update={"max_tokens": args.max_new_tokens})
    name = args.profile or scenario.server.emulate
    if not name:
        raise ValueError(f"scenario {scenario.name} names no step-cost profile (server.emulate): "
                         "give --profile NAME or FILE")
    profiles = {"sled": load_profile(name),
                "centralized": load_profile(args.centralized_profile or name)}
    if args.prefill_profile:    # prefill is the same work whichever mode serves a session
        prefill = load_profile(args.prefill_profile)
        profiles = {mode: profile.with_prefill_of(prefill) for mode, profile in profiles.items()}
    for profile in profiles.values():
        gpu_memory(profile).kv_tokens()      # a profile whose weights leave no KV says so now
    unsupported = [g.drafter for g in scenario.fleet if not is_calibrated(g.drafter)]
    if unsupported:
        raise ValueError(f"fleet: the simulator drafts with calibrated pairs only "
                         f"(calibrated:NAME), not {unsupported[0]!r}")
    if scenario.arrivals.mode == "closed" and scenario.requests is None:
        raise ValueError("the simulator runs closed arrivals for a number of requests per device "
                         "(requests: N), or poisson arrivals for duration_s")
    if scenario.faults:
        raise ValueError("the simulator runs no faults: use sled lab run for a fault timeline")
    sizes = _sizes(args.fleet_sizes, scenario)
    modes = [m for m in MODES if m in args.modes.split(",")]
    if not modes or set(args.modes.split(",")) - set(MODES):
        raise ValueError(f"--modes takes a comma-separated subset of {','.join(MODES)}")
    if args.context is not None and args.context < 2:
        raise ValueError("--context needs at least 2 tokens")
    if args.draft_len < 1:
        raise ValueError("--draft-len needs at least 1 token")
    if "centralized-spec" in modes:
        profiles["centralized-spec"] = profiles["centralized"]
    if "adaptive" in modes:       # sled's server, moving sessions as its load changes
        profiles["adaptive"] = profiles["sled"]
    if set(SELF_DRAFTING) & set(modes):
        args.drafts = self_draft(args)
    args.host = host_cost(args.host_cost)
    served_settings("simulated", scenario.server.args)   # flags sled serve would refuse stop here
    return scenario, profiles, sizes, modes


def self_draft(args) -> SelfDraft:
    """The centralized-spec mode's draft head from its flags; ValueError naming them."""
    if args.spec_off_above < 0:
        raise ValueError("--spec-off-above takes a number of sessions >= 0")
    try:
        return SelfDraft(args.spec_acceptance, args.spec_head_cost, args.spec_drafts, args.seed)
    except ValueError as exc:
        raise ValueError(f"--spec-acceptance, --spec-head-cost, --spec-drafts: {exc}") from None


def mode_settings(server_args: Sequence[str], mode: str, args):
    """The server's settings in a mode: the scenario's flags, centralized-spec's and adaptive's
    --sat-off-above, and adaptive's --placement latency."""
    extra = ["--sat-off-above", str(args.spec_off_above)] \
        if mode in SELF_DRAFTING else []
    if mode == "adaptive":
        extra += ["--placement", "latency"]
    return served_settings("simulated", [*server_args, *extra])


def host_cost(spec: str) -> HostCost:
    """--host-cost STEP_MS,ROW_MS; ValueError naming the flag."""
    try:
        step, row = (float(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"--host-cost takes STEP_MS,ROW_MS, e.g. 0.9,0.16, not {spec!r}") from None
    if step < 0 or row < 0 or not math.isfinite(step + row):
        raise ValueError(f"--host-cost: times must be finite and >= 0, not {spec!r}")
    return HostCost(step, row)


def _sizes(spec: str | None, scenario: Scenario) -> list[int]:
    if spec is None:
        return scenario.sizes()
    try:
        sizes = sorted({int(n) for n in spec.split(",")})
    except ValueError:
        raise ValueError(f"--fleet-sizes takes comma-separated numbers, not {spec!r}") from None
    if not sizes or sizes[0] < 1 or sizes[-1] > MAX_FLEET:
        raise ValueError(f"--fleet-sizes: each size within 1..{MAX_FLEET}")
    return sizes


def _prompts(scenario: Scenario, args) -> list[list[int]]:
    """The workload's prompts as token ids: the target's tokenizer's, or --context random ids
    (one prompt per workload prompt either way, so devices share them as the lab's do)."""
    from lab.workload import prompt_texts
    texts = prompt_texts(scenario.workload.source, scenario.workload.limit)
    if args.context is None:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(scenario.served_target())
        return [tokenizer(text)["input_ids"] for text in texts]
    draw = random.Random(f"prompts-{args.seed}")
    return [[draw.randrange(VOCAB) for _ in range(args.context)] for _ in texts]


def vocabulary(id_lists: Iterable[Sequence[int]], floor: int = 0) -> int:
    """The simulated target's vocabulary: every id of the lists, and at least `floor` (the
    scripts' VOCAB: a tokenizer's prompt ids may pass it)."""
    return max([floor, *(1 + max(ids) for ids in id_lists if ids)])


def trace_ids(traces: Iterable[Trace]) -> Iterator[Sequence[int]]:
    """Every list of ids the traces hold: prompts, target outputs, proposals."""
    for trace in traces:
        yield trace.prompt_ids
        yield trace.target_ids
        yield from trace.proposals


def _traces(scenario: Scenario, prompts: list[list[int]], seed: int) -> dict[str, list[Trace]]:
    """Per calibrated pair, one trace per prompt along that prompt's script (a random output
    of max_tokens, the same for every pair), drafted with the pair's acceptance."""
    draw, vocab = random.Random(f"scripts-{seed}"), vocabulary(prompts, VOCAB)
    outputs = [[draw.randrange(VOCAB) for _ in range(scenario.max_tokens)] for _ in prompts]
    traces = {}
    for spec in sorted({group.drafter for group in scenario.fleet}):
        pair = load_calibration(spec)
        drafter = SyntheticDrafter(pair.acceptance, MAX_K, SEED + seed, spec)
        traces[spec] = synthetic_trace_set(prompts, outputs, drafter, vocab, "simulated",
                                           None).traces
    return traces


# --- the sweep --------------------------------------------------------------------------------

def sweep(scenario: Scenario, profiles: dict[str, StepProfile], sizes: list[int], modes: list[str],
          traces: dict[str, list[Trace]], args, console) -> list[dict]:
    """Both modes at every size, then each mode's capacity narrowed by --refine halvings of the
    gap between the largest size that met the SLO and the next (those rows are that mode's
    only: `refined`)."""
    slots = scenario.slots()
    total = sum(len(arrivals(scenario, j, args.seed)) * scenario.max_tokens
                for n in sizes for j in range(n)) * len(modes)
    every = [t for ts in traces.values() for t in ts]
    scripts = {tuple(t.prompt_ids[:-1]): t.target_ids for t in every}
    vocab = vocabulary(trace_ids(every), VOCAB)
    settings = {mode: mode_settings(scenario.server.args, mode, args) for mode in modes}
    count = len(next(iter(traces.values())))

    def requests_of(j: int) -> list[tuple[float | None, Trace]]:
        mine = traces[slots[j % len(slots)].drafter]
        return [(at, mine[(j * 7919 + r) % count])
                for r, at in enumerate(arrivals(scenario, j, args.seed))]

    async def fleet(mode: str, n: int, on_tokens) -> dict:
        """One fleet in one mode on a fresh simulated server: its row."""
        server = simulated_server(profiles[mode], settings[mode], scripts, vocab, host=args.host,
                                  drafts=args.drafts if mode in SELF_DRAFTING else None)
        devices = [_device(slots[j % len(slots)], j) for j in range(n)]
        row = await measured(server, scenario, profiles[mode], mode, devices, requests_of,
                             RoundSettings(draft_len=args.draft_len), scenario.max_tokens,
                             args.seed, on_tokens)
        await server.stop()
        return row

    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("simulating", total=total)

        def phase(mode: str, n: int) -> dict:
            progress.update(task, description=f"{mode}, {n} device(s)")
            return simulate(fleet(mode, n, lambda t: progress.advance(task, len(t))))

        rows += [phase(mode, n) for n in sizes for mode in modes]
        for mode in modes:
            rows += refine(rows, mode, args.refine, lambda n: phase(mode, n))
    rows.sort(key=lambda r: (r["devices"], MODES.index(r["mode"])))
    add_ratios(rows)
    return rows


def refine(rows: list[dict], mode: str, steps: int, run) -> list[dict]:
    """Halve the gap between the mode's capacity and the next size that missed the SLO, `steps`
    times, running run(n) at each midpoint; the new rows, marked refined."""
    mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["devices"])
    met = capacity(mine, mode)
    missed = [r["devices"] for r in mine if r["devices"] > met and not r["meets_slo"]]
    if not met or not missed:
        return []
    low, high, found = met, missed[0], []
    for _ in range(steps):
        middle = (low + high) // 2
        if middle in (low, high):
            break
        row = run(middle)
        row["refined"] = True
        found.append(row)
        low, high = (middle, high) if row["meets_slo"] else (low, middle)
    return found


def arrivals(scenario: Scenario, j: int, seed: int) -> list[float | None]:
    """When device j's requests come, in seconds from the start: closed arrivals (None: each as
    soon as the one before is over), or a Poisson process of arrivals.rate_per_s for
    duration_s, seeded per device."""
    if scenario.arrivals.mode == "closed":
        return [None] * scenario.requests
    draw, at, times = random.Random(f"arrivals-{seed}-{j}"), 0.0, []
    while (at := at + draw.expovariate(scenario.arrivals.rate_per_s)) < scenario.duration_s:
        times.append(at)
    return times or [scenario.duration_s * draw.random()]   # every device asks at least once


def _device(slot, j: int) -> SimDevice:
    return SimDevice(j, device_profile(slot.device), link_profile(slot.link))


async def measured(server: SimulatedServer, scenario: Scenario | None, profile: StepProfile,
                   mode: str, devices: Sequence[SimDevice], requests_of, settings: RoundSettings,
                   max_new_tokens: int, seed: int, on_tokens=None) -> dict:
    """One fleet in one mode on `server` (which may have served fleets before: what they spent
    is not this one's): its row."""
    started, busy, passes = clock.now(), server.busy_seconds(), server.forward_passes()
    done = await run_fleet(server, devices, requests_of, mode, settings, max_new_tokens, seed,
                           on_tokens)
    return _row(scenario, profile, mode, len(devices), done, clock.now() - started,
                server.busy_seconds() - busy, server.forward_passes() - passes)


def trace_sweep(profile: StepProfile, server_args: Sequence[str], traces: TraceSet,
                fleet_sizes: Sequence[int], modes: Sequence[str], board, link,
                settings: RoundSettings, max_new_tokens: int, seed: int = 0,
                host: HostCost = HostCost()) -> list[dict]:
    """`sled bench serve`'s sweep on simulated time, as the bench runs it: one server for the
    whole sweep (its prefix cache keeps what earlier fleets published), an unmeasured warm-up of
    each mode first, the modes' order rotating per fleet size. Device j replays traces[j mod
    len] (one request); every device is on the same board and link and on one host (as the
    bench's devices share this one: one tenant of the prefix cache); the server is held to
    `profile` with the same flags. Rows as summarize() makes them, with the buyer's columns."""
    fingerprint, traces = traces.tokenizer_fingerprint, traces.traces
    scripts = {tuple(t.prompt_ids[:-1]): t.target_ids for t in traces}
    server_settings = served_settings("simulated", list(server_args))
    vocab = vocabulary(trace_ids(traces))      # every id the traces hold is in the vocabulary

    async def phase(server, mode: str, n: int, cap: int) -> dict:
        return await measured(server, None, profile, mode,
                              [SimDevice(j, board, link, LOOPBACK) for j in range(n)],
                              lambda j: [(None, traces[j % len(traces)])], settings, cap, seed)

    async def sweep_all() -> list[dict]:
        server = simulated_server(profile, server_settings, scripts, vocab,
                                  fingerprint=fingerprint, host=host)
        for mode in modes:                                       # the bench's warm-up
            await phase(server, mode, 1, min(max_new_tokens, 4))
        rows = [await phase(server, mode, n, max_new_tokens)
                for index, n in enumerate(fleet_sizes) for mode in rotated(modes, index)]
        await server.stop()
        return rows

    rows = simulate(sweep_all())
    rows.sort(key=lambda r: (r["devices"], MODES.index(r["mode"])))
    add_ratios(rows)
    return rows


def _row(scenario: Scenario | None, profile: StepProfile, mode: str, n: int,
         done: list[SimRequest], makespan: float, busy: float, passes: float) -> dict:
    row = summarize(FleetRun(mode, n, [r.result for r in done], [r.expected for r in done],
                             makespan, passes))
    watts = gpu_memory(profile).tdp_watts
    kilo = row["tokens"] / 1e3 or math.nan        # a fleet that got no token: no rate per token
    row.update(
        profile=profile.name, gpu_busy_share=busy / makespan if makespan else 0.0,
        gpu_s_per_1k=busy / kilo, gpu_wall_s_per_1k=makespan / kilo,
        energy_j_per_1k=busy * watts / kilo if watts else None,
        refused=sum(r.refusals for r in done), requests=len(done),
        admission_wait_p95_ms=percentile([r.waited_s * 1e3 for r in done], 95),
        meets_slo=scenario is not None and row["device_tps_p5"] >= scenario.slo.tokens_per_s
        and row["ttft_ms_p95"] <= scenario.slo.ttft_s * 1e3)
    return row


def capacities(run: dict) -> tuple[str, str, str]:
    """(sled, centralized, ratio) of a run's results as said: a capacity at the run's largest
    fleet is a lower bound (+), and so is a ratio whose sled side is one."""
    largest = max(r["devices"] for r in run["results"])
    cap = run["capacity"]
    said = {m: f"{cap.get(m) or 0}{'+' if cap.get(m) == largest else ''}"
            for m in ("sled", "centralized")}
    ratio = cap.get("ratio")
    bound = cap.get("sled") == largest and cap.get("centralized") != largest
    return said["sled"], said["centralized"], \
        f"{ratio:.2f}x{' or more' if bound else ''}" if ratio else "-"


def capacity(rows: list[dict], mode: str) -> int:
    """The largest N of the sweep that meets the SLO in this mode (0: none)."""
    return max((r["devices"] for r in rows if r["mode"] == mode and r["meets_slo"]), default=0)


# --- what it says -----------------------------------------------------------------------------

def _report(scenario: Scenario, profiles: dict[str, StepProfile], rows: list[dict], args,
            wall: float, prompts: list[list[int]]) -> dict:
    context = args.context or round(sum(map(len, prompts)) / len(prompts))
    same = profiles["sled"].name == profiles["centralized"].name
    held = (f"both held to {profiles['sled'].title}" if same else
            f"sled held to {profiles['sled'].title}, centralized to "
            f"{profiles['centralized'].title}")
    setup = (f"{scenario.name} simulated: {held}; prompts {context} tokens"
             f"{'' if args.context else ' (mean)'}, {scenario.max_tokens} new, "
             f"{_arrivals_said(scenario)}, draft length {args.draft_len}")
    found = {mode: capacity(rows, mode) for mode in dict.fromkeys(r["mode"] for r in rows)}
    ratio = (found["sled"] / found["centralized"]
             if found.get("sled") and found.get("centralized") else None)
    sled, central, said = capacities({"results": rows, "capacity": {**found, "ratio": ratio}})
    lines = [f"{mode}: {describe_memory(profile, gpu_memory(profile))}"
             for mode, profile in profiles.items()]
    lines.append(
        f"capacity at the SLO (p5 device >= {scenario.slo.tokens_per_s:g} tok/s, TTFT p95 <= "
        f"{scenario.slo.ttft_s:g} s): "
        + ", ".join(f"{mode} {({'sled': sled, 'centralized': central}).get(mode, found[mode])}"
                    for mode in found)
        + (f"; sled/centralized {said}" if ratio else ""))
    if "centralized-spec" in profiles:
        lines.append(f"centralized-spec: {_spec_said(args)}")
    if "adaptive" in profiles:
        lines.append(f"adaptive: sled's server with --placement latency and {_spec_said(args)}")
    lines.append(f"the server host's own time: {args.host}")
    lines.append(f"simulated in {wall:.1f} s (seed {args.seed})")
    return {"scenario": scenario.name, "setup": setup, "lines": lines, "seed": args.seed,
            "profiles": {mode: p.name for mode, p in profiles.items()},
            "context_tokens": context, "max_tokens": scenario.max_tokens,
            "capacity": {**found, "ratio": ratio},
            "host_cost": {"step_ms": args.host.step_ms, "row_ms": args.host.row_ms},
            "slo": scenario.slo.model_dump(), "wall_s": wall}


def _spec_said(args) -> str:
    drafts = args.drafts
    off = f"off above {args.spec_off_above} sessions" if args.spec_off_above else "never off"
    return (f"a draft head guessing {drafts.slots} token(s) a pass, each right with chance "
            f"{drafts.acceptance:g} ({drafts.tokens_per_pass():.2f} tokens a pass), a head pass "
            f"{drafts.head_cost:g} of a decode step; {off}")


def _arrivals_said(scenario: Scenario) -> str:
    if scenario.arrivals.mode == "closed":
        return f"{scenario.requests} request(s) per device one after another"
    return (f"Poisson arrivals of {scenario.arrivals.rate_per_s:g}/s per device for "
            f"{scenario.duration_s:g} s")


def _table(rows: list[dict], setup: str) -> Table:
    table = Table(title=setup, caption=(
        "sys: tokens/s of all devices; dev p5: tokens/s 95% of devices beat; TTFT p95 includes "
        "waits for KV; busy: the GPU's share of the time in steps; GPU s/1k: GPU-seconds in "
        "steps per 1k tokens; served: the share of tokens the server produced itself; refused: "
        "sessions the KV cache turned away for a while"))
    for column in ("mode", "N", "sys", "vs central", "dev p5", "TPOT p95", "TTFT p95", "busy",
                   "GPU s/1k", "J/1k", "served", "refused", "SLO"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in rows:
        ratio = r.get("throughput_vs_centralized")
        energy = r["energy_j_per_1k"]
        table.add_row(r["mode"], str(r["devices"]), f"{r['throughput']:.0f}",
                      f"{ratio:.2f}x" if ratio else "", f"{r['device_tps_p5']:.1f}",
                      f"{r['tpot_ms_p95']:.0f}", f"{r['ttft_ms_p95']:.0f}",
                      f"{r['gpu_busy_share']:.0%}", f"{r['gpu_s_per_1k']:.2f}",
                      f"{energy:.0f}" if energy is not None else "-",
                      f"{r.get('served_share', 0.0):.0%}", str(r["refused"]),
                      "yes" if r["meets_slo"] else "no")
    return table


def _plot(rows: list[dict], path: Path, title: str) -> None:
    fig, (left, right) = subplots(2)
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        sizes = [r["devices"] for r in mine]
        left.plot(sizes, [r["device_tps_p5"] for r in mine], marker="o",
                  label=f"{mode} ({mine[0]['profile']})")
        right.plot(sizes, [r["gpu_s_per_1k"] for r in mine], marker="o", label=mode)
    left.set(xlabel="devices", ylabel="tokens/s", title="p5 device tokens/s")
    right.set(xlabel="devices", ylabel="GPU-seconds", title="GPU-seconds per 1k tokens")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
    save_figure(fig, (left, right), path, title)
