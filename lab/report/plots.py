"""The report's PNGs. matplotlib is imported here only, when plotting starts (Agg backend), so
importing lab.report needs no plotting library. A plot whose data is absent is skipped with a
reason the page shows."""
from __future__ import annotations

from pathlib import Path

from lab.bench.report import pyplot
from lab.report import summary

SYSTEM_COLOURS = {"sled": "tab:blue", "centralized": "tab:orange"}


class Skip(Exception):
    """This plot has no data in this run; the message says why."""


def _pyplot():
    return pyplot()


def _colour(system: str) -> str:
    return SYSTEM_COLOURS.get(system, "tab:gray")


def throughput(plt, report: dict, results: dict):
    rows = [r for r in report["headline"] if r["system_tokens_per_s"] is not None]
    if not rows:
        raise Skip("no phase produced tokens")
    fig, ax = plt.subplots(figsize=(6, 4))
    for system in sorted({r["system"] for r in rows}):
        mine = sorted((r["fleet_size"], r["system_tokens_per_s"]) for r in rows if r["system"] == system)
        ax.plot(*zip(*mine), marker="o", label=system, color=_colour(system))
    ax.set(xlabel="fleet size (devices)", ylabel="system tokens/s", title="System throughput")
    ax.legend()
    return fig


def device_rates(plt, report: dict, results: dict):
    data = {f"{p['system']} x{p['fleet_size']}": list(summary.device_rates(p).values())
            for p in sorted(results["phases"], key=lambda p: (p["system"], p["fleet_size"]))}
    data = {k: v for k, v in data.items() if v}
    if not data:
        raise Skip("no device finished a request")
    fig, ax = plt.subplots(figsize=(max(6, len(data) * 1.2), 4))
    ax.boxplot(list(data.values()))
    ax.set_xticks(range(1, len(data) + 1), list(data), rotation=20)
    ax.axhline(report["slo"].get("tokens_per_s", 0), color="red", linestyle="--", label="SLO")
    ax.set(ylabel="tokens/s per device", title="Per-device tokens/s")
    ax.legend()
    return fig


def latency(plt, report: dict, results: dict):
    rows = report["headline"]
    if not any(r["ttft_s"]["p50"] is not None for r in rows):
        raise Skip("no request received a first token")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['system']} x{r['fleet_size']}" for r in rows]
    for ax, key, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for i, q in enumerate(summary.QUANTILES):
            values = [r[key][f"p{q}"] or 0.0 for r in rows]
            ax.bar([x + i * 0.27 for x in range(len(rows))], values, width=0.27, label=f"p{q}")
        ax.set_xticks([x + 0.27 for x in range(len(rows))], labels, rotation=20)
        ax.set(ylabel="seconds", title=f"{title} p50/p95/p99")
        ax.legend()
    return fig


def capacity(plt, report: dict, results: dict):
    cap = report["capacity"]
    if not cap:
        raise Skip("no phase ran")
    fig, ax = plt.subplots(figsize=(5, 4))
    systems = sorted(cap)
    ax.bar(systems, [cap[s]["fleet_size"] or 0 for s in systems], color=[_colour(s) for s in systems])
    slo = report["slo"]
    ax.set(ylabel="devices served within the SLO",
           title=f"Capacity at {slo.get('tokens_per_s')} tok/s, TTFT p95 <= {slo.get('ttft_s')} s")
    return fig


def acceptance(plt, report: dict, results: dict):
    acc = {k: v for k, v in report["acceptance"].items() if v["rate"] is not None}
    if not acc:
        raise Skip("no sled phase drafted a token")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(list(acc), [v["rate"] for v in acc.values()])
    axes[0].set(ylabel="accepted / drafted", title="Acceptance per drafter", ylim=(0, 1))
    for name, v in acc.items():
        points = [(i + 1, r) for i, r in enumerate(v["per_position"]) if r is not None]
        if points:
            axes[1].plot(*zip(*points), marker="o", label=name)
    axes[1].set(xlabel="draft position", ylabel="acceptance", title="Acceptance per draft position", ylim=(0, 1))
    axes[1].legend()
    return fig


