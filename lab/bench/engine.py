"""`sled bench engine`: one server step of each engine, as sessions and their contexts grow.

A step is what the server's scheduler runs (`verify_server.scheduler.verify_step`): the forward of
every session's draft, then `acceptance.decide` over the step's logits (one argmax, one copy of it
back to the host), ending with each session's verdict. The engines (`--engines`: paged, padded,
flex, and flex-graph: the flex engine with each bucket's forward and argmax replayed from a CUDA
graph; flex-graph-splits: flex-graph whose decode kernel splits each row for four programs a
multiprocessor (--flex-splits auto); flex-graph-overlap: flex-graph's steps timed in runs, each
launched before the last is decided, as the scheduler overlaps them; flex-compile: the same step
captured by torch.compile's reduce-overhead mode instead, the `capture="compile"` the flex engine
weighs against its own graphs; flex-graph-hf: flex-graph running transformers' own model forward
instead of sled's decoder forward) run the same model over one block pool and verify the very same
sessions. transformers-graph is the centralized baseline: transformers' forward over its own static
cache holding the same contexts, its forward and argmax captured in a CUDA graph
(lab/bench/static_step.py), the verdicts then decided from its argmax as the server decides greedy
rows. For each (sessions, context) cell every session verifies a k-token draft in one step
(`--kinds` adds the other kinds of step the server runs over the same sessions: decode, one token
each; sat, a verify row with SAT slots appended; prefill, the `--prefill` chunks at no context;
lab/bench/engine_steps.py; the baseline times verify steps only), the engines alternate repetition
by repetition, and the table gives the median step time of each, its ratio to the first engine's,
how many of the emitted tokens agree with the first engine's (bf16 ties are reported, not hidden),
and the seconds its first step took (compiling, capturing). The KV bytes each step writes or copies
outside attention come from the engines' own counters; on CUDA each cell also records the
allocations a warm step makes (`KIND_allocations`: 0 when captured).
`--shape` builds a real model shape with random weights where it runs (speed does not depend on
the values); `--bandwidth` adds the floor of a step (verify_server.roofline's): the streamed
weights plus the KV read over the bandwidth and, with `--peak-flops`, 2 x streamed parameters x
new tokens over the dense FLOP/s, the larger of the two; each engine's step is then also given as
a multiple of it. `--kernels` profiles a few more steps of each engine (torch.profiler) and
breaks each step's device time down by kernel type (GEMM, attention, elementwise, copies, other;
on a CPU the operators' time), a line per cell of each kind. The results file (and
`--write-profile`'s profile, each cell tagged with its kind, its rules fitted kind by kind and
the floor under them: verify_server.step_costs) is written after every cell, so a run cut short
keeps what it measured.

    sled bench engine --device cuda --dtype bfloat16 --shape llama-8b,gemma3-4b \
        --sessions 1,16,64 --contexts 512,2048 --bandwidth 3.35e12 --peak-flops 7.9e14 \
        --engines paged,flex,flex-graph,transformers-graph --kernels
    sled bench engine --device cuda --dtype bfloat16 --shape llama-8b --engines flex-graph \
        --kinds prefill,verify,decode,sat --sessions 1,16,64 --contexts 512,2048 \
        --bandwidth 4.8e12 --peak-flops 7.9e14 --kernels --write-profile profile.json
"""
from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import shlex
import statistics
import time

import numpy as np
import torch
import transformers
from torch.profiler import ProfilerActivity, profile
from rich.progress import Progress
from rich.table import Table
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM

from lab.bench import engine_steps, harness
from lab.bench.engine_steps import Group, StepSpec
from lab.bench.report import percentile, save_figure, subplots, write_json
from lab.bench.split import split_bench
from lab.bench.static_step import StaticCacheStep
from lab.tiny import cached_pair
from sled.flags import positive_float, positive_int
from sled.models import resolve_model
from verify_server.acceptance import decide, greedy_chain
from verify_server.engines import PaddedEngine, PagedEngine, make_engine
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server.engines.flex import FlexEngine
from verify_server.engines.flex_plan import StepLayout, plan_step, step_shape
from verify_server.engines.kv import SessionKV
from verify_server.engines.rows import Row
from verify_server.scheduler import verify_step
from verify_server.shapes import DESCRIBED_ONLY, SHAPES, streamed_parameters
from verify_server.step_costs import KINDS, StepCell, StepFloor, make_profile
from verify_server.target import Target


BUILT = [name for name in SHAPES if name not in DESCRIBED_ONLY]   # what --shape can build


