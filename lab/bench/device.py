"""`sled bench device`: what a device's own choices are worth. Two tables from one run:

(a) the adaptive draft-length policy against every fixed k, on each link profile;
(b) pipelined drafting (drafting ahead while a verdict is in flight) on and off as the round
    trip time grows.

One server process (as in `sled bench serve`); emulated devices replay recorded drafter traces
(`sled trace record`) at a device profile's drafting speed over emulated links. The
configurations are interleaved prompt by prompt, the order rotating, so a slow spell of a noisy
machine hits them all alike. Every output is checked against the target's greedy output.

Per configuration: tokens/s per device (all tokens over all device-seconds), acceptance, tokens
per round, mean draft length, and the share of draft tokens that were drafted ahead. Ratios
(adaptive / best fixed k, pipelining on / off) come with a 95% bootstrap interval over prompts.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace

from rich.progress import Progress
from rich.table import Table

from edge_client.draft_policy import DraftPolicy
from edge_client.session import RoundSettings
from lab.bench import harness
from lab.bench.report import save_figure, short_name, subplots
from lab.profiles import device_profile, link_profile
from lab.traces.fleet import TraceFleet
from sled.flags import fraction, non_negative_float, positive_int

PARTS = ("adaptive", "pipeline")


def add_arguments(parser) -> None:
    harness.add_replay_flags(parser)
    parser.add_argument("--device-profile", default="pi5", help="pi4, pi5, orin-nano, instant; "
                        "NAME:draft_ms_per_token=X,round_overhead_ms=Y")
    parser.add_argument("--devices", type=positive_int, default=1, help="devices running at once")
    parser.add_argument("--reps", type=positive_int, default=1, help="passes over the prompts")
    parser.add_argument("--parts", default="adaptive,pipeline",
                        help="which of adaptive,pipeline to run")
    parser.add_argument("--links", default="ethernet,lte", help="link profiles for the "
                        "draft-length table (NAME:rtt_ms=X,... overrides)")
    harness.add_draft_lens_flag(parser, default="1,2,4,6,8",
                                help="fixed draft lengths to compare adaptive with")
    parser.add_argument("--rtts", default="5,20,50", type=harness.listed(non_negative_float),
                        help="round trip times (ms) for the pipelining table")
    parser.add_argument("--pipeline-link", default="wifi", help="link whose round trip --rtts sets")
    parser.add_argument("--pipeline-draft-len", default="4",
                        type=harness.one_of(positive_int, "adaptive"),
                        help="k for the pipelining table, or adaptive")
    parser.add_argument("--min-confidence", type=fraction, default=0.0, help="stop drafts early "
                        "below this drafter confidence, every configuration (0: never)")
    harness.add_out_flag(parser, "device")


def run(args) -> int:
    return harness.run_bench("device", bench, args)


async def bench(args) -> int:
    console = harness.bench_console()
    settings, model, traces = harness.replay_inputs(args, console, parse_args)
    if args.prompts:
        traces.traces = traces.traces[:args.prompts]
    draft_lens = _usable_lengths(settings["draft_lens"], traces.max_draft_len, console)
    configs = configurations(settings["parts"], settings["links"], draft_lens, settings["rtts"],
                             args.pipeline_link, settings["pipeline_draft_len"])
    started = time.perf_counter()
    async with harness.serving_target(model, args, console) as served:
        with harness.server_errors():
            # The adaptive policy chooses from the same range as the fixed lengths it is compared with.
            results = await sweep(served, traces, configs, args, settings["device"],
                                  max(draft_lens, default=traces.max_draft_len), console)
    rows = [summarize(s) for s in results.values()]
    adaptive = adaptive_rows(results, settings["links"], draft_lens) \
        if "adaptive" in settings["parts"] else []
    pipelined = pipeline_rows(results, args.pipeline_link, settings["rtts"],
                              settings["pipeline_draft_len"]) if "pipeline" in settings["parts"] else []
    info = served.info
    setup = (f"{short_name(model)} on {info.device}, drafter {short_name(traces.drafter)}, device "
             f"{args.device_profile}, {args.devices} device(s), {len(traces.traces)} prompts x "
             f"{args.reps}")
    if adaptive:
        console.print(_adaptive_table(adaptive, draft_lens, setup))
    if pipelined:
        console.print(_pipeline_table(pipelined, setup, settings["pipeline_draft_len"]))
    harness.write_results(console, args.out, {
        "model": model, "server_device": info.device, "dtype": info.dtype, "drafter": traces.drafter,
        "traces": args.traces or "recorded", "prompts": len(traces.traces), "reps": args.reps,
        "max_draft_len": traces.max_draft_len, "device_profile": args.device_profile, "devices": args.devices,
        "max_new_tokens": args.max_new_tokens, "min_confidence": args.min_confidence,
        "pipeline_link": args.pipeline_link, "pipeline_draft_len": settings["pipeline_draft_len"],
        "wall_s": time.perf_counter() - started,
        "adaptive_vs_fixed": adaptive, "pipelining": pipelined, "results": rows},
        lambda png: _plot(adaptive, pipelined, draft_lens, png, setup))
    return harness.lossless_exit(console, [
        f"{r['link']} draft length {r['draft_len']}{' pipelined' if r['pipeline'] else ''}: "
        f"{r['mismatches']} output(s)" for r in rows if r["mismatches"]])


def _usable_lengths(draft_lens: list[int], max_draft_len: int, console) -> list[int]:
    """The fixed draft lengths the traces can serve (none: exit 2)."""
    usable = [draft_len for draft_len in draft_lens if draft_len <= max_draft_len]
    if not usable:
        raise harness.Stop(f"every --draft-lens value is above the traces' max draft length {max_draft_len}")
    if usable != draft_lens:
        console.print(f"[yellow]fixed draft lengths above the traces' {max_draft_len} dropped[/]")
    return usable


@dataclass(frozen=True, slots=True)
class Config:
    """One way of running the devices."""
    part: str                    # "adaptive" (table a) or "pipeline" (table b)
    link: str                    # link profile spec
    draft_len: int | str         # a fixed k, or "adaptive"
    pipeline: bool = False

    @property
    def label(self) -> str:
        length = "adaptive" if self.draft_len == "adaptive" else f"k={self.draft_len}"
        return f"{self.link} {length}" + (" pipelined" if self.pipeline else "")


@dataclass(slots=True)
class Samples:
    """What one configuration produced, unit by unit (a unit: one prompt per device)."""
    config: Config
    tokens: list[int] = field(default_factory=list)       # [units]
    seconds: list[float] = field(default_factory=list)    # [units]: device-seconds
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    pipelined_tokens: int = 0
    mismatches: int = 0


def rtt_link(base: str, rtt_ms: float) -> str:
    """A link spec with its round trip set: rtt_link("wifi", 20) == "wifi:rtt_ms=20"."""
    name, _, overrides = base.partition(":")
    kept = [item for item in overrides.split(",") if item and not item.startswith("rtt_ms=")]
    return f"{name}:" + ",".join([f"rtt_ms={rtt_ms:g}", *kept])


def configurations(parts: list[str], links: list[str], draft_lens: list[int], rtts: list[float],
                   pipeline_link: str, pipeline_draft_len: int | str) -> list[Config]:
    configs = []
    if "adaptive" in parts:
        configs += [Config("adaptive", link, draft_len)
                    for link in links for draft_len in [*draft_lens, "adaptive"]]
    if "pipeline" in parts:
        configs += [Config("pipeline", rtt_link(pipeline_link, rtt), pipeline_draft_len, on)
                    for rtt in rtts for on in (False, True)]
    return configs


def unit_fleet(served, config: Config, device, settings: dict) -> TraceFleet:
    """The emulated devices that run one configuration's units: `settings` holds the sweep's
    max_draft_len and min_confidence."""
    return TraceFleet(served.stub, served.fingerprint, device, link_profile(config.link),
                      RoundSettings(draft_len=config.draft_len, pipeline=config.pipeline,
                                    **settings))


def record(samples: Samples, runs: list) -> None:
    """Add one unit's device results to a configuration's samples."""
    samples.tokens.append(sum(len(r.token_ids) for r, _ in runs))
    samples.seconds.append(sum(r.elapsed_s for r, _ in runs))
    for result, expected in runs:
        samples.rounds += result.rounds
        samples.draft_tokens += result.draft_tokens
        samples.accepted_tokens += result.accepted_tokens
        samples.pipelined_tokens += result.pipelined_tokens
        samples.mismatches += result.token_ids != expected


def rate(samples: Samples, units: list[int] | None = None) -> float:
    """Tokens per device-second over the given units (default: all)."""
    units = range(len(samples.tokens)) if units is None else units
    seconds = sum(samples.seconds[u] for u in units)
    return sum(samples.tokens[u] for u in units) / seconds if seconds else 0.0


def ratio_interval(a: Samples, b: Samples, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of rate(a) / rate(b), resampling units (prompts) in pairs."""
    rng = random.Random(seed)
    n = len(a.tokens)
    ratios = []
    for _ in range(draws):
        units = [rng.randrange(n) for _ in range(n)]
        if rate(b, units):
            ratios.append(rate(a, units) / rate(b, units))
    ratios.sort()
    return ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]


