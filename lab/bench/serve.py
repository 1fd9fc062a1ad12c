"""`sled bench serve`: sled against centralized serving as the number of devices grows.

One server process; for each fleet size N, N emulated devices in this process run two ways:
sled (each replays a recorded drafter trace at its device profile's drafting speed and sends
drafts for the server to verify) and centralized (the server generates every token itself,
GENERATION_MODE_SERVER). Both go through the same emulated link and the modes alternate per N,
so both see the same machine. Every output is checked against the target's greedy output.

Per (mode, N): system throughput (tokens / makespan), per-device tokens/s (p5, p50, p95; p5 is
the rate 95% of devices reach or beat), time per output token (p50, p95; a verdict's tokens
share its gap), time to first token, target forward passes per output token. Capacity: the
largest N whose p5 per-device rate is at least --target-rate.

Before the timed runs each mode runs once at every fleet size, unmeasured (WARM_UP_TOKENS a
device): the warm-up meets the steps the sweep will meet, so that what a server compiles or
captures at a step's first use (the flex engine's buckets on a GPU) is done before the clock
runs. It is reported: its seconds, and the steps over SLOW_STEP_S it took; each timed row counts
its own such steps (`slow_steps`: 0 when the warm-up met every step the row did).

With --emulate PROFILE the server holds each step to a step-cost profile's time
(verify_server.step_costs): the sweep is the fleet as the profiled GPU would serve it, while the
target here still computes every token (so every output is still checked). Each row counts the
steps that overran the profile; past 1% of them the run does not stand for that GPU. --against
REAL.json puts each row beside the same row of a run on the real server (its results file) and
gives the error per N, of the emulation and (with --simulate) of the simulator.
"""
from __future__ import annotations

import asyncio
import json
import shlex
import statistics
import time
from dataclasses import replace
from pathlib import Path

from rich.progress import Progress
from rich.table import Table

from edge_client.session import RoundSettings
from lab.bench import harness
from lab.bench.report import save_figure, short_name, subplots
from lab.fleet_metrics import FleetRun, add_ratios, summarize
from lab.profiles import device_profile, link_profile
from lab.sim.engine import HostCost
from lab.sim.simulate import trace_sweep
from lab.traces.fleet import MODES, TraceFleet
from sled.flags import positive_float, positive_int
from verify_server.step_costs import MAX_OVERRUN_SHARE, load_profile

OVERRUNS = "sled_emulated_overruns_total"
WARM_UP_TOKENS = 8      # a device's tokens in the warm-up, at every fleet size
SLOW_STEP_S = "0.5"     # a step past this (a histogram bucket's bound) compiled or captured
STEPS = "sled_forward_seconds_count"
QUICK_STEPS = f'sled_forward_seconds_bucket{{le="{SLOW_STEP_S}"}}'


def add_arguments(parser) -> None:
    harness.add_replay_flags(parser)
    parser.add_argument("--devices", default="1,4,16,64", type=harness.listed(positive_int),
                        help="comma-separated fleet sizes")
    parser.add_argument("--modes", default="sled,centralized",
                        help="which of sled,centralized to run")
    parser.add_argument("--draft-len", default="4", type=harness.one_of(positive_int, "auto"),
                        help="tokens drafted per round, or auto (the "
                        "server's suggestion from the previous verdict)")
    parser.add_argument("--device-profile", default="pi5",
                        help="pi4, pi5, orin-nano, instant, recorded (this machine's drafting "
                             "speed); NAME:draft_ms_per_token=X,round_overhead_ms=Y overrides")
    parser.add_argument("--link", default="wifi", help="loopback, ethernet, wifi, lte; "
                        "NAME:rtt_ms=X,jitter_ms=Y,bandwidth_mbps=Z overrides")
    parser.add_argument("--target-rate", type=positive_float, default=10.0,
                        help="tokens/s that 95%% of devices must reach for a fleet size to count")
    parser.add_argument("--emulate", default=None, metavar="PROFILE",
                        help="hold the server's steps to a step-cost profile's time (e.g. "
                             "h100-llama8b-hf-graph): the fleet as that GPU would serve it, the "
                             "target here still computing every token")
    parser.add_argument("--simulate", action="store_true",
                        help="with --emulate: run the same sweep again on the fleet simulator "
                             "(sled lab simulate) and print how far it is from the emulation")
    parser.add_argument("--against", default=None, metavar="REAL_JSON",
                        help="with --emulate: the results file of the same sweep on the real "
                             "server; each row's error against it (emulated and simulated)")
    harness.add_out_flag(parser, "serve")