def add_arguments(parser) -> None:
    harness.add_target_flags(parser, model_help="target alias or path (default: a tiny random "
                             "model)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda:0")
    parser.add_argument("--contexts", default="128,512,2048", type=harness.listed(positive_int),
                        help="context tokens per session")
    parser.add_argument("--sessions", default="1,8", type=harness.listed(positive_int),
                        help="sessions verifying in one step")
    harness.add_draft_len_flag(parser, help="draft tokens per session", old="-k")
    parser.add_argument("--block-tokens", type=positive_int, default=16, help="tokens per KV block")
    parser.add_argument("--reps", type=positive_int, default=5,
                        help="timed steps per engine and cell, interleaved")
    parser.add_argument("--engines", default="paged,padded",
                        type=harness.listed(_unknown("engine"), *ENGINE_KINDS),
                        help="engines to compare, the first is the reference "
                             f"({', '.join(ENGINE_KINDS)})")
    parser.add_argument("--shape", default=None, type=harness.listed(_unknown("shape"), *BUILT),
                        help=f"real model shapes with random weights ({', '.join(BUILT)}); "
                             "instead of --model")
    parser.add_argument("--bandwidth", type=positive_float, default=None, metavar="BYTES_PER_S",
                        help="device memory bandwidth, for the floor column (H100: 3.35e12)")
    parser.add_argument("--peak-flops", type=positive_float, default=None, metavar="FLOP_PER_S",
                        help="the device's dense matrix FLOP/s (e.g. 7.9e14 measured on an "
                             "H200): with --bandwidth, the floor is the larger of the two terms")
    parser.add_argument("--kernels", action="store_true",
                        help=f"profile {PROFILED_STEPS} more steps of each engine: device time a "
                             "step by kernel type (CPU: operator time) and kernels a step")
    parser.add_argument("--plan-only", action="store_true",
                        help="time only the flex engine's planner (host side, no model): "
                             "64 rows of 2048 tokens should plan in 1 ms")
    parser.add_argument("--kinds", default="verify", type=harness.listed(_unknown("kind"), *KINDS),
                        help="steps to time: verify (every session k + 1 tokens), decode (1 "
                             "token), sat (a verify row and --sat-slots SAT slots), prefill (the "
                             "--prefill chunks, at no context)")
    parser.add_argument("--prefill", default="1x512,1x2048,4x512", type=engine_steps.chunks,
                        help="prefill steps with --kinds prefill: ROWSxTOKENS, rows of that "
                             "many new tokens each")
    parser.add_argument("--sat-slots", type=positive_int, default=4,
                        help="SAT slots a sat row appends (the built-in adapter's 4)")
    parser.add_argument("--write-profile", default=None, metavar="FILE",
                        help="also write a step-cost profile of the first engine's steps (one "
                             "model; written again after every cell): what `sled serve --emulate "
                             "FILE` holds a server to")
    parser.add_argument("--tp", type=positive_int, default=1, metavar="N",
                        help="time one engine (paged or flex) of --model split over N ranks "
                             "(sled serve --tp N; N GPUs, or N CPU processes) against the whole "
                             "model on one device, side by side")
    harness.add_out_flag(parser, "engine")


def _unknown(what: str):
    """An item type that takes nothing: only the listed words pass."""
    def refuse(text: str):
        raise argparse.ArgumentTypeError(f"unknown {what} {text!r}")
    return refuse


ENGINE_KINDS = ("paged", "paged-hf", "padded", "flex", "flex-graph", "flex-graph-splits",
                "flex-graph-overlap",
                "flex-graph-masked", "flex-graph-hf", "flex-compile", "transformers-graph")
PROFILED_STEPS = 3           # --kernels: steps profiled per engine and cell
BASELINE = "transformers-graph"


def run(args) -> int:
    return harness.run_bench("engine", bench, args)


def _engines(model, budget_bytes: int, block_tokens: int, kinds, sat=None) -> dict:
    """Every sled engine over one pool (made before any KV is written: the flex engine zeroes
    it), so they verify the very same sessions; `sat`: the SATs of sat rows."""

    pool = make_engine(model, kv_budget_bytes=budget_bytes, block_tokens=block_tokens,
                       kind="padded").pool
    cuda = pool.keys[0].device.type == "cuda"
    made = {"paged": lambda: PagedEngine(model, pool, sat),
            "padded": lambda: PaddedEngine(model, pool, sat),
            # the paged engine on transformers' forward: what sled's forward changed on a CPU
            "paged-hf": lambda: PagedEngine(model, pool, sat, forward="transformers"),
            "flex": lambda: FlexEngine(model, pool, sat, graphs=False),
            # CUDA graphs where there is CUDA (a CPU dry run times the same call)
            "flex-graph": lambda: FlexEngine(model, pool, sat, graphs=cuda),
            # sled's forward, every block of the pool decided by the mask (no full blocks)
            "flex-graph-masked": lambda: FlexEngine(model, pool, sat, graphs=cuda,
                                                    full_blocks=False),
            # the engine before sled's forward and full blocks: transformers' model forward
            "flex-graph-hf": lambda: FlexEngine(model, pool, sat, graphs=cuda,
                                                forward="transformers", full_blocks=False),
            # the whole step through torch.compile's reduce-overhead mode (CPU: compiled only)
            "flex-compile": lambda: FlexEngine(model, pool, sat, graphs=True, capture="compile"),
            # flex-graph with --flex-splits auto: each row split for 4 programs a multiprocessor
            "flex-graph-splits": lambda: FlexEngine(model, pool, sat, graphs=cuda, splits="auto"),
            # flex-graph's steps as the overlapping scheduler runs them, a run at a time
            "flex-graph-overlap": lambda: Overlapped(FlexEngine(model, pool, sat, graphs=cuda))}
    engines = {}
    for kind in kinds:
        if kind != BASELINE:
            engines[kind] = _built(made[kind], kind)
    return engines