def server(plt, report: dict, results: dict):
    rows = [r for r in report["server"] if r["batch_sizes"]]
    if not rows:
        raise Skip("the server's batch sizes were not scraped")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, row in enumerate(rows):
        buckets = list(row["batch_sizes"])
        axes[0].bar([x + i * 0.8 / len(rows) for x in range(len(buckets))], list(row["batch_sizes"].values()),
                    width=0.8 / len(rows), label=f"{row['system']} x{row['fleet_size']}")
        axes[0].set_xticks(range(len(buckets)), buckets, rotation=45)
    axes[0].set(xlabel="batch size (bucket upper bound)", ylabel="forward passes", title="Server batch sizes")
    axes[0].legend()
    util = [r for r in report["server"] if r["utilisation"] is not None]
    axes[1].bar([f"{r['system']} x{r['fleet_size']}" for r in util], [r["utilisation"] for r in util],
                color=[_colour(r["system"]) for r in util])
    axes[1].set(ylabel="forward seconds / wall seconds", title="Server utilisation")
    axes[1].tick_params(axis="x", rotation=20)
    return fig


def side_by_side(plt, report: dict, results: dict):
    if report.get("beside"):
        return runs_side_by_side(plt, [report["beside"], report])
    systems = {r["system"] for r in report["headline"]}
    if not {"sled", "centralized"} <= systems:
        raise Skip("the centralized baseline did not run")
    size = max(r["fleet_size"] for r in report["headline"])
    rows = {r["system"]: r for r in report["headline"] if r["fleet_size"] == size}
    metrics = (("system tokens/s", lambda r: r["system_tokens_per_s"]),
               ("device tokens/s p50", lambda r: r["device_tokens_per_s"]["p50"]),
               ("TTFT p95 (s)", lambda r: r["ttft_s"]["p95"]), ("TPOT p95 (s)", lambda r: r["tpot_s"]["p95"]))
    fig, axes = plt.subplots(1, len(metrics), figsize=(13, 3.5))
    for ax, (name, get) in zip(axes, metrics):
        names = [s for s in ("sled", "centralized") if s in rows]
        ax.bar(names, [get(rows[s]) or 0.0 for s in names], color=[_colour(s) for s in names])
        ax.set_title(name)
    fig.suptitle(f"sled vs centralized, {size} devices")
    return fig


def runs_side_by_side(plt, runs: list[dict]):
    """System tokens/s per fleet size for sled and centralized, one panel per run, each titled
    by the server it ran against (this machine's own, or an emulated GPU's profile)."""
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        for system in ("sled", "centralized"):
            mine = sorted((r["fleet_size"], r["system_tokens_per_s"]) for r in run["headline"]
                          if r["system"] == system and r["system_tokens_per_s"] is not None)
            if mine:
                ax.plot(*zip(*mine), marker="o", label=system, color=_colour(system))
        emulated = run.get("server_emulation")
        server = f"EMULATED {emulated['profile']}" if emulated else "this machine's own server"
        sizes = sorted({r["fleet_size"] for r in run["headline"]})
        ax.set(xlabel="fleet size (devices)", ylabel="system tokens/s", xscale="log",
               title=f"{run['run']}\n{server}")
        ax.set_xticks(sizes, [str(n) for n in sizes])   # plain numbers (labels are not mathtext)
        ax.minorticks_off()
        ax.legend()
    fig.suptitle("sled vs centralized: this machine's server and the emulated GPU")
    return fig


def costs(plt, report: dict, results: dict):
    per = {name: systems for name, systems in report["costs"]["per_profile"].items()
           if any(v is not None for v in systems.values())}
    if not per:
        raise Skip("no phase had tokens to cost")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(per)
    systems = sorted({s for v in per.values() for s in v})
    for i, system in enumerate(systems):
        xs = [x + i * 0.8 / len(systems) for x in range(len(names))]
        cells = [per[n].get(system) or {} for n in names]
        axes[0].bar(xs, [c.get("usd_per_million_tokens", 0.0) for c in cells], width=0.8 / len(systems),
                    label=system, color=_colour(system))
        axes[1].bar(xs, [c.get("energy_j_per_token", 0.0) for c in cells], width=0.8 / len(systems),
                    label=system, color=_colour(system))
    for ax, label in ((axes[0], "USD per million tokens"), (axes[1], "joules per token")):
        ax.set_xticks(range(len(names)), names)
        ax.set(ylabel=label, title=f"{label} per device profile")
        ax.legend()
    return fig


def faults(plt, report: dict, results: dict):
    steps = report["faults"]
    if not steps:
        raise Skip("the scenario has no fault steps")
    fig, ax = plt.subplots(figsize=(max(6, len(steps) * 1.5), 4))
    labels = [f"{f['kind']}@{f['at_s']}s" for f in steps]
    xs = range(len(steps))
    ax.bar([x - 0.2 for x in xs], [f["lost_tokens"] for f in steps], width=0.4, label="lost")
    ax.bar([x + 0.2 for x in xs], [f["duplicated_tokens"] for f in steps], width=0.4, label="duplicated")
    ax.set_xticks(list(xs), labels, rotation=15)
    ax.set(ylabel="tokens", title="Tokens lost / duplicated in requests open during each fault")
    ax.legend()
    return fig


