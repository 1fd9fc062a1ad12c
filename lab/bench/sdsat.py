"""`sled bench sdsat`: what semantic adaptive tokens (SATs) buy on a SAT-tuned target.

One server process, one workload, two parts:

1. **Self-drafting.** Every prompt through the server: plain autoregressive decoding
   (GENERATION_MODE_SERVER, one token per pass), SAT self-drafting greedy
   (GENERATION_MODE_SERVER_SAT, each pass verifies the previous SAT guesses and guesses the next
   m) and SAT self-drafting sampled at --temperature (seeded per prompt). Per mode: target
   forward passes per token (the server's sled_forward_passes_total; a prompt's prefill is a pass
   too), accepted SAT tokens and emitted tokens per step, SAT acceptance overall and per slot
   (slot j accepted when slots 1..j-1 were), wall-clock tokens/s. Then a second server with
   --compare-adapter (for a built-in target: its embeddings-only adapter) runs greedy SAT
   self-drafting on the same prompts, so two adapters are compared in one run.
2. **Lookahead.** Every drafter drafts k tokens per round against the same server three ways:
   no lookahead; lookahead m with hints "measured" (the verdict carries m SAT hints and the
   device's HintPolicy starts a draft with them only while they beat its drafter, the default);
   and lookahead m with hints "always" (every hint used: what the hints are worth raw). Per
   (drafter, setting): tokens per round, acceptance, hint tokens used, passes per token, tokens/s.

`--sat-adapter random` serves a target that has no adapter (a synthetic one on a GPU) with a
random one of its shape (lab.bench.random_sat): the passes cost what a trained adapter's cost,
their acceptance is a random model's. `--drafters none` leaves the lookahead part out.

The modes run prompt by prompt, alternating which goes first, and one at a time, so the pass
counter's delta belongs to one mode. Every output must equal the plain mode's output for the same
prompt, which is the target's own greedy output: a difference fails the benchmark (exit 1).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.progress import Progress
from rich.table import Table

from drafters import load_drafter, resolve_spec
from edge_client.server_side import generate_server_side
from edge_client.session import RoundSettings, Target, generate
from edge_client.wire import SessionRequest
from lab.bench import harness
from lab.bench.random_sat import RANDOM, random_adapter_path, write_random_adapter
from lab.bench.report import save_figure, short_name, subplots
from lab.workload import prompt_texts
from sled.flags import non_negative_float, non_negative_int, positive_int
from sled.models import builtin_sat_adapter, resolve_model
from sled.v1 import verifier_pb2 as pb
from sled.wire.sampling import Sampling

PLAIN, SAT, SAMPLED, COMPARED = "plain", "sat", "sat sampled", "sat (compared adapter)"
# the lookahead part's settings: name -> RoundSettings.hints (None: no lookahead)
LOOKAHEAD_SETTINGS = {"none": None, "measured": "measured", "always": "always"}


def add_arguments(parser) -> None:
    harness.add_server_flags(parser, model_default="gemma3-270m",
                             model_help="target alias or checkpoint path")
    parser.add_argument("--sat-adapter", default=None, help="SAT adapter for the server (default: "
                        "the one shipped for a built-in target, or one beside the model; random: "
                        "a random one of the target's shape, written beside --out)")
    parser.add_argument("--compare-adapter", default=None,
                        help="a second SAT adapter whose greedy self-drafting runs beside (default: "
                             "the embeddings-only adapter shipped for a built-in target; none: skip)")
    parser.add_argument("--temperature", type=non_negative_float, default=0.8,
                        help="SAT self-drafting also sampled at this temperature (0: skip)")
    harness.add_workload_flags(parser, default="humaneval:10", max_new_tokens=64)
    parser.add_argument("--drafters", default="gguf:gemma3-270m,onnx:gemma3-270m,ngram",
                        help="comma-separated drafter specs for the lookahead part (none: no "
                             "lookahead part)")
    harness.add_draft_len_flag(parser, help="tokens drafted per round")
    parser.add_argument("--lookahead", type=non_negative_int, default=None,
                        help="SAT hints per verdict (default: the target's SAT slots)")
    parser.add_argument("--devices", type=positive_int, default=1, help="sessions at once in every mode")
    harness.add_out_flag(parser, "sdsat")


def run(args) -> int:
    return harness.run_bench("sdsat", bench, args)


@dataclass(slots=True)
class Run:
    """One mode's generations over the workload: results in prompt order, passes and seconds."""
    results: dict[int, object] = field(default_factory=dict)   # prompt index -> GenerationResult
    passes: float = 0.0
    seconds: float = 0.0

    def add(self, group: list[int], results: list, passes: float, seconds: float) -> None:
        """One group's generations (prompt indices `group`), the passes and seconds they cost."""
        self.results.update(zip(group, results))
        self.passes += passes
        self.seconds += seconds


