"""`sled lab landscape RESULTS...`: where sled wins and where it does not, from several
`sled lab simulate` runs (each a profile at one context length): one heat map of sled's
GPU-seconds per token over centralized serving's, per fleet size, with each run's capacity at
the SLO beside it, and the same as Markdown tables for BENCHMARKS.md.

    sled lab landscape lab-results/simulate-* --out landscape.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from lab.bench.report import pyplot
from lab.sim.simulate import capacities
from sled.flags import one_line


def add_arguments(parser) -> None:
    parser.add_argument("results", nargs="+", help="`sled lab simulate` result folders (or their "
                        "results.json)")
    parser.add_argument("--out", default="landscape.png", help="the plot (.png)")


def run(args) -> int:
    try:
        runs = sorted((_load(Path(p)) for p in args.results),
                      key=lambda r: (r["profiles"]["sled"], r["context_tokens"]))
    except (OSError, ValueError, KeyError) as exc:
        print(f"sled lab landscape: {one_line(exc)}", file=sys.stderr)
        return 2
    print(markdown(runs))
    plot(runs, Path(args.out))
    print(f"wrote {args.out}")
    return 0


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
    return f"{held}, {run['context_tokens']} tokens"


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
    sizes = sorted({n for run in runs for n, modes in _by_size(run).items() if len(modes) == 2})
    grid = np.full((len(runs), len(sizes)), np.nan)
    for i, run in enumerate(runs):
        for n, modes in _by_size(run).items():
            if len(modes) == 2 and n in sizes:
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
