"""`sled lab landscape RESULTS...`: where sled wins and where it does not, from several
`sled lab simulate` runs (each a profile at one context length): one heat map of sled's
GPU-seconds per token over centralized serving's, per fleet size, with each run's capacity at
the SLO beside it, and the same as Markdown tables for BENCHMARKS.md.

`--sweep SCENARIO` runs the simulations itself, one per prompt length x answer length
(lab.sim.sweep); the map comes with it, and with any runs that say their answer length: for every
mode that ran (sled, centralized, centralized-spec), its capacity at the SLO, the rate its slowest
devices get at the sweep's lightest load, and its GPU-seconds per 1k tokens there, side by side for
every prompt and answer length, in one figure (NAME-map.png beside the heat map NAME.png).

    sled lab landscape lab-results/simulate-* --out landscape.png
    sled lab landscape --sweep fleet-sizing --contexts 512,2048,8192 --answers 64,512 \
        --simulate-args="--modes sled,centralized,centralized-spec --fleet-sizes 1,4,16,64" \
        --runs lab-results/landscape --out landscape.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from lab.bench.report import pyplot
from lab.sim.simulate import MODES, capacities
from lab.sim.sweep import SweepError, sweep
from sled.flags import one_line, positive_int


def add_arguments(parser) -> None:
    parser.add_argument("results", nargs="*", help="`sled lab simulate` result folders (or their "
                        "results.json)")
    parser.add_argument("--out", default="landscape.png", help="the plot (.png)")
    parser.add_argument("--sweep", default=None, metavar="SCENARIO", help="run the simulations "
                        "first: SCENARIO at every --contexts x --answers")
    parser.add_argument("--contexts", default="512,2048,8192", help="--sweep: prompt lengths")
    parser.add_argument("--answers", default="64,512", help="--sweep: new tokens a request")
    parser.add_argument("--simulate-args", default="", help="--sweep: the rest of each run's "
                        "`sled lab simulate` flags, one string (--profile, --modes, "
                        "--fleet-sizes, ...)")
    parser.add_argument("--runs", default="lab-results/landscape", help="--sweep: where the "
                        "runs' result folders go")


def run(args) -> int:
    try:
        folders = [Path(p) for p in args.results] + _swept(args)
        if not folders:
            raise ValueError("give sled lab simulate result folders, or --sweep SCENARIO")
        runs = sorted((_load(p) for p in folders),
                      key=lambda r: (r["profiles"]["sled"], r.get("max_tokens", 0),
                                     r["context_tokens"]))
    except (OSError, ValueError, KeyError) as exc:
        print(f"sled lab landscape: {one_line(exc)}", file=sys.stderr)
        return 2
    print(markdown(runs))
    plot(runs, Path(args.out))
    print(f"wrote {args.out}")
    if args.sweep or any("max_tokens" in run for run in runs):   # runs that say their answer
        print(f"wrote {map_plot(runs, Path(args.out).with_name(Path(args.out).stem + '-map.png'))}")
    return 0


def _swept(args) -> list[Path]:
    """--sweep's result folders (none without it)."""
    if not args.sweep:
        return []
    try:
        contexts = [positive_int(v) for v in args.contexts.split(",")]
        answers = [positive_int(v) for v in args.answers.split(",")]
    except Exception as exc:
        raise ValueError(f"--contexts and --answers: comma-separated integers >= 1 ({exc})") \
            from None
    try:
        return sweep(args.sweep, contexts, answers, args.simulate_args, Path(args.runs))
    except SweepError as exc:
        raise ValueError(str(exc)) from None


def _load(path: Path) -> dict:
    path = path / "results.json" if path.is_dir() else path
    data = json.loads(path.read_text())
    if "profiles" not in data or "results" not in data:
        raise ValueError(f"{path}: not the results of sled lab simulate")
    return data


def _by_size(run: dict) -> dict[int, dict[str, dict]]:
    table: dict[int, dict[str, dict]] = {}
    for row in run["results"]:
        table.setdefault(row["devices"], {})[row["mode"]] = row
    return table


def _label(run: dict) -> str:
    profiles = run["profiles"]
    held = profiles["sled"] if profiles["sled"] == profiles["centralized"] else \
        f"{profiles['sled']} vs {profiles['centralized']}"
    answer = f", {run['max_tokens']} new" if "max_tokens" in run else ""
    return f"{held}, {run['context_tokens']} tokens{answer}"