def run(args) -> int:
    return harness.run_bench("serve", bench, args)


async def bench(args) -> int:
    console = harness.bench_console()
    (fleet_sizes, modes, device, link, emulated), model, traces = harness.replay_inputs(
        args, console, _settings)
    with harness.flag_errors():
        real = real_rows(args.against) if args.against else None
    if isinstance(args.draft_len, int) and args.draft_len > traces.max_draft_len:
        console.print(f"[yellow]--draft-len {args.draft_len} is past the traces' max_draft_len "
                      f"{traces.max_draft_len}: drafts stop at {traces.max_draft_len} tokens[/]")
    if args.emulate:
        args.server_args = f"{args.server_args} --emulate {shlex.quote(args.emulate)}"
    async with harness.serving_target(model, args, console) as served:
        with harness.server_errors():
            rows, warm = await sweep(served, traces, fleet_sizes, modes, args, device, link,
                                     console)
    info = served.info
    capacities = {mode: capacity(rows, mode, args.target_rate) for mode in modes}
    server = (f"{info.device}" if not args.emulate else
              f"{info.device} emulating {emulated.name}")
    setup = (f"{short_name(model)} on {server}, drafter {short_name(traces.drafter)}, device "
             f"{args.device_profile}, link {args.link}, draft length {args.draft_len}")
    console.print(_table(rows, setup))
    for line in warm_up_lines(warm, rows, emulated is not None):
        console.print(line, highlight=False)
    ratio = _print_capacity(console, capacities, args.target_rate, fleet_sizes[-1])
    summary = None if emulated is None else emulation_summary(emulated, rows)
    for line in emulation_lines(emulated, summary) if emulated is not None else ():
        console.print(line, highlight=False)
    simulated, agreement = await _simulated(args, console, rows, emulated, traces, fleet_sizes,
                                            modes, device, link)
    against = None if real is None else real_errors(real, rows, simulated)
    if against is not None:
        console.print(_against_table(against, emulated.name))
    harness.write_results(console, args.out, {
        "model": model, "server_device": info.device, "dtype": info.dtype, "drafter": traces.drafter,
        "traces": args.traces or "recorded", "prompts": len(traces.traces), "max_draft_len": traces.max_draft_len,
        "device_profile": args.device_profile, "link": args.link, "draft_len": args.draft_len,
        "max_new_tokens": args.max_new_tokens, "target_rate": args.target_rate,
        "capacity": {**capacities, "ratio": ratio, "largest_fleet": fleet_sizes[-1]},
        "warm_up": warm, "emulated": summary, "simulated": simulated, "agreement": agreement,
        "against": against, "results": rows}, lambda png: _plot(rows, png, setup))
    return harness.lossless_exit(console, [
        f"{r['mode']} with {r['devices']} device(s): {r['mismatches']} output(s)"
        for r in rows if r["mismatches"]])


async def _simulated(args, console, rows, emulated, traces, fleet_sizes, modes, device,
                     link) -> tuple[list[dict] | None, list[dict] | None]:
    """With --simulate: the sweep on the fleet simulator and its agreement with the emulated
    rows, printed; (None, None) without."""
    if not args.simulate:
        return None, None
    simulated, host = await asyncio.to_thread(     # its own loop, on virtual time
        simulated_beside, rows, emulated, harness.server_flags(args), traces, fleet_sizes,
        modes, device, link, RoundSettings(draft_len=args.draft_len), args.max_new_tokens)
    agreement = agreement_rows(rows, simulated)
    console.print(_agreement_table(agreement, emulated.name))
    console.print(f"this host's time a step, beside the profile's (fitted on the centralized "
                  f"rows' TPOT p50; the sled rows are out of its sample): {host}",
                  highlight=False)
    return simulated, agreement