def chunks(count: int, size: int) -> list[list[int]]:
    """Prompt indices in groups of `size` (the sessions that run at once): (5, 2) -> [[0, 1], [2, 3], [4]]."""
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def per_slot(judged: list[tuple[int, int]], slots: int) -> list[float | None]:
    """Acceptance of slot j = 1..slots given slots 1..j-1 were accepted, over (verified,
    accepted) verdicts: [(3, 1), (3, 3)] -> [1.0, 0.5, 1.0]."""
    rates = []
    for j in range(1, slots + 1):
        tried = sum(1 for verified, accepted in judged if verified >= j and accepted >= j - 1)
        kept = sum(1 for verified, accepted in judged if verified >= j and accepted >= j)
        rates.append(kept / tried if tried else None)
    return rates


def summarize(run: Run, reference: dict[int, list[int]] | None) -> dict:
    """Totals and rates of one run; mismatches counts prompts whose output differs from reference
    (None: a sampled run, not compared)."""
    results = [run.results[i] for i in sorted(run.results)]
    tokens = sum(len(r.token_ids) for r in results)
    rounds = sum(r.rounds for r in results)
    drafted = sum(r.draft_tokens for r in results)
    accepted = sum(r.accepted_tokens for r in results)
    mismatched = [] if reference is None else \
        [i for i in sorted(run.results) if run.results[i].token_ids != reference[i]]
    return {
        "prompts": len(results), "tokens": tokens, "rounds": rounds, "draft_tokens": drafted,
        "accepted_tokens": accepted, "hint_tokens": sum(r.hint_tokens for r in results),
        "forward_passes": run.passes, "seconds": run.seconds,
        "passes_per_token": run.passes / tokens if tokens else None,
        "tokens_per_round": tokens / rounds if rounds else None,
        "accepted_per_round": accepted / rounds if rounds else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_s": tokens / run.seconds if run.seconds else None,
        "mismatched_prompts": mismatched, "lossless": not mismatched,
        "compared": reference is not None,
    }


def ratio(new: float | None, old: float | None) -> float | None:
    return new / old if new is not None and old else None


async def _timed_group(served, coros) -> tuple[list, float, float]:
    """Run one group of sessions at once: (results, passes they cost, seconds)."""
    before = served.forward_passes()
    started = time.perf_counter()
    results = await asyncio.gather(*coros)
    seconds = time.perf_counter() - started
    return list(results), served.forward_passes() - before, seconds


def server_modes(names: list[str], temperature: float) -> dict[str, tuple[int, object]]:
    """name -> (generation mode, sampling for prompt i) of the server-side modes named."""
    greedy = lambda i: Sampling()   # noqa: E731
    table = {PLAIN: (pb.GENERATION_MODE_SERVER, greedy),
             SAT: (pb.GENERATION_MODE_SERVER_SAT, greedy),
             COMPARED: (pb.GENERATION_MODE_SERVER_SAT, greedy),
             SAMPLED: (pb.GENERATION_MODE_SERVER_SAT,
                       lambda i: Sampling(temperature=temperature, seed=i))}
    return {name: table[name] for name in names}


async def self_drafting(served, prompts: list[list[int]], args, progress, task,
                        names: list[str]) -> dict[str, Run]:
    """Server-side decoding of every prompt in each named mode, rotating the order per group."""
    stub = served.stub
    modes = server_modes(names, args.temperature)
    for mode, sampling in modes.values():   # warm-up, unmeasured
        await generate_server_side(stub, SessionRequest(prompts[0], max_new_tokens=4, mode=mode,
                                                        sampling=sampling(0)))
    runs = {name: Run() for name in modes}
    for index, group in enumerate(chunks(len(prompts), args.devices)):
        for name in harness.rotated(names, index):
            progress.update(task, description=f"self-drafting: {name}")
            mode, sampling = modes[name]
            runs[name].add(group, *await _timed_group(served, (
                generate_server_side(
                    stub, SessionRequest(prompts[i], max_new_tokens=args.max_new_tokens, mode=mode,
                                         sampling=sampling(i)))
                for i in group)))
            progress.advance(task, len(group))
    return runs