class Overlapped:
    """An engine (every other attribute is its own) whose step is timed as the scheduler runs
    steps where it overlaps them (verify_server.scheduler.advance): RUN_STEPS steps of the same
    rows back to back, each launched before the last one is decided, its argmax on its way to
    the host behind its kernels. Its time is the run's over RUN_STEPS: a step's wall time once the
    host's plan, launch and decision hide behind the device's kernels."""

    RUN_STEPS = 8

    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def run(self, rows, proposals) -> list:
        """The run's steps; the last step's outcomes."""
        pending = None
        for _ in range(self.RUN_STEPS):
            launched = self.engine.launch(rows, send_argmax=True)
            if pending is not None:
                decide(proposals, pending)
            pending = launched
        return decide(proposals, pending)


class FailedEngine:
    """An engine kind that raised: the cell reports its error, the other kinds go on."""

    def __init__(self, kind: str, exc: Exception) -> None:
        self.error = f"{type(exc).__name__}: {exc}"[:600]
        harness.bench_console().print(f"[red]{kind} failed: {self.error}[/red]")


def _built(make, kind: str):
    try:
        return make()
    except Exception as exc:     # one engine's failure must not cost the run the others
        return FailedEngine(kind, exc)


def _context(session: int, context: int) -> list[int]:
    """The tokens of one session's context, the same for every engine and the baseline."""
    return [(7 * session + 13 * i) % 250 + 3 for i in range(context)]


def _fill(engine, sessions: int, context: int, draft_len: int):
    """Sessions with `context` tokens of KV each, room for a verify row of a k-token draft."""
    return _filled(engine, sessions, context, draft_len + 1)


def _filled(engine, sessions: int, context: int, width: int):
    """Sessions with `context` tokens of KV each, prefilled in chunks, and room for `width`
    entries past it."""
    kvs = []
    for s in range(sessions):
        kv = engine.new_kv()
        kv.admit([], context + width, tenant=b"")
        tokens = _context(s, context)
        for start in range(0, context, 512):
            chunk = tokens[start:start + 512]
            engine.forward([Row(kv, chunk, False)])
            kv.commit(len(chunk))
        kvs.append(kv)
    return kvs


def _step(engine, kvs, draft_len: int) -> tuple[float, int, int | None, list]:
    """One timed verify step of a k-token draft a session (see _timed_step)."""
    return _timed_step(engine, kvs, StepSpec("verify", len(kvs), draft_len + 1, 0))


def _timed_step(engine, kvs, spec: StepSpec) -> tuple[float, int, int | None, list]:
    """One timed step, as the server runs it: seconds, KV bytes moved, the device allocations
    it made (CUDA's allocator count; None elsewhere), and each row's emitted tokens (none for
    a prefill chunk). Nothing is committed: a draft is all rejected, a chunk written again."""
    rows = spec.step_rows(kvs)
    proposals = spec.proposals(rows)
    engine.activate()
    copied = engine.bytes_copied
    _sync(engine)
    allocations = _allocations(engine)
    started = time.perf_counter()
    if isinstance(engine, StaticCacheStep):
        outcomes = [greedy_chain(ids, p.draft) for ids, p in zip(engine.greedy(rows), proposals)]
    elif isinstance(engine, Overlapped):
        outcomes = engine.run(rows, proposals)
    else:
        outcomes = verify_step(engine, rows, proposals)     # ends with its copy to the host
    elapsed = (time.perf_counter() - started) / _steps_a_call(engine)
    made = _allocations(engine)
    if hasattr(engine, "rewind"):       # the baseline's cache: back to the contexts alone
        engine.rewind()
    made = None if made is None else made - allocations
    emitted = [o.emitted if o is not None else [] for o in outcomes]
    return elapsed, (engine.bytes_copied - copied) // _steps_a_call(engine), made, emitted