def kv_blocks(plt, report: dict, results: dict):
    series = [(p, (p.get("server") or {}).get("kv_blocks_used") or []) for p in results["phases"]]
    series = [(p, s) for p, s in series if s]
    if not series:
        raise Skip("the server's KV blocks were not scraped")
    fig, ax = plt.subplots(figsize=(7, 4))
    for phase, points in series:
        ax.plot([t for t, _ in points], [u for _, u in points], label=f"{phase['system']} x{phase['fleet_size']}")
    total = max(((p.get("server") or {}).get("kv_blocks_total") or 0) for p, _ in series)
    if total:
        ax.axhline(total, color="gray", linestyle="--", label="pool size")
    ax.set(xlabel="seconds from phase start", ylabel="KV blocks used", title="KV blocks used over time")
    ax.legend()
    return fig


def placement(plt, report: dict, results: dict):
    """Open sessions by where their tokens come from, over each phase whose server moved any."""
    series = [(p, (p.get("server") or {}).get("placed_sessions") or []) for p in results["phases"]]
    series = [(p, s) for p, s in series if any(server or sat for _, _, server, sat in s)]
    if not series:
        raise Skip("no server placed a session itself (sled serve --placement fixed, or none "
                   "scraped)")
    fig, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 4), squeeze=False)
    for ax, (phase, points) in zip(axes[0], series):
        at = [t for t, *_ in points]
        ax.stackplot(at, [d for _, d, _, _ in points], [s + sat for _, _, s, sat in points],
                     labels=["the device drafts", "the server"])
        ax.set(xlabel="seconds from phase start", ylabel="open sessions",
               title=f"{phase['system']} x{phase['fleet_size']}: where tokens come from")
        ax.legend(loc="upper left")
    return fig


# (file, caption, function) in the page's order
PLOTS = (
    ("throughput.png", "System tokens/s against fleet size, sled and centralized.", throughput),
    ("device_tokens_per_s.png", "Distribution of per-device tokens/s per system and fleet size; red line: the SLO.",
     device_rates),
    ("latency.png", "TTFT and TPOT p50/p95/p99 per system and fleet size.", latency),
    ("capacity.png", "Largest fleet size meeting the SLO (p5 device tokens/s and TTFT p95).", capacity),
    ("acceptance.png", "Acceptance rate per drafter and per draft position (sled phases).", acceptance),
    ("server.png", "Server batch sizes per phase, and utilisation (forward seconds / wall seconds).", server),
    ("sled_vs_centralized.png", "sled and centralized side by side at the largest fleet size; with "
     "sled lab run --beside RUN, their throughput in that run and in this one, side by side.",
     side_by_side),
    ("costs.png", "Cost per million tokens and energy per token per device profile (assumed figures).", costs),
    ("faults.png", "Tokens lost and duplicated in requests open during each fault step.", faults),
    ("kv_blocks.png", "KV blocks used over each phase.", kv_blocks),
    ("placement.png", "Open sessions by where their tokens come from, over each phase of a "
     "server that places sessions (sled serve --placement).", placement),
)


def render(report: dict, results: dict, out_dir: Path) -> tuple[list[dict], list[dict]]:
    """Every plot as a PNG in out_dir: ([{"file", "caption"}], [{"file", "caption", "reason"}]).
    A plot that fails is skipped with its reason; the others still render."""
    plt = _pyplot()
    made, skipped = [], []
    for name, caption, draw in PLOTS:
        try:
            _draw_one(plt, draw, report, results, out_dir / name)
        except Skip as why:
            skipped.append({"file": name, "caption": caption, "reason": str(why)})
            continue
        except Exception as exc:  # one broken plot must not cost the report
            skipped.append({"file": name, "caption": caption, "reason": f"plot failed: {exc}"})
            continue
        made.append({"file": name, "caption": caption})
    return made, skipped


def _draw_one(plt, draw, report: dict, results: dict, path: Path) -> None:
    """Draw and save one plot; labels from data are literal text (no mathtext); no URL metadata."""
    fig = None
    try:
        with plt.rc_context({"text.parse_math": False}):
            fig = draw(plt, report, results)
            fig.tight_layout()
            fig.savefig(path, dpi=100, metadata={"Software": None})
    finally:
        if fig is not None:
            plt.close(fig)
        plt.close("all")