def summarize(samples: Samples) -> dict:
    c = samples.config
    return {
        "part": c.part, "link": c.link, "draft_len": c.draft_len, "pipeline": c.pipeline,
        "tokens": sum(samples.tokens), "device_seconds": sum(samples.seconds),
        "device_tps": rate(samples), "rounds": samples.rounds,
        "tokens_per_round": sum(samples.tokens) / samples.rounds if samples.rounds else 0.0,
        "mean_draft_len": samples.draft_tokens / samples.rounds if samples.rounds else 0.0,
        "acceptance_rate": samples.accepted_tokens / samples.draft_tokens if samples.draft_tokens else None,
        "pipelined_share": samples.pipelined_tokens / samples.draft_tokens if samples.draft_tokens else 0.0,
        "mismatches": samples.mismatches,
    }


def adaptive_rows(results: dict[Config, Samples], links: list[str],
                  draft_lens: list[int]) -> list[dict]:
    """Per link: adaptive's rate against each fixed k and the best of them."""
    rows = []
    for link in links:
        fixed = {draft_len: results[Config("adaptive", link, draft_len)] for draft_len in draft_lens}
        adaptive = results[Config("adaptive", link, "adaptive")]
        best = max(draft_lens, key=lambda draft_len: rate(fixed[draft_len]))
        lo, hi = ratio_interval(adaptive, fixed[best])
        rows.append({"link": link, "adaptive_tps": rate(adaptive),
                     "fixed_tps": {str(n): rate(fixed[n]) for n in draft_lens}, "best_fixed_k": best,
                     "best_fixed_tps": rate(fixed[best]),
                     "adaptive_vs_best_fixed": rate(adaptive) / rate(fixed[best]),
                     "ratio_ci95": [lo, hi],
                     "adaptive_mean_draft_len": summarize(adaptive)["mean_draft_len"]})
    return rows