def _settings(args) -> tuple[list[int], list[str], object, object, object]:
    """(fleet sizes, modes, device profile, link profile, the step profile the server emulates
    or None) from the flags; --draft-len becomes a number unless it is auto. ValueError names
    the bad flag."""

    fleet_sizes = sorted({int(n) for n in args.devices.split(",")})
    if not fleet_sizes or fleet_sizes[0] < 1:
        raise ValueError("--devices needs fleet sizes >= 1, e.g. 1,4,16,64")
    modes = [m for m in MODES if m in args.modes.split(",")]
    if not modes or set(args.modes.split(",")) - set(MODES):
        raise ValueError(f"--modes takes a comma-separated subset of {','.join(MODES)}")
    if args.draft_len != "auto" and not (args.draft_len.isdigit() and int(args.draft_len) >= 1):
        raise ValueError(f"--draft-len takes a number >= 1 or auto, not {args.draft_len!r}")
    args.draft_len = args.draft_len if args.draft_len == "auto" else int(args.draft_len)
    if args.simulate and not args.emulate:
        raise ValueError("--simulate needs --emulate PROFILE: the simulator holds its server to "
                         "the profile the emulation is held to")
    if args.against and not args.emulate:
        raise ValueError("--against needs --emulate PROFILE: it gives the error of a server held "
                         "to a profile against the real one")
    device = None if args.device_profile == "recorded" else device_profile(args.device_profile)
    emulated = load_profile(args.emulate) if args.emulate else None
    return fleet_sizes, modes, device, link_profile(args.link), emulated


async def run_fleet(fleet, mode: str, n: int, traces,
                    max_new_tokens: int) -> tuple[list, list[list[int]], float]:
    """N devices at once; device j serves trace j mod len(traces). Returns results, expected
    outputs and the makespan in seconds."""
    picked = [traces[j % len(traces)] for j in range(n)]
    started = time.perf_counter()
    runs = await fleet.run(picked, max_new_tokens, mode=mode)
    return [result for result, _ in runs], [want for _, want in runs], time.perf_counter() - started


def capacity(rows: list[dict], mode: str, target_rate: float) -> int:
    """The largest fleet whose 5th-percentile device still gets target_rate tokens/s (0: none)."""
    return max((r["devices"] for r in rows if r["mode"] == mode and r["device_tps_p5"] >= target_rate),
               default=0)


async def sweep(served, traces, fleet_sizes: list[int], modes: list[str], args, device, link,
                console) -> tuple[list[dict], dict]:
    """Both modes at every N, alternating which goes first, after the warm-up (warm_up):
    (the rows, the warm-up's report)."""

    cap = args.max_new_tokens
    served.check_traces(traces)
    fleet = TraceFleet(served.stub, served.fingerprint, device, link,
                       RoundSettings(draft_len=args.draft_len))
    with console.status("warming up: every mode at every fleet size, unmeasured"):
        warm = await warm_up(served, fleet, modes, fleet_sizes, traces, cap)
    rows = []
    total = sum(len(modes) * min(cap, len(traces.traces[j % len(traces.traces)].target_ids))
                for n in fleet_sizes for j in range(n))
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("devices", total=total)
        for index, n in enumerate(fleet_sizes):
            for mode in harness.rotated(modes, index):
                progress.update(task, description=f"{mode}, {n} device(s)")
                before, paced = (served.forward_passes(), _overruns(served, args),
                                 slow_steps(served)), []
                counted = replace(
                    fleet, on_tokens=lambda tokens: progress.advance(task, len(tokens)),
                    on_paced=paced.append)
                results, expected, makespan = await run_fleet(counted, mode, n, traces.traces, cap)
                passes = served.forward_passes() - before[0]
                rows.append(summarize(FleetRun(mode, n, results, expected, makespan, passes)))
                # the emulated devices' drafts that this host's loop gave back late
                rows[-1].update(paced_drafts=len(paced), late_drafts=sum(paced),
                                slow_steps=slow_steps(served) - before[2])
                if args.emulate:
                    rows[-1]["overruns"] = _overruns(served, args) - before[1]
    rows.sort(key=lambda r: (r["devices"], MODES.index(r["mode"])))
    add_ratios(rows)
    return rows, warm


