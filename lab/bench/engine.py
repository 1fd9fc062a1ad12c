"""`sled bench engine`: one verify step of the paged engine vs the padded fallback, as the
sessions' contexts grow.

Both engines run the same model over the same block pool layout; for each (sessions, context)
cell every session verifies a k-token draft in one step, the engines alternate repetition by
repetition, and the table gives the median step time of each and their ratio. The bytes of KV
each step writes or copies outside attention come from the engines' own counters.
"""
from __future__ import annotations

import statistics
import time

from lab.bench.overhead import percentile
from lab.report import save_figure, subplots, write_json


def _engines(model, budget_bytes: int, block_tokens: int):
    from verify_server.engine import make_engine

    return {kind: make_engine(model, kv_budget_bytes=budget_bytes, block_tokens=block_tokens, kind=kind)
            for kind in ("paged", "padded")}


def _fill(engine, sessions: int, context: int, k: int):
    """Sessions with `context` tokens of KV each, prefilled in chunks."""
    from verify_server.engine import Row

    kvs = []
    for s in range(sessions):
        kv = engine.new_kv()
        kv.admit([], context + k + 1)
        tokens = [(7 * s + 13 * i) % 250 + 3 for i in range(context)]
        for start in range(0, context, 512):
            engine.forward([Row(kv, tokens[start:start + 512], False)])
        kvs.append(kv)
    return kvs


def _step(engine, kvs, k: int) -> tuple[float, int]:
    from verify_server.engine import Row

    draft = list(range(5, 5 + k + 1))
    copied = engine.bytes_copied
    started = time.perf_counter()
    engine.forward([Row(kv, draft, True) for kv in kvs])
    elapsed = time.perf_counter() - started
    for kv in kvs:
        kv.truncate(kv.length - len(draft))
    return elapsed, engine.bytes_copied - copied


def run_engine_bench(args) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from lab.bench.overhead import default_target
    from sled.models import resolve_model
    from verify_server.blocks import KVShape
    from verify_server.target import Target

    console = Console()
    target = Target.load(resolve_model(args.model) if args.model else default_target(),
                         dtype=args.dtype, device=args.device)
    contexts = [int(c) for c in args.contexts.split(",")]
    sessions = [int(s) for s in args.sessions.split(",")]
    per_token = None
    cells = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("engine steps", total=len(contexts) * len(sessions))
        for n in sessions:
            for context in contexts:
                per_token = KVShape.of(target.model).bytes_per_token
                need = (n * (context + args.k + 1 + args.block_tokens) + args.block_tokens) * per_token
                engines = _engines(target.model, need, args.block_tokens)
                kvs = {kind: _fill(engine, n, context, args.k) for kind, engine in engines.items()}
                times = {kind: [] for kind in engines}
                copied = {}
                for rep in range(args.reps + 1):
                    for kind, engine in engines.items():
                        elapsed, moved = _step(engine, kvs[kind], args.k)
                        if rep:                     # the first pass warms up
                            times[kind].append(elapsed * 1e3)
                        copied[kind] = moved
                cells.append({
                    "sessions": n, "context": context, "k": args.k,
                    **{f"{kind}_ms_p50": statistics.median(t) for kind, t in times.items()},
                    **{f"{kind}_ms_p90": percentile(t, 90) for kind, t in times.items()},
                    **{f"{kind}_bytes_copied": copied[kind] for kind in engines},
                    "padded_over_paged": statistics.median(times["padded"]) / statistics.median(times["paged"]),
                })
                progress.update(task, advance=1)
    table = Table(title=f"verify step (k={args.k}): paged vs padded engine, {target.model_id} "
                        f"on {target.device}")
    for column in ("sessions", "context", "paged ms", "padded ms", "ratio", "paged copied",
                   "padded copied"):
        table.add_column(column, justify="right")
    for c in cells:
        table.add_row(str(c["sessions"]), str(c["context"]), f"{c['paged_ms_p50']:.2f}",
                      f"{c['padded_ms_p50']:.2f}", f"{c['padded_over_paged']:.2f}x",
                      _size(c["paged_bytes_copied"]), _size(c["padded_bytes_copied"]))
    console.print(table)
    result = {"model": target.model_id, "device": target.device, "dtype": target.dtype,
              "bytes_per_token": per_token, "reps": args.reps, "cells": cells}
    path = write_json(args.out, result)
    plot = _plot(cells, path.with_suffix(".png"), target.model_id)
    console.print(f"wrote {path} and {plot}")
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


def _plot(cells, path, model_id):
    fig, axes = subplots(1, figsize=(6, 4))
    axes = [axes]
    for n in sorted({c["sessions"] for c in cells}):
        row = [c for c in cells if c["sessions"] == n]
        for kind, style in (("paged", "-o"), ("padded", "--s")):
            axes[0].plot([c["context"] for c in row], [c[f"{kind}_ms_p50"] for c in row], style,
                         label=f"{kind}, {n} sessions")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("context tokens per session")
    axes[0].set_ylabel("verify step ms (p50)")
    return save_figure(fig, axes, path, f"engine step time, {model_id}")