def _allocations(engine) -> int | None:
    """Device memory allocations made so far (CUDA), None where the allocator keeps no count."""
    if engine.device.type != "cuda":
        return None
    return torch.cuda.memory_stats(engine.device).get("allocation.all.allocated", 0)


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def bench(args) -> int:
    console = harness.bench_console()
    if args.plan_only:
        return plan_bench(args, console)
    if args.tp > 1:
        return split_bench(args, _fill, _step, _agreement)
    kinds = harness.split_list(args.engines, str)
    targets = harness.split_list(args.shape, str) if args.shape else [None]
    if args.write_profile and len(targets) > 1:
        raise harness.Stop("--write-profile: a profile is one model's: give one --shape",
                           harness.BAD_FLAGS)
    planned = engine_steps.groups(
        harness.split_list(args.kinds, str), harness.split_list(args.sessions, int),
        harness.split_list(args.contexts, int), args.draft_len, args.sat_slots, args.prefill)
    results = {"device": args.device, "dtype": args.dtype, "engines": kinds, "reps": args.reps,
               "k": args.draft_len, "block_tokens": args.block_tokens, "models": []}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("engine steps", total=len(targets) * len(planned))
        for shape in targets:
            model, model_id, device_name = _model(args, shape)
            entry = _entry(model, shape, model_id, device_name, args)
            results["models"].append(entry)
            for group in planned:
                entry["cells"].extend(_group(model, shape, group, args, kinds))
                write_json(args.out, results)      # what is measured so far
                _save_profile(results, args)
                progress.update(task, advance=1)
            console.print(_table(entry, kinds, args))
            if args.kernels:
                console.print(_kernel_table(entry, kinds, args))
            del model
    harness.write_results(console, args.out, results, lambda png: _plot(results, png))
    if args.write_profile:
        _report_profile(console, results, args)
    return harness.DONE


def _entry(model, shape: str | None, model_id: str, device_name: str, args) -> dict:
    """What a model's cells are measured on: its weights and KV a token, the GPU's memory, and
    the floor a step has there (with --bandwidth)."""
    floor = _step_floor(model, shape, args)
    return {"model": model_id, "device_name": device_name,
            "bytes_per_token": _bytes_per_token(model), "weight_bytes": _weight_bytes(model),
            "memory_bytes": _memory_bytes(args.device),
            **({"floor": floor.to_json()} if floor is not None else {}), "cells": []}


def _save_profile(results: dict, args) -> None:
    """--write-profile, of the cells measured so far (a run cut short keeps a profile); where
    they make none yet (a larger step measured faster), the last one stays."""
    if args.write_profile:
        try:
            step_profile(results, args).save(args.write_profile)
        except ValueError:
            pass


def _report_profile(console, results: dict, args) -> None:
    """The profile of every cell, written, and where its rules fall under the floor; exit 1
    (LOSSY) when the cells make none on a GPU (on a CPU, a line: its timings are noise)."""
    try:
        profile = step_profile(results, args)
    except ValueError as exc:       # e.g. noise made a larger step faster
        if args.device == "cpu":    # a shared CPU's noise, and no GPU's profile to lose
            console.print(f"[yellow]--write-profile: no new profile written: {exc}; on a CPU "
                          "this is the machine's noise (rerun with more --reps)[/]")
            return
        raise harness.Stop(f"--write-profile: no profile written: {exc}; rerun with more "
                           "--reps", harness.LOSSY)
    console.print(f"wrote the step-cost profile of {results['engines'][0]} to "
                  f"{profile.save(args.write_profile)} (rules within "
                  f"{profile.worst_fit():.0%} of every cell)", highlight=False)
    for note in profile.floored:
        console.print(f"[yellow]its rules fall under the floor for {note}: such steps are "
                      "charged the floor[/]")


def step_profile(results: dict, args):
    """The first engine's median steps as a step-cost profile, with where they were measured
    and what the GPU holds (its memory, the model's weights and KV per token)."""
    entry, kind = results["models"][0], results["engines"][0]
    failed = [c for c in entry["cells"] if f"{kind}_ms_p50" not in c]
    if failed:
        raise ValueError(f"{kind} failed in {len(failed)} cells")
    cells = [StepCell(c["sessions"], c.get("tokens", c["k"] + 1), c["context"],
                      round(c[f"{kind}_ms_p50"], 3), c.get("kind", "verify"))
             for c in entry["cells"]]
    name = f"{entry['device_name']}-{entry['model']}-{kind}".lower().replace(" ", "-")
    sat = [c for c in cells if c.kind == "sat"]
    return make_profile(name, {
        "device": entry["device_name"], "model": entry["model"], "dtype": args.dtype,
        "engine": f"sled's {kind} engine" if kind != BASELINE else
                  "transformers forward over its static KV cache, captured in a CUDA graph",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "date": datetime.date.today().isoformat(), "command": _command(args),
        **({"note": f"sat cells: k + 1 tokens and {args.sat_slots} SAT slots a row, the "
                    f"slots' embeddings those of ids 1..{args.sat_slots} of the model's input "
                    "table (no LoRA deltas)"} if sat else {})}, cells, gpu={
        **({"memory_bytes": entry["memory_bytes"]} if entry.get("memory_bytes") else {}),
        "weight_bytes": entry["weight_bytes"], "kv_bytes_per_token": entry["bytes_per_token"]},
        floor=StepFloor.from_json(entry["floor"], name) if "floor" in entry else None)