async def warm_up(served, fleet, modes: list[str], fleet_sizes: list[int], traces,
                  cap: int) -> dict:
    """Every mode at every fleet size, smallest first, WARM_UP_TOKENS a device, unmeasured:
    its seconds, the steps it ran and those past SLOW_STEP_S (compiled or captured there)."""
    steps, slow, started = served.server.metric(STEPS), slow_steps(served), time.perf_counter()
    for n in fleet_sizes:
        for mode in modes:
            await run_fleet(fleet, mode, n, traces.traces, min(cap, WARM_UP_TOKENS))
    return {"seconds": round(time.perf_counter() - started, 2), "fleets": fleet_sizes,
            "modes": modes, "tokens": min(cap, WARM_UP_TOKENS),
            "steps": served.server.metric(STEPS) - steps, "slow_steps": slow_steps(served) - slow}


def slow_steps(served) -> float:
    """The server's steps so far that took over SLOW_STEP_S (its forward histogram)."""
    return served.server.metric(STEPS) - served.server.metric(QUICK_STEPS)


def warm_up_lines(warm: dict, rows: list[dict], emulated: bool = False) -> list[str]:
    """What to print of the warm-up: its seconds and slow steps, and the timed rows' own (of a
    server held to a profile, its steps last the profile's time: the rows' overruns say it)."""
    timed = sum(r["slow_steps"] for r in rows)
    line = (f"warm-up: {' and '.join(warm['modes'])} at N = "
            f"{', '.join(map(str, warm['fleets']))} ({warm['tokens']} tokens a device), "
            f"unmeasured: {warm['seconds']:.1f} s, {warm['steps']:.0f} steps")
    if emulated:
        return [f"{line} (held to the profile: a step that compiled or captured is an overrun)"]
    lines = [f"{line}, {warm['slow_steps']:.0f} over {SLOW_STEP_S} s (compiled or captured at "
             "first use)"]
    if timed:
        lines.append(f"[yellow]the timed runs took {timed:.0f} steps over {SLOW_STEP_S} s: they "
                     "met steps the warm-up did not (their rows hold some warm-up)[/]")
    else:
        lines.append(f"the timed runs took no step over {SLOW_STEP_S} s")
    return lines


def _overruns(served, args) -> float:
    """Emulated steps so far that overran the profile's time (0 without --emulate)."""
    return served.server.metric(OVERRUNS) if args.emulate else 0.0


def emulation_summary(profile, rows: list[dict]) -> dict:
    """What a reader of the results must know of an emulated server: the profile, where it
    comes from, and whether the run stands for it (overruns at most MAX_OVERRUN_SHARE)."""

    steps = sum(r["forward_passes"] for r in rows)
    overruns = sum(r.get("overruns", 0) for r in rows)
    share = overruns / steps if steps else 0.0
    return {"profile": profile.name, "provenance": profile.provenance,
            "rule": profile.to_json()["rule"], "steps": steps, "overruns": overruns,
            "overrun_share": share, "valid": share <= MAX_OVERRUN_SHARE}


def emulation_lines(profile, summary: dict) -> list[str]:
    """What to print of an emulated server: the profile, and whether the run stands for it."""
    verdict = ("within the 1% the emulation stands for" if summary["valid"] else
               "past the 1% the emulation stands for: this machine could not keep the profile's "
               "pace (a cheaper target or fewer devices), so both modes fall short of it")
    return [f"emulated server: {profile.describe()}",
            f"overruns: {summary['overruns']:.0f} of {summary['steps']:.0f} steps over the "
            f"profile's time ({summary['overrun_share']:.1%}): {verdict}"]


def _print_capacity(console, capacities: dict[str, int], target_rate: float,
                    largest: int) -> float | None:
    """One line of capacities (and their ratio, returned)."""
    ratio = capacities["sled"] / capacities["centralized"] \
        if capacities.get("sled") and capacities.get("centralized") else None
    # A capacity at the sweep's largest N is only a lower bound: the sweep stopped there.
    console.print(f"capacity (largest N whose 95% of devices get >= {target_rate:g} tok/s): "
                  + ", ".join(f"{mode} {n}{'+' if n == largest else ''}"
                              for mode, n in capacities.items())
                  + (f"; sled/centralized {ratio:.2f}x" if ratio is not None else ""), highlight=False)
    return ratio