async def lookahead_runs(served, spec: str, prompts: list[list[int]], lookahead: int, args,
                         progress, task) -> dict[str, Run]:
    """One drafter with no lookahead, measured hints and every hint (LOOKAHEAD_SETTINGS),
    rotating the order per group; runs keyed by setting name."""
    stub, fingerprint = served.stub, served.fingerprint
    resolved = resolve_spec(spec)   # once: an ONNX alias may export on first use
    drafters = [load_drafter(resolved) for _ in range(args.devices)]
    settings = list(LOOKAHEAD_SETTINGS)

    def one(slot: int, prompt: list[int], name: str, max_new: int):
        hints = LOOKAHEAD_SETTINGS[name]
        return generate(stub, drafters[slot], SessionRequest(prompt, max_new_tokens=max_new),
                        settings=RoundSettings(draft_len=args.draft_len,
                                               lookahead=lookahead if hints else 0,
                                               hints=hints or "measured"),
                        target=Target(fingerprint=fingerprint))

    for name in settings:         # warm-up, unmeasured (loads the drafter's runtime too)
        await one(0, prompts[0], name, 4)
    runs = {name: Run() for name in settings}
    for index, group in enumerate(chunks(len(prompts), args.devices)):
        for name in harness.rotated(settings, index):
            progress.update(task, description=f"{short_name(spec)}, lookahead {name}")
            runs[name].add(group, *await _timed_group(served, (
                one(slot, prompts[i], name, args.max_new_tokens) for slot, i in enumerate(group))))
            progress.advance(task, len(group))
    return runs


def _validate(args) -> list[str]:
    specs = [s.strip() for s in args.drafters.split(",") if s.strip() and s.strip() != "none"]
    if args.devices < 1:
        raise ValueError(f"--devices must be >= 1, not {args.devices}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, not {args.max_new_tokens}")
    if args.lookahead is not None and args.lookahead < 1:
        raise ValueError(f"--lookahead must be >= 1, not {args.lookahead}")
    for flag, path in (("--sat-adapter", args.sat_adapter), ("--compare-adapter", args.compare_adapter)):
        if path and path not in ("none", RANDOM) and not Path(path).is_file():
            raise ValueError(f"{flag} {path}: no such file")
    if args.compare_adapter == RANDOM:
        raise ValueError("--compare-adapter random: compare a trained adapter, or none")
    return specs


def _server_args(args, compared: bool = False) -> list[str] | None:
    """`sled serve` flags: dtype, the SAT adapter (explicit, else the alias's shipped one), extras.
    compared: the second server's, with --compare-adapter (None when there is none)."""
    if compared:
        adapter = args.compare_adapter or builtin_sat_adapter(args.model, "embeddings")
        if adapter is None or adapter == "none":
            return None
    else:
        adapter = args.sat_adapter or builtin_sat_adapter(args.model)
    return harness.server_flags(args) + (["--sat-adapter", str(adapter)] if adapter else [])


async def bench(args) -> int:
    console = harness.bench_console(width=160)
    with harness.flag_errors():
        specs = _validate(args)
        if args.sat_adapter == RANDOM:
            args.sat_adapter = str(write_random_adapter(args.model,
                                                        random_adapter_path(args.out)))
        server_args, compare_args = _server_args(args), _server_args(args, compared=True)
        model_path = resolve_model(args.model)
    async with harness.serving(model_path, server_args, console,
                               status=f"starting the verify server ({args.model})") as served:
        lookahead = _lookahead(served.info, args)
        with harness.flag_errors():
            prompts = await served.prompt_ids(prompt_texts(args.workload))
        with harness.server_errors():
            modes, by_drafter = await _measure(served, specs, prompts, lookahead, args, console)
    info = served.info
    if compare_args is not None:
        modes.update(await _compared(model_path, compare_args, prompts, args, console))
    sat_rows, drafter_rows = _rows(modes, by_drafter, lookahead, len(prompts), info.sat_slots)
    setup = (f"{short_name(args.model)} on {info.device} ({info.dtype}), {info.sat_slots} SAT "
             f"slots, {args.workload}, {args.max_new_tokens} new tokens, {args.devices} session(s) "
             "at once")
    console.print(_self_drafting_table(sat_rows, setup))
    if drafter_rows:
        console.print(_lookahead_table(drafter_rows, args.draft_len, lookahead))
    harness.write_results(console, args.out, {
        "model": args.model, "sat_adapter": _adapter_of(server_args),
        "compare_adapter": _adapter_of(compare_args or []), "temperature": args.temperature,
        "server_device": info.device,
        "dtype": info.dtype, "sat_slots": info.sat_slots, "workload": args.workload,
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "devices": args.devices,
        "lossless": all(r["lossless"] for r in sat_rows + drafter_rows),
        "self_drafting": {"rows": sat_rows, "lossless": all(r["lossless"] for r in sat_rows)},
        "lookahead": {"k": args.draft_len, "lookahead": lookahead, "drafters": specs,
                      "rows": drafter_rows, "lossless": all(r["lossless"] for r in drafter_rows)},
    }, lambda png: _plot(sat_rows, drafter_rows, lookahead, png, setup))
    return harness.lossless_exit(console, [
        f"{_label(r)}: prompts {r['mismatched_prompts']}"
        for r in sat_rows + drafter_rows if not r["lossless"]],
        reference="the target's greedy output (plain mode)")