def markdown(runs: list[dict]) -> str:
    """Per run: its capacities and, per N, sled's throughput and GPU-seconds per token over
    centralized's, and whether each mode met the SLO."""
    lines = []
    for run in runs:
        sizes = _by_size(run)
        sled, central, ratio = capacities(run)
        lines += [f"**{_label(run)}**: capacity sled {sled}, centralized {central} ({ratio})", "",
                  "| N | sled tok/s | centralized tok/s | sled p5 | central p5 | sled TTFT p95 s "
                  "| central TTFT p95 s | GPU-s/1k sled | GPU-s/1k central | sled/central GPU-s "
                  "| J/1k sled | J/1k central |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for n, modes in sorted(sizes.items()):
            s, c = modes.get("sled"), modes.get("centralized")
            if s is None or c is None:
                continue
            lines.append(
                f"| {n} | {s['throughput']:.0f} | {c['throughput']:.0f} | "
                f"{s['device_tps_p5']:.1f}{'' if s['meets_slo'] else ' ✗'} | "
                f"{c['device_tps_p5']:.1f}{'' if c['meets_slo'] else ' ✗'} | "
                f"{s['ttft_ms_p95'] / 1e3:.1f} | {c['ttft_ms_p95'] / 1e3:.1f} | "
                f"{s['gpu_s_per_1k']:.2f} | {c['gpu_s_per_1k']:.2f} | "
                f"{s['gpu_s_per_1k'] / c['gpu_s_per_1k']:.2f} | "
                f"{_energy(s)} | {_energy(c)} |")
        lines.append("")
    return "\n".join(lines)


def _both(modes: dict) -> bool:
    """Whether sled and centralized both ran at a fleet size (the heat map's ratio)."""
    return "sled" in modes and "centralized" in modes


def _energy(row: dict) -> str:
    return "-" if row.get("energy_j_per_1k") is None else f"{row['energy_j_per_1k']:.0f}"


def plot(runs: list[dict], path: Path) -> Path:
    """One heat map: a row per run, a column per fleet size; the colour and the number are
    sled's GPU-seconds per token over centralized's (below 1: sled spends less of the GPU); S
    or C after the number marks where only sled, or only centralized, meets the SLO; each
    row's label ends with its capacities."""
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    plt = pyplot()
    sizes = sorted({n for run in runs for n, modes in _by_size(run).items() if _both(modes)})
    grid = np.full((len(runs), len(sizes)), np.nan)
    for i, run in enumerate(runs):
        for n, modes in _by_size(run).items():
            if _both(modes) and n in sizes:
                grid[i, sizes.index(n)] = (modes["sled"]["gpu_s_per_1k"]
                                           / modes["centralized"]["gpu_s_per_1k"])
    fig, axis = plt.subplots(figsize=(5.5 + 0.9 * len(sizes), 1.4 + 0.45 * len(runs)))
    image = axis.imshow(grid, cmap="RdYlGn_r", norm=TwoSlopeNorm(1.0, 0.2, 1.8), aspect="auto")
    for i, run in enumerate(runs):
        table = _by_size(run)
        for j, n in enumerate(sizes):
            if np.isnan(grid[i, j]) or n not in table:
                continue
            modes = table[n]
            slo = {m: modes[m]["meets_slo"] for m in ("sled", "centralized")}
            mark = "" if slo["sled"] == slo["centralized"] else (" S" if slo["sled"] else " C")
            axis.text(j, i, f"{grid[i, j]:.2f}{mark}", ha="center", va="center", fontsize=8)
    axis.set_xticks(range(len(sizes)), [str(n) for n in sizes])
    axis.set_yticks(range(len(runs)), [
        f"{_label(run)}  (capacity {'/'.join(capacities(run)[:2])})" for run in runs], fontsize=8)
    axis.set_xlabel("devices (S: only sled meets the SLO there, C: only centralized)")
    fig.colorbar(image, ax=axis, label="sled / centralized GPU-seconds per token")
    axis.set_title("where sled spends less of the GPU (green) and where it does not (red); "
                   "capacity sled/centralized at the SLO", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the map: every mode at every prompt and answer length ---------------------------------------

MAP_METRICS = (("capacity at the SLO (devices)", "capacity"),
               ("rate p5 at the lightest load (tok/s)", "device_tps_p5"),
               ("GPU-seconds per 1k tokens at the lightest load", "gpu_s_per_1k"))


def map_values(run: dict) -> dict[str, dict[str, float]]:
    """Per mode that ran: its capacity, and its slowest devices' rate and GPU-seconds per 1k
    tokens at the run's smallest fleet."""
    lightest = min(r["devices"] for r in run["results"])
    values = {}
    for mode in MODES:
        rows = [r for r in run["results"] if r["mode"] == mode]
        if rows:
            light = next(r for r in rows if r["devices"] == lightest)
            values[mode] = {"capacity": run["capacity"].get(mode) or 0,
                            "device_tps_p5": light["device_tps_p5"],
                            "gpu_s_per_1k": light["gpu_s_per_1k"]}
    return values


def map_plot(runs: list[dict], path: Path) -> Path:
    """Three panels (capacity, rate at a light load, GPU-seconds a token there), a group of
    bars per prompt x answer length, a bar per mode."""
    import numpy as np

    plt = pyplot()
    values = [map_values(run) for run in runs]
    modes = [m for m in MODES if any(m in v for v in values)]
    labels = [f"{run['context_tokens']} in\n{run.get('max_tokens', '?')} out" for run in runs]
    fig, axes = plt.subplots(1, len(MAP_METRICS), figsize=(4.5 * len(MAP_METRICS),
                                                          3.2 + 0.1 * len(runs)))
    width = 0.8 / len(modes)
    for axis, (title, key) in zip(axes, MAP_METRICS):
        for k, mode in enumerate(modes):
            heights = [v.get(mode, {}).get(key, 0) for v in values]
            axis.bar(np.arange(len(runs)) + (k - (len(modes) - 1) / 2) * width, heights, width,
                     label=mode)
        axis.set_xticks(range(len(runs)), labels, fontsize=8)
        axis.set_title(title, fontsize=9)
        if key == "capacity":
            axis.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{_held(runs)}: each mode at every prompt and answer length", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _held(runs: list[dict]) -> str:
    names = sorted({name for run in runs for name in run["profiles"].values()})
    return " / ".join(names)