def _table(rows: list[dict], setup: str):
    table = Table(title=f"sled vs centralized serving: {setup}", caption=(
        "sys: tokens/s of all devices; dev p5/p50/p95: per-device tokens/s; TPOT: ms per output "
        "token; passes: target forward passes per output token; late: drafts this host gave back "
        "more than 10% past the board's time"))
    columns = ("mode", "N", "sys", "vs central", "dev p5", "p50", "p95", "TPOT p95", "passes",
               "accept", "late", "lossless")
    for column in columns:
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in rows:
        ratio = r.get("throughput_vs_centralized")
        accept = r["acceptance_rate"]
        table.add_row(r["mode"], str(r["devices"]), f"{r['throughput']:.1f}",
                      f"{ratio:.2f}x" if ratio else "", f"{r['device_tps_p5']:.1f}",
                      f"{r['device_tps_p50']:.1f}", f"{r['device_tps_p95']:.1f}",
                      f"{r['tpot_ms_p95']:.1f}", f"{r['passes_per_token']:.3f}",
                      f"{accept:.0%}" if accept is not None else "-", _late(r),
                      "yes" if not r["mismatches"] else f"[red]{r['mismatches']} differ[/]")
    return table


def simulated_beside(emulated_rows: list[dict], profile, server_args, traces, fleet_sizes,
                     modes, device, link, settings, max_new_tokens) -> tuple[list[dict], HostCost]:
    """The sweep on the fleet simulator, its server charged this host's own time a step: what
    the emulated centralized steps took beyond the profile's (TPOT p50: one step a token),
    fitted as a time a step plus a time a session (least squares, neither below zero)."""
    bare = trace_sweep(profile, server_args, traces, fleet_sizes, ["centralized"], device, link,
                       settings, max_new_tokens)
    host = fit_host_cost([(r["devices"], r["tpot_ms_p50"]) for r in emulated_rows
                          if r["mode"] == "centralized"],
                         [(r["devices"], r["tpot_ms_p50"]) for r in bare])
    return trace_sweep(profile, server_args, traces, fleet_sizes, modes, device, link, settings,
                       max_new_tokens, host=host), host


def fit_host_cost(measured: list[tuple[int, float]], bare: list[tuple[int, float]]) -> HostCost:
    """Per N, the measured step time less the profile's alone, as step_ms + row_ms * N.
    Example: [(1, 14.3), (4, 15.7)] against [(1, 13.1), (4, 13.9)] -> 1.0 ms + 0.2 ms a row."""
    gaps = {n: ms for n, ms in measured}
    points = [(n, gaps[n] - ms) for n, ms in bare if n in gaps]
    if not points:
        return HostCost()
    if len({n for n, _ in points}) == 1:
        return HostCost(max(0.0, statistics.fmean(gap for _, gap in points)), 0.0)
    n_mean = statistics.fmean(n for n, _ in points)
    gap_mean = statistics.fmean(gap for _, gap in points)
    slope = sum((n - n_mean) * (gap - gap_mean) for n, gap in points) / \
        sum((n - n_mean) ** 2 for n, _ in points)
    slope = max(0.0, slope)
    return HostCost(max(0.0, gap_mean - slope * n_mean), slope)


def agreement_rows(emulated: list[dict], simulated: list[dict]) -> list[dict]:
    """Per (mode, N): system throughput and p95 TPOT of the emulation and of the simulation,
    and the simulation's error against the emulation (0.05: 5% high)."""
    simulated_at = {(r["mode"], r["devices"]): r for r in simulated}
    rows = []
    for real in emulated:
        sim = simulated_at[(real["mode"], real["devices"])]
        rows.append({"mode": real["mode"], "devices": real["devices"],
                     "throughput": [real["throughput"], sim["throughput"]],
                     "throughput_error": sim["throughput"] / real["throughput"] - 1,
                     "tpot_ms_p95": [real["tpot_ms_p95"], sim["tpot_ms_p95"]],
                     "tpot_error": sim["tpot_ms_p95"] / real["tpot_ms_p95"] - 1
                     if real["tpot_ms_p95"] else 0.0,
                     "overruns": real.get("overruns", 0)})
    return rows