def _label(row: dict) -> str:
    """A row's name: its mode, or its drafter and lookahead."""
    return row.get("mode") or f"{row['drafter']} lookahead {row['lookahead']} ({row['hints']})"


def _lookahead(info, args) -> int:
    """SAT hints per verdict: --lookahead, else every SAT slot; a target without SATs, or too
    few slots, cannot run this benchmark (exit 2)."""
    if not info.sat_available:
        raise harness.Stop(f"target {args.model} has no SATs: pass --sat-adapter or train one "
                           "with sled sdsat train")
    lookahead = args.lookahead or info.sat_slots
    if lookahead > info.sat_slots:
        raise harness.Stop(f"--lookahead {lookahead} exceeds the target's {info.sat_slots} SAT slots")
    return lookahead


async def _measure(served, specs: list[str], prompts: list[list[int]], lookahead: int, args,
                   console) -> tuple[dict[str, Run], dict[str, dict[str, Run]]]:
    """Both parts: self-drafting, then each drafter with and without lookahead."""
    names = [PLAIN, SAT] + ([SAMPLED] if args.temperature > 0 else [])
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("generations", total=len(prompts) * (
            len(names) + len(LOOKAHEAD_SETTINGS) * len(specs)))
        modes = await self_drafting(served, prompts, args, progress, task, names)
        by_drafter = {}
        for spec in specs:
            by_drafter[spec] = await lookahead_runs(served, spec, prompts, lookahead, args,
                                                    progress, task)
    return modes, by_drafter


async def _compared(model_path: str, server_args: list[str], prompts: list[list[int]], args,
                    console) -> dict[str, Run]:
    """Greedy SAT self-drafting on a second server that carries the compared adapter."""
    async with harness.serving(model_path, server_args, console,
                               status="starting the verify server with the compared adapter") as served:
        with harness.server_errors(), Progress(console=console, transient=True) as progress:
            task = progress.add_task("generations", total=len(prompts))
            return await self_drafting(served, prompts, args, progress, task, [COMPARED])


def _rows(modes: dict[str, Run], by_drafter: dict[str, dict[str, Run]], lookahead: int,
          n: int, slots: int) -> tuple[list[dict], list[dict]]:
    """The self-drafting rows (plain, sat, sampled, compared adapter) and two rows per drafter
    (no lookahead, lookahead), every greedy output checked against the plain mode's (the target's
    greedy output)."""
    reference = {i: r.token_ids for i, r in modes[PLAIN].results.items()}
    sat_rows = []
    for name, run in modes.items():
        row = {"mode": name, **summarize(run, None if name == SAMPLED else reference)}
        judged = [pair for result in run.results.values() for pair in result.judged]
        row["per_slot_acceptance"] = per_slot(judged, slots) if name != PLAIN else None
        sat_rows.append(row)
    plain_row = sat_rows[0]
    for sat_row in sat_rows[1:]:
        sat_row["passes_per_token_vs_plain"] = ratio(sat_row["passes_per_token"], plain_row["passes_per_token"])
        sat_row["tokens_per_s_vs_plain"] = ratio(sat_row["tokens_per_s"], plain_row["tokens_per_s"])
    drafter_rows = []
    for spec, runs in by_drafter.items():
        none_row = {"drafter": spec, "lookahead": 0, "hints": "none", **summarize(runs["none"], reference)}
        drafter_rows.append(none_row)
        for name in ("measured", "always"):
            row = {"drafter": spec, "lookahead": lookahead, "hints": name,
                   **summarize(runs[name], reference)}
            row["same_as_no_lookahead"] = all(runs[name].results[i].token_ids ==
                                              runs["none"].results[i].token_ids for i in range(n))
            row["tokens_per_round_vs_none"] = ratio(row["tokens_per_round"], none_row["tokens_per_round"])
            row["tokens_per_s_vs_none"] = ratio(row["tokens_per_s"], none_row["tokens_per_s"])
            drafter_rows.append(row)
    return sat_rows, drafter_rows