def pipeline_rows(results: dict[Config, Samples], pipeline_link: str, rtts: list[float],
                  draft_len) -> list[dict]:
    """Per round trip time: pipelining off and on, and the gain."""
    rows = []
    for rtt in rtts:
        link = rtt_link(pipeline_link, rtt)
        off, on = (results[Config("pipeline", link, draft_len, p)] for p in (False, True))
        lo, hi = ratio_interval(on, off)
        rows.append({"rtt_ms": rtt, "link": link, "off_tps": rate(off), "on_tps": rate(on),
                     "gain": rate(on) / rate(off), "gain_ci95": [lo, hi],
                     "pipelined_share": summarize(on)["pipelined_share"]})
    return rows


async def sweep(served, traces, configs: list[Config], args, device, max_draft_len: int,
                console) -> dict:
    """Every configuration on every unit, interleaved, after one unmeasured warm-up each and one
    unmeasured session per prompt (so every measured session finds its prompt in the server's
    prefix cache, whichever configuration happens to run it first).

    Each configuration's devices are devices that run one session after another: each keeps
    one DraftPolicy (its acceptance and timing estimates) across its sessions, as a device
    daemon would; it only matters where a policy decides something (adaptive k, pipelining).
    """
    n, pool = args.devices, traces.traces
    units = [[pool[(u + j) % len(pool)] for j in range(n)] for u in range(len(pool) * args.reps)]
    settings = dict(max_draft_len=max_draft_len, min_confidence=args.min_confidence)
    results = {c: Samples(c) for c in configs}
    policies = {c: [DraftPolicy(max_draft_len=max_draft_len) for _ in range(n)] for c in configs}
    served.check_traces(traces)
    fleets = {c: unit_fleet(served, c, device, settings) for c in configs}
    for config in configs:
        await fleets[config].run(units[0], 4, policies=policies[config])
    for trace in pool:
        await fleets[configs[0]].run([trace], 1)
    total = len(configs) * sum(min(len(t.target_ids), args.max_new_tokens) for unit in units for t in unit)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("devices", total=total)
        for u, unit in enumerate(units):
            for config in harness.rotated(configs, u):
                progress.update(task, description=f"prompt {u + 1}/{len(units)}: {config.label}")
                counted = replace(fleets[config], on_tokens=lambda t: progress.advance(task, len(t)))
                runs = await counted.run(unit, args.max_new_tokens, seed=u * 1000,
                                         policies=policies[config])
                record(results[config], runs)
    return results


