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

With --emulate PROFILE the server holds each step to a step-cost profile's time
(verify_server.step_costs): the sweep is the fleet as the profiled GPU would serve it, while the
target here still computes every token (so every output is still checked). Each row counts the
steps that overran the profile; past 1% of them the run does not stand for that GPU.
"""
from __future__ import annotations

import shlex
import statistics
import time
from dataclasses import dataclass, replace

from rich.progress import Progress
from rich.table import Table

from edge_client.session import RoundSettings
from lab.bench import harness
from lab.bench.report import percentile, save_figure, short_name, subplots
from lab.profiles import device_profile, link_profile
from lab.traces.fleet import MODES, TraceFleet
from sled.flags import positive_float, positive_int
from verify_server.step_costs import MAX_OVERRUN_SHARE, load_profile

OVERRUNS = "sled_emulated_overruns_total"


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
    harness.add_out_flag(parser, "serve")


def run(args) -> int:
    return harness.run_bench("serve", bench, args)


async def bench(args) -> int:
    console = harness.bench_console()
    (fleet_sizes, modes, device, link, emulated), model, traces = harness.replay_inputs(
        args, console, _settings)
    if isinstance(args.draft_len, int) and args.draft_len > traces.max_draft_len:
        console.print(f"[yellow]--draft-len {args.draft_len} is past the traces' max_draft_len "
                      f"{traces.max_draft_len}: drafts stop at {traces.max_draft_len} tokens[/]")
    if args.emulate:
        args.server_args = f"{args.server_args} --emulate {shlex.quote(args.emulate)}"
    async with harness.serving_target(model, args, console) as served:
        with harness.server_errors():
            rows = await sweep(served, traces, fleet_sizes, modes, args, device, link, console)
    info = served.info
    capacities = {mode: capacity(rows, mode, args.target_rate) for mode in modes}
    server = (f"{info.device}" if not args.emulate else
              f"{info.device} emulating {emulated.name}")
    setup = (f"{short_name(model)} on {server}, drafter {short_name(traces.drafter)}, device "
             f"{args.device_profile}, link {args.link}, draft length {args.draft_len}")
    console.print(_table(rows, setup))
    ratio = _print_capacity(console, capacities, args.target_rate, fleet_sizes[-1])
    summary = None if emulated is None else emulation_summary(emulated, rows)
    for line in emulation_lines(emulated, summary) if emulated is not None else ():
        console.print(line, highlight=False)
    harness.write_results(console, args.out, {
        "model": model, "server_device": info.device, "dtype": info.dtype, "drafter": traces.drafter,
        "traces": args.traces or "recorded", "prompts": len(traces.traces), "max_draft_len": traces.max_draft_len,
        "device_profile": args.device_profile, "link": args.link, "draft_len": args.draft_len,
        "max_new_tokens": args.max_new_tokens, "target_rate": args.target_rate,
        "capacity": {**capacities, "ratio": ratio, "largest_fleet": fleet_sizes[-1]},
        "emulated": summary,
        "results": rows}, lambda png: _plot(rows, png, setup))
    return harness.lossless_exit(console, [
        f"{r['mode']} with {r['devices']} device(s): {r['mismatches']} output(s)"
        for r in rows if r["mismatches"]])


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
    device = None if args.device_profile == "recorded" else device_profile(args.device_profile)
    emulated = load_profile(args.emulate) if args.emulate else None
    return fleet_sizes, modes, device, link_profile(args.link), emulated


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


async def run_fleet(fleet, mode: str, n: int, traces,
                    max_new_tokens: int) -> tuple[list, list[list[int]], float]:
    """N devices at once; device j serves trace j mod len(traces). Returns results, expected
    outputs and the makespan in seconds."""
    picked = [traces[j % len(traces)] for j in range(n)]
    started = time.perf_counter()
    runs = await fleet.run(picked, max_new_tokens, mode=mode)
    return [result for result, _ in runs], [want for _, want in runs], time.perf_counter() - started


def summarize(run: FleetRun) -> dict:
    """The metrics of one fleet run (times in ms, rates in tokens/s)."""
    results = run.results
    tokens = sum(len(r.token_ids) for r in results)
    rates = [len(r.token_ids) / r.elapsed_s for r in results]
    tpot = [s * 1e3 for r in results for s in tpot_samples(r.token_times)] or [0.0]
    ttft = [r.token_times[0] * 1e3 for r in results if r.token_times]
    verified = sum(r.draft_tokens for r in results)
    return {
        "mode": run.mode, "devices": run.devices, "tokens": tokens,
        "makespan_s": run.makespan_s, "throughput": tokens / run.makespan_s,
        "device_tps_p5": percentile(rates, 5), "device_tps_p50": percentile(rates, 50),
        "device_tps_p95": percentile(rates, 95), "device_tps_mean": statistics.fmean(rates),
        "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p95": percentile(tpot, 95),
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p95": percentile(ttft, 95),
        "forward_passes": run.forward_passes, "passes_per_token": run.forward_passes / tokens,
        "acceptance_rate": sum(r.accepted_tokens for r in results) / verified if verified else None,
        "mismatches": sum(r.token_ids != want for r, want in zip(results, run.expected)),
    }


def capacity(rows: list[dict], mode: str, target_rate: float) -> int:
    """The largest fleet whose 5th-percentile device still gets target_rate tokens/s (0: none)."""
    return max((r["devices"] for r in rows if r["mode"] == mode and r["device_tps_p5"] >= target_rate),
               default=0)


def add_ratios(rows: list[dict]) -> None:
    """sled's system throughput over centralized's at the same N, on the sled row."""
    central = {r["devices"]: r["throughput"] for r in rows if r["mode"] == "centralized"}
    for r in rows:
        if r["mode"] == "sled" and central.get(r["devices"]):
            r["throughput_vs_centralized"] = r["throughput"] / central[r["devices"]]


async def sweep(served, traces, fleet_sizes: list[int], modes: list[str], args, device, link,
                console) -> list[dict]:
    """Both modes at every N, alternating which goes first, after one unmeasured warm-up of
    each; returns the rows."""

    cap = args.max_new_tokens
    served.check_traces(traces)
    fleet = TraceFleet(served.stub, served.fingerprint, device, link,
                       RoundSettings(draft_len=args.draft_len))
    for mode in modes:
        await run_fleet(fleet, mode, 1, traces.traces, min(cap, 4))
    rows = []
    total = sum(len(modes) * min(cap, len(traces.traces[j % len(traces.traces)].target_ids))
                for n in fleet_sizes for j in range(n))
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("devices", total=total)
        for index, n in enumerate(fleet_sizes):
            for mode in harness.rotated(modes, index):
                progress.update(task, description=f"{mode}, {n} device(s)")
                before, paced = (served.forward_passes(), _overruns(served, args)), []
                counted = replace(
                    fleet, on_tokens=lambda tokens: progress.advance(task, len(tokens)),
                    on_paced=paced.append)
                results, expected, makespan = await run_fleet(counted, mode, n, traces.traces, cap)
                passes = served.forward_passes() - before[0]
                rows.append(summarize(FleetRun(mode, n, results, expected, makespan, passes)))
                # the emulated devices' drafts that this host's loop gave back late
                rows[-1].update(paced_drafts=len(paced), late_drafts=sum(paced))
                if args.emulate:
                    rows[-1]["overruns"] = _overruns(served, args) - before[1]
    rows.sort(key=lambda r: (r["devices"], MODES.index(r["mode"])))
    add_ratios(rows)
    return rows


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