def _adapter_of(server_args: list[str]) -> str | None:
    return server_args[server_args.index("--sat-adapter") + 1] if "--sat-adapter" in server_args else None


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _lossless(row: dict) -> str:
    if not row.get("compared", True):
        return "sampled"
    return "yes" if row["lossless"] else f"[red]{len(row['mismatched_prompts'])} differ[/]"


def _slots(rates: list[float | None] | None) -> str:
    return "-" if not rates else " ".join(_fmt(r, ".0%") for r in rates)


def _self_drafting_table(rows: list[dict], setup: str):
    table = Table(title=f"SAT self-drafting vs plain decoding: {setup}", caption=(
        "passes: target forward passes per output token (prefills included); step: one server "
        "pass of a session; per slot: slot j accepted when slots before it were; vs plain: "
        "SAT / plain"))
    columns = ("mode", "tokens", "steps", "passes/tok", "passes vs plain", "tok/step",
               "accepted/step", "SAT accept", "per slot", "tok/s", "tok/s vs plain", "lossless")
    for column in columns:
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in rows:
        table.add_row(r["mode"], str(r["tokens"]), str(r["rounds"]), _fmt(r["passes_per_token"], ".3f"),
                      _fmt(r.get("passes_per_token_vs_plain"), ".2f", "x"),
                      _fmt(r["tokens_per_round"], ".2f"), _fmt(r["accepted_per_round"], ".2f"),
                      _fmt(r["acceptance_rate"], ".0%"), _slots(r.get("per_slot_acceptance")),
                      _fmt(r["tokens_per_s"], ".1f"),
                      _fmt(r.get("tokens_per_s_vs_plain"), ".2f", "x"), _lossless(r))
    return table


def _lookahead_table(rows: list[dict], draft_len: int, lookahead: int):
    table = Table(title=f"SAT lookahead for drafting devices: k={draft_len}, lookahead 0 vs "
                        f"{lookahead} (hints measured: used while they beat the drafter; always)",
                  caption="hints: SAT hint tokens sent as the start of a draft; vs none: "
                          "lookahead / no lookahead")
    columns = ("drafter", "lookahead", "use", "tokens", "rounds", "tok/round", "tok/round vs none",
               "accept", "hints", "passes/tok", "tok/s", "tok/s vs none", "lossless")
    for column in columns:
        table.add_column(column, justify="left" if column == "drafter" else "right")
    for r in rows:
        table.add_row(short_name(r["drafter"]), str(r["lookahead"]), r["hints"], str(r["tokens"]),
                      str(r["rounds"]),
                      _fmt(r["tokens_per_round"], ".2f"), _fmt(r.get("tokens_per_round_vs_none"), ".2f", "x"),
                      _fmt(r["acceptance_rate"], ".0%"), str(r["hint_tokens"]),
                      _fmt(r["passes_per_token"], ".3f"), _fmt(r["tokens_per_s"], ".1f"),
                      _fmt(r.get("tokens_per_s_vs_none"), ".2f", "x"), _lossless(r))
    return table


def _plot(sat_rows: list[dict], drafter_rows: list[dict], lookahead: int, path: Path, title: str) -> None:
    fig, (left, right) = subplots(2, figsize=(12, 4.5))
    metrics = ("passes_per_token", "tokens_per_round")
    step = 0.8 / len(sat_rows)
    for n, row in enumerate(sat_rows):
        values = [row[m] or 0.0 for m in metrics]
        offset = (n - (len(sat_rows) - 1) / 2) * step
        bars = left.bar([i + offset for i in range(len(metrics))], values, step, label=row["mode"])
        left.bar_label(bars, fmt="%.2f", fontsize=7)
    left.set_xticks(range(len(metrics)), ["passes / token", "tokens / step"])
    left.set(title="self-drafting vs plain (server side)")
    specs = list(dict.fromkeys(r["drafter"] for r in drafter_rows))
    width = 0.8 / len(LOOKAHEAD_SETTINGS)
    for n, name in enumerate(LOOKAHEAD_SETTINGS):
        values = [next(r["tokens_per_round"] or 0.0 for r in drafter_rows
                       if r["drafter"] == s and r["hints"] == name) for s in specs]
        offset = (n - 1) * width
        bars = right.bar([i + offset for i in range(len(specs))], values, width,
                         label=f"lookahead {lookahead}, hints {name}" if name != "none" else "no lookahead")
        right.bar_label(bars, fmt="%.2f", fontsize=8)
    right.set_xticks(range(len(specs)), [short_name(s) for s in specs])
    right.set(ylabel="tokens per round", title="drafting devices with SAT hints")
    save_figure(fig, (left, right), path, title)