def real_rows(path: str) -> list[dict]:
    """The rows of a `sled bench serve` results file (--against); ValueError in one line when
    it is not one."""
    try:
        rows = json.loads(Path(path).read_text())["results"]
        return [r for r in rows if {"mode", "devices", "throughput", "tpot_ms_p95"} <= set(r)]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--against {path}: not a `sled bench serve` results file "
                         f"({type(exc).__name__}: {exc})") from None


def real_errors(real: list[dict], emulated: list[dict],
                simulated: list[dict] | None) -> list[dict]:
    """Per (mode, N) the real run measured: its system throughput and p95 TPOT beside the
    emulation's and the simulation's (where they ran that N), each one's error against the
    real server (0.05: 5% high)."""
    beside = {"emulated": {(r["mode"], r["devices"]): r for r in emulated},
              "simulated": {(r["mode"], r["devices"]): r for r in simulated or ()}}
    rows = []
    for measured in real:
        key = (measured["mode"], measured["devices"])
        row = {"mode": key[0], "devices": key[1], "throughput": {"real": measured["throughput"]},
               "tpot_ms_p95": {"real": measured["tpot_ms_p95"]}}
        for name, rows_of in beside.items():
            other = rows_of.get(key)
            if other is None:
                continue
            for metric in ("throughput", "tpot_ms_p95"):
                row[metric][name] = other[metric]
                row[f"{metric}_error_{name}"] = _error(other[metric], measured[metric])
        rows.append(row)
    return rows


def _error(value: float, real: float) -> float | None:
    return value / real - 1 if real else None


def _against_table(rows: list[dict], profile: str):
    table = Table(title=f"the emulation of {profile} and the simulator against the real server",
                  caption="error: emulated (or simulated) / real - 1")
    for column in ("mode", "N", "sys real", "emulated", "error", "simulated", "error",
                   "TPOT p95 real", "emulated", "error", "simulated", "error"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in rows:
        cells = [r["mode"], str(r["devices"])]
        for metric, fmt in (("throughput", ".1f"), ("tpot_ms_p95", ".1f")):
            cells.append(f"{r[metric]['real']:{fmt}}")
            for name in ("emulated", "simulated"):
                error = r.get(f"{metric}_error_{name}")
                cells += ([f"{r[metric][name]:{fmt}}", f"{error:+.1%}" if error is not None
                           else "-"] if name in r[metric] else ["-", "-"])
        table.add_row(*cells)
    return table


def _agreement_table(rows: list[dict], profile: str):
    table = Table(title=f"the fleet simulator against the real-time emulation of {profile}",
                  caption="error: simulated / emulated - 1; overruns: emulated steps this "
                          "machine could not hold to the profile (the emulation stands without)")
    for column in ("mode", "N", "sys emulated", "simulated", "error", "TPOT p95 emulated",
                   "simulated", "error", "overruns"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in rows:
        table.add_row(r["mode"], str(r["devices"]), f"{r['throughput'][0]:.1f}",
                      f"{r['throughput'][1]:.1f}", f"{r['throughput_error']:+.1%}",
                      f"{r['tpot_ms_p95'][0]:.1f}", f"{r['tpot_ms_p95'][1]:.1f}",
                      f"{r['tpot_error']:+.1%}", f"{r['overruns']:.0f}")
    return table


def _late(row: dict) -> str:
    """The share of a row's paced drafts this host gave back late ("-" without drafts)."""
    paced = row.get("paced_drafts")
    return f"{row['late_drafts'] / paced:.0%}" if paced else "-"


def _plot(rows: list[dict], path, title: str) -> None:
    fig, (left, right) = subplots(2)
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        sizes = [r["devices"] for r in mine]
        left.plot(sizes, [r["throughput"] for r in mine], marker="o", label=mode)
        right.plot(sizes, [r["tpot_ms_p95"] for r in mine], marker="o", label=mode)
    left.set(xlabel="devices", ylabel="tokens/s (all devices)", title="system throughput")
    right.set(xlabel="devices", ylabel="ms", title="time per output token, p95")
    sizes = sorted({r["devices"] for r in rows})
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(sizes, [str(n) for n in sizes])
    save_figure(fig, (left, right), path, title)