def parse_args(args) -> dict:
    """The sweep's settings from the command line; ValueError names the bad flag."""
    parts = args.parts.split(",")
    if not parts or set(parts) - set(PARTS):
        raise ValueError(f"--parts takes a comma-separated subset of {','.join(PARTS)}")
    draft_lens = sorted({int(n) for n in args.draft_lens.split(",")})
    if not draft_lens or draft_lens[0] < 1:
        raise ValueError("--draft-lens needs draft lengths >= 1, e.g. 1,2,4,6,8")
    rtts = [float(r) for r in args.rtts.split(",")]
    if not rtts or min(rtts) < 0:
        raise ValueError("--rtts needs round trip times >= 0 in ms, e.g. 5,20,50")
    links = args.links.split(",")
    for link in [*links, args.pipeline_link]:
        link_profile(link)
    draft_len = args.pipeline_draft_len
    if draft_len != "adaptive" and not (draft_len.isdigit() and int(draft_len) >= 1):
        raise ValueError(f"--pipeline-draft-len takes a number >= 1 or adaptive, not {draft_len!r}")
    if args.devices < 1 or args.reps < 1:
        raise ValueError("--devices and --reps must be >= 1")
    if not 0.0 <= args.min_confidence < 1.0:
        raise ValueError("--min-confidence must be in [0, 1)")
    return {"parts": [p for p in PARTS if p in parts], "draft_lens": draft_lens, "rtts": rtts,
            "links": links,
            "pipeline_draft_len": draft_len if draft_len == "adaptive" else int(draft_len),
            "device": device_profile(args.device_profile)}


def _adaptive_table(rows: list[dict], draft_lens: list[int], setup: str):
    table = Table(title=f"adaptive draft length vs fixed k: {setup}", caption=(
        "tokens/s per device; ratio: adaptive / the best fixed k, with its 95% bootstrap interval "
        "over prompts; mean k: adaptive's mean draft length"))
    for column in ("link", *(f"k={n}" for n in draft_lens), "adaptive", "mean k", "vs best",
                   "95% CI"):
        table.add_column(column, justify="left" if column == "link" else "right")
    for r in rows:
        cells = [f"[bold]{v:.1f}[/]" if length == str(r["best_fixed_k"]) else f"{v:.1f}"
                 for length, v in r["fixed_tps"].items()]
        lo, hi = r["ratio_ci95"]
        table.add_row(r["link"], *cells, f"{r['adaptive_tps']:.1f}", f"{r['adaptive_mean_draft_len']:.1f}",
                      f"{r['adaptive_vs_best_fixed']:.2f}x", f"{lo:.2f}-{hi:.2f}")
    return table


def _pipeline_table(rows: list[dict], setup: str, draft_len):
    table = Table(title=f"pipelined drafting, draft length {draft_len}: {setup}", caption=(
        "tokens/s per device; ahead: share of draft tokens drafted while the previous verdict "
        "was in flight; 95% bootstrap interval of the gain over prompts"))
    for column in ("RTT ms", "off", "on", "gain", "95% CI", "ahead"):
        table.add_column(column, justify="right")
    for r in rows:
        lo, hi = r["gain_ci95"]
        table.add_row(f"{r['rtt_ms']:g}", f"{r['off_tps']:.1f}", f"{r['on_tps']:.1f}",
                      f"{r['gain']:.2f}x", f"{lo:.2f}-{hi:.2f}", f"{r['pipelined_share']:.0%}")
    return table


def _plot(adaptive: list[dict], pipelined: list[dict], draft_lens: list[int], path,
          title: str) -> None:
    fig, (left, right) = subplots(2)
    width = 0.8 / (len(draft_lens) + 1)
    for i, label in enumerate([*map(str, draft_lens), "adaptive"]):
        values = [r["adaptive_tps"] if label == "adaptive" else r["fixed_tps"][label] for r in adaptive]
        left.bar([j + i * width for j in range(len(adaptive))], values, width,
                 label="adaptive" if label == "adaptive" else f"k={label}")
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(adaptive))], [r["link"] for r in adaptive])
    tallest = max([r["adaptive_tps"] for r in adaptive] + [v for r in adaptive for v in r["fixed_tps"].values()],
                  default=1.0)
    left.set(ylabel="tokens/s per device", title="draft length", ylim=(0, tallest * 1.9))  # room for the legend
    rtts = [r["rtt_ms"] for r in pipelined]
    right.plot(rtts, [r["off_tps"] for r in pipelined], marker="o", label="pipelining off")
    right.plot(rtts, [r["on_tps"] for r in pipelined], marker="o", label="pipelining on")
    right.set(xlabel="round trip time (ms)", ylabel="tokens/s per device", title="pipelined drafting")
    save_figure(fig, (left, right), path, title)