def _command(args) -> str:
    """The command that measures these cells again."""
    what = ["--shape", args.shape] if args.shape else (["--model", args.model] if args.model
                                                         else [])
    return shlex.join(["sled", "bench", "engine", *what, "--device", args.device, "--dtype",
                       args.dtype, "--sessions", args.sessions, "--contexts", args.contexts,
                       "--draft-len", str(args.draft_len), "--block-tokens", str(args.block_tokens),
                       "--engines", args.engines, "--reps", str(args.reps), "--kinds", args.kinds,
                       *(["--prefill", args.prefill] if "prefill" in args.kinds else []),
                       *(["--sat-slots", str(args.sat_slots)] if "sat" in args.kinds else []),
                       *(["--bandwidth", f"{args.bandwidth:g}"] if args.bandwidth else []),
                       *(["--peak-flops", f"{args.peak_flops:g}"] if args.peak_flops else [])])


def plan_bench(args, console) -> int:
    """The flex planner alone: sessions with block tables of `context` tokens (no KV written),
    one verify row each, planned into their bucket's host buffer; median ms over --reps."""
    cells = []
    table = Table(title=f"flex planner, one core (k={args.draft_len}, "
                        f"{args.block_tokens}-token blocks)")
    for column in ("sessions", "context", "plan ms p50", "plan ms p90"):
        table.add_column(column, justify="right")
    for n in harness.split_list(args.sessions, int):
        for context in harness.split_list(args.contexts, int):
            bt = args.block_tokens
            blocks = n * (-(-(context + args.draft_len + 1) // bt) + 1) + 2
            pool = BlockPool(KVShape(1, 1, 1, torch.float32), blocks, bt)
            kvs = []
            for _ in range(n):
                kv = SessionKV(pool)
                kv.admit([], context + args.draft_len + 1, b"")
                kv.slots(0, context)
                kv.commit(context)
                kvs.append(kv)
            rows = [Row(kv, list(range(5, 6 + args.draft_len)), True) for kv in kvs]
            # each row lists its own blocks (the CUDA engine's kv width: a row's context limit)
            layout = StepLayout(step_shape([row.width for row in rows]),
                                -(-(context + args.draft_len + 1) // bt), pool.num_blocks)
            host = layout.views(np.zeros(layout.size, dtype=np.int32))
            times = []
            for _ in range(args.reps + 1):
                started = time.perf_counter()
                plan_step(rows, layout, host, bt, 0)
                times.append((time.perf_counter() - started) * 1e3)
            times = times[1:]
            cells.append({"sessions": n, "context": context,
                          "plan_ms_p50": statistics.median(times),
                          "plan_ms_p90": percentile(times, 90)})
            table.add_row(str(n), str(context), f"{cells[-1]['plan_ms_p50']:.3f}",
                          f"{cells[-1]['plan_ms_p90']:.3f}")
    console.print(table)
    harness.write_results(console, args.out, {"planner": cells, "block_tokens": args.block_tokens,
                                               "k": args.draft_len, "reps": args.reps})
    return harness.DONE


def _model(args, shape: str | None):
    """(model, its name, the device's name): a real shape with random weights, or a target."""
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if shape is None:
        target = Target.load(resolve_model(args.model) if args.model else cached_pair()[0],
                             dtype=args.dtype, device=args.device)
        return target.model, target.model_id, name

    kind, fields = SHAPES[shape]
    config = AutoConfig.for_model(kind, **fields)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    return model.eval(), shape, name


def _memory_bytes(device: str) -> int | None:
    """The GPU's memory (None on a CPU: a profile measured there holds no GPU's KV)."""
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _bytes_per_token(model) -> int:
    return KVShape.of(model).bytes_per_token


def _group(model, shape: str | None, group: Group, args, kinds) -> list[dict]:
    """Every engine over one pool holding the group's sessions, filled once: a cell for each of
    its steps."""
    per_token = _bytes_per_token(model)
    tokens = group.sessions * (group.context + group.width + args.block_tokens) + args.block_tokens
    sat = engine_steps.sat_spec(model, args.sat_slots) \
        if any(step.kind == "sat" for step in group.steps) else None
    made = _engines(model, tokens * per_token, args.block_tokens, kinds, sat)
    errors = {kind: e.error for kind, e in made.items() if isinstance(e, FailedEngine)}
    made = {kind: e for kind, e in made.items() if kind not in errors}
    kvs = [None] * group.sessions       # the baseline alone needs no sled session
    if made:
        filler = next(iter(made.values()))
        filler.activate()
        kvs = _filled(filler, group.sessions, group.context, group.width)
    cells = [_cell(model, shape, step, kvs, made, dict(errors), args, kinds)
             for step in group.steps]
    del made
    _release(model)
    return cells


def _cell(model, shape: str | None, step: StepSpec, kvs, made: dict, errors: dict, args,
          kinds) -> dict:
    """Every engine on one step: step times, agreement, bytes moved (and the floor, and each
    engine's kernels, where asked). The baseline times verify steps only."""
    engines = {kind: made[kind] for kind in kinds if kind in made}
    if BASELINE in kinds and step.kind == "verify":
        baseline = _built(lambda: _baseline(model, step.rows, step.context, step.width,
                                            _bytes_per_token(model)), BASELINE)
        if isinstance(baseline, FailedEngine):
            errors[BASELINE] = baseline.error
        else:
            engines = {kind: baseline if kind == BASELINE else made[kind]
                       for kind in kinds if kind in made or kind == BASELINE}
    skips = _cudagraph_skips()
    times, first_s, copied, allocations, ids = _repetitions(engines, kvs, step, args.reps, errors)
    medians = {kind: statistics.median(t) for kind, t in times.items()}
    reference = next(iter(times), kinds[0])
    cell = {
        "kind": step.kind, "sessions": step.rows, "tokens": step.width, "context": step.context,
        "k": args.draft_len, **({"sat_slots": step.sat_slots} if step.sat_slots else {}),
        **{f"{kind}_ms_p50": medians[kind] for kind in times},
        **{f"{kind}_ms_p90": percentile(t, 90) for kind, t in times.items()},
        **{f"{kind}_bytes_copied": copied[kind] for kind in times},
        **{f"{kind}_first_step_s": first_s[kind] for kind in times},
        # once warm, a captured step should allocate nothing (the last repetition's count)
        **{f"{kind}_allocations": allocations[kind] for kind in times},
        # the step graphs a flex engine holds after the cell, and about their memory
        **{f"{kind}_{key}": value for kind in times if hasattr(engines[kind], "graph_memory")
           for key, value in engines[kind].graph_memory().to_json().items()},
        **{f"{kind}_over_{reference}": medians[kind] / medians[reference] for kind in times},
        **{f"{kind}_emitted_agree": _agreement(ids[kind], ids[reference]) for kind in times},
        **({"errors": errors} if errors else {}),
    }
    if "flex-compile" in kinds:         # steps inductor ran without its CUDA graphs, this cell
        cell["cudagraph_skips"] = _cudagraph_skips() - skips
    floor = _step_floor(model, shape, args)
    if floor is not None:
        cell.update(_floor_terms(floor, step, args))
        cell.update({f"{kind}_over_floor": medians[kind] / cell["floor_ms"] for kind in times})
    if args.kernels:
        for kind in times:
            cell[f"{kind}_kernels"] = _kernels(engines[kind], kvs, step)
    return cell


def _repetitions(engines: dict, kvs, step: StepSpec, reps: int, errors: dict) -> tuple:
    """The engines alternating repetition by repetition, the first pass a warm-up (compiles,
    captures): (ms of each timed step, first step's seconds, KV bytes moved, allocations,
    emitted tokens), by engine; an engine that raises is reported in `errors` and dropped."""
    times = {kind: [] for kind in engines}
    first_s, copied, allocations, ids = {}, {}, {}, {}
    for rep in range(reps + 1):
        for kind, engine in list(engines.items()):
            if kind not in times:
                continue
            try:
                elapsed, moved, allocations[kind], ids[kind] = _timed_step(engine, kvs, step)
            except Exception as exc:    # reported in the cell; the other engines go on
                errors[kind] = FailedEngine(kind, exc).error
                del times[kind]
                continue
            if rep:
                times[kind].append(elapsed * 1e3)
            else:
                first_s[kind] = round(elapsed, 2)
            copied[kind] = moved
    return times, first_s, copied, allocations, ids


def _step_floor(model, shape: str | None, args) -> StepFloor | None:
    """The floor of a step on the flags' device (verify_server.roofline's terms): the streamed
    weights and the KV read over --bandwidth, 2 x streamed parameters a new entry over
    --peak-flops; None without --bandwidth."""
    if not args.bandwidth:
        return None
    streamed = _streamed_parameters(model, shape)
    return StepFloor(bandwidth=args.bandwidth, weight_bytes=streamed * _element_bytes(model),
                     kv_bytes_per_token=_bytes_per_token(model), flops_per_token=2.0 * streamed,
                     peak_flops=args.peak_flops,
                     source=f"--bandwidth {args.bandwidth:g}" +
                            (f" --peak-flops {args.peak_flops:g}" if args.peak_flops else ""))


def _floor_terms(floor: StepFloor, step: StepSpec, args) -> dict:
    """The step's floor in ms: its bytes' term, its FLOPs' term (with --peak-flops) and the
    larger of the two."""
    new, read = step.rows * step.width, step.rows * (step.context + step.width)
    bytes_ms, flops_ms = floor.terms(new, read)
    terms = {"floor_bytes_ms": bytes_ms}
    if args.peak_flops:
        terms["floor_flops_ms"] = flops_ms
    return {**terms, "floor_ms": max(terms.values())}


def _streamed_parameters(model, shape: str | None) -> int:
    """Parameters a step reads in full: verify_server.shapes' count for a named shape; for a
    loaded target, its parameters less the input embedding table unless lm_head is that table."""
    if shape is not None:
        return streamed_parameters(shape)
    table = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is table
    return sum(p.numel() for p in model.parameters()) - (0 if tied else table.numel())


def _element_bytes(model) -> int:
    return next(model.parameters()).element_size()


# --kernels: a kernel's (or, on a CPU, an operator's) type by the words in its name, first match
KERNEL_TYPES = (
    ("attention", ("flex", "attention", "attn", "sdpa", "flash", "fmha")),
    ("gemm", ("gemm", "gemv", "splitkreduce", "cutlass", "cublas", "xmma", "nvjet", "aten::mm",
              "aten::addmm", "aten::bmm", "aten::_scaled_mm", "mkldnn_matmul")),
    ("copies", ("memcpy", "memset", "copy")),
    ("elementwise", ("triton_", "elementwise", "reduce", "aten::")),
)
KERNEL_COLUMNS = (*(kind for kind, _ in KERNEL_TYPES), "other")


def kernel_type(name: str) -> str:
    """gemm, attention, elementwise, copies or other (see KERNEL_TYPES)."""
    name = name.lower()
    for kind, words in KERNEL_TYPES:
        if any(word in name for word in words):
            return kind
    return "other"


def _kernels(engine, kvs, step: StepSpec) -> dict:
    """PROFILED_STEPS more steps of the engine under torch.profiler: ms a step by kernel type
    and kernels a step (CUDA's kernels, a CPU's operators); {"error": ...} where the profiler
    gives none (no CUPTI, say) or fails."""
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    try:
        with profile(activities=activities) as prof:
            for _ in range(PROFILED_STEPS):
                _timed_step(engine, kvs, step)
        events = _timed_events(prof, cuda)
    except Exception as exc:        # a profiler that cannot run here must not end the bench
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not events:
        return {"error": f"the profiler recorded no {'CUDA kernels' if cuda else 'operators'}"}
    ms = dict.fromkeys(KERNEL_COLUMNS, 0.0)
    steps = PROFILED_STEPS * _steps_a_call(engine)
    for name, us in events:
        ms[kernel_type(name)] += us / 1e3 / steps
    return {"source": "cuda kernels" if cuda else "cpu operators", "steps": steps,
            **{f"{kind}_ms": round(t, 4) for kind, t in ms.items()},
            "total_ms": round(sum(ms.values()), 4), "count": len(events) / steps}


def _steps_a_call(engine) -> int:
    """Steps one timed call runs: a run of them for an overlapped engine, else one."""
    return Overlapped.RUN_STEPS if isinstance(engine, Overlapped) else 1


def _timed_events(prof, cuda: bool) -> list[tuple[str, float]]:
    """(name, self µs) of each kernel the profile recorded (CUDA), or each operator (CPU: its
    self time, so a parent does not count its children's)."""
    if cuda:
        return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.name, e.self_cpu_time_total) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0]


def _cudagraph_skips() -> int:
    return counters["inductor"]["cudagraph_skips"]


def _baseline(model, sessions: int, context: int, width: int, per_token: int):
    return StaticCacheStep(model, sessions, context, width, _context, per_token,
                           graphs=model.device.type == "cuda")


def _release(model) -> None:
    """Give the cell's pool, cache and graphs back before the next cell's are made."""
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def _agreement(mine: list[list[int]], reference: list[list[int]]) -> str:
    same = sum(a == b for row, ref in zip(mine, reference) for a, b in zip(row, ref))
    return f"{same}/{sum(len(row) for row in reference)}"


def _table(entry: dict, kinds, args):
    """A line per cell and engine (any number of engines fits the width)."""
    reference = kinds[0]
    table = Table(title=f"server steps (k={args.draft_len}) against {reference}: "
                        f"{entry['model']} on {entry['device_name']} ({args.dtype})")
    floor = ["floor ms", "x floor"] if args.bandwidth else []
    for column in (*WHERE, "engine", "ms p50", f"/ {reference}", "emitted agrees", "KV copied",
                   "first step s", *floor):
        table.add_column(column, justify="left" if column in ("kind", "engine") else "right")
    for c in entry["cells"]:
        timed = _timed_kinds(c, kinds)
        for kind in timed:
            first, last = kind == timed[0], kind == timed[-1]
            where = [*_where(c, first), kind]
            if f"{kind}_ms_p50" not in c:
                table.add_row(*where, "failed", c.get("errors", {}).get(kind, "")[:60],
                              end_section=last)
                continue
            over = (f"{c[f'{kind}_ms_p50'] / c[f'{reference}_ms_p50']:.2f}x"
                    if f"{reference}_ms_p50" in c else "")
            table.add_row(*where, f"{c[f'{kind}_ms_p50']:.2f}", over,
                          c[f"{kind}_emitted_agree"], _size(c[f"{kind}_bytes_copied"]),
                          f"{c[f'{kind}_first_step_s']:.2f}",
                          *([f"{c['floor_ms']:.2f}" if first else "",
                             f"{c[f'{kind}_over_floor']:.2f}x"] if args.bandwidth else []),
                          end_section=last)
    return table


def _kernel_table(entry: dict, kinds, args):
    """Each engine's step by kernel type (ms a step), from --kernels, a line per cell of each
    kind (prefill, verify, decode, sat): what the next run compares kind by kind."""
    table = Table(title=f"kernels a server step (k={args.draft_len}, {PROFILED_STEPS} steps "
                        f"profiled): {entry['model']} on {entry['device_name']}")
    for column in (*WHERE, "engine", *(f"{c} ms" for c in KERNEL_COLUMNS), "kernels"):
        table.add_column(column, justify="left" if column in ("kind", "engine") else "right")
    for c in sorted(entry["cells"], key=lambda c: KINDS.index(c.get("kind", "verify"))):
        timed = _timed_kinds(c, kinds)
        for kind in timed:
            first, last = kind == timed[0], kind == timed[-1]
            got = c.get(f"{kind}_kernels", {"error": "the engine failed"})
            where = [*_where(c, first), kind]
            if "error" in got:
                table.add_row(*where, got["error"], *[""] * len(KERNEL_COLUMNS), end_section=last)
                continue
            table.add_row(*where, *(f"{got[f'{col}_ms']:.3f}" for col in KERNEL_COLUMNS),
                          f"{got['count']:.0f}", end_section=last)
    return table


WHERE = ("kind", "sessions", "tokens", "context")     # a cell's first columns


def _where(cell: dict, first: bool) -> list[str]:
    """A cell's kind, sessions, tokens a session and context, on its first engine's line."""
    if not first:
        return [""] * len(WHERE)
    return [cell.get("kind", "verify"), str(cell["sessions"]),
            str(cell.get("tokens", cell["k"] + 1)), str(cell["context"])]


def _timed_kinds(cell: dict, kinds) -> list[str]:
    """The engines a cell times: all, but the baseline only for verify steps."""
    return [k for k in kinds if k != BASELINE or cell.get("kind", "verify") == "verify"]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


def _plot(results: dict, path):
    models = results["models"]
    fig, axes = subplots(len(models), figsize=(6, 4 * len(models)))
    axes = list(axes) if len(models) > 1 else [axes]
    styles = ("-o", "--s", "-.^", ":v")
    for ax, entry in zip(axes, models):
        cells = [c for c in entry["cells"] if c.get("kind", "verify") == "verify"]
        for n in sorted({c["sessions"] for c in cells}):
            row = [c for c in cells if c["sessions"] == n]
            for kind, style in zip(results["engines"], itertools.cycle(styles)):
                done = [c for c in row if f"{kind}_ms_p50" in c]
                ax.plot([c["context"] for c in done], [c[f"{kind}_ms_p50"] for c in done], style,
                        label=f"{kind}, {n} sessions")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens per session")
        ax.set_ylabel("verify step ms (p50)")
        ax.set_title(f"{entry['model']} on {entry['device_name']}")
    return save_figure(fig, axes, path, "engine step time")


def main(argv=None) -> int:
    """`python -m lab.bench.engine FLAGS`: the same bench outside the `sled` command, whose
    other commands need the whole install: here torch, transformers, numpy, rich and
    matplotlib are enough (a GPU box's own Python, with the repository on PYTHONPATH)."""

    parser = argparse.ArgumentParser(prog="python -m lab.bench.engine",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
