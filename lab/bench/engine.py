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

from lab.bench import harness
from lab.bench.report import percentile, save_figure, subplots


def add_arguments(parser) -> None:
    from sled_cli.flags import positive_int

    parser.add_argument("--model", default=None,
                        help="target alias or path (default: a tiny random model)")
    parser.add_argument("--dtype", default="float32", help="the target's dtype")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda:0")
    parser.add_argument("--contexts", default="128,512,2048", type=harness.listed(positive_int),
                        help="context tokens per session")
    parser.add_argument("--sessions", default="1,8", type=harness.listed(positive_int),
                        help="sessions verifying in one step")
    parser.add_argument("-k", dest="draft_len", type=positive_int, default=4,
                        help="draft tokens per session (k)")
    parser.add_argument("--block-tokens", type=positive_int, default=16, help="tokens per KV block")
    parser.add_argument("--reps", type=positive_int, default=5,
                        help="timed steps per engine and cell, interleaved")
    harness.add_out_flag(parser, "engine")


def run(args) -> int:
    return harness.run_bench("engine", bench, args)


def _engines(model, budget_bytes: int, block_tokens: int):
    from verify_server.engine import make_engine

    return {kind: make_engine(model, kv_budget_bytes=budget_bytes, block_tokens=block_tokens, kind=kind)
            for kind in ("paged", "padded")}


def _fill(engine, sessions: int, context: int, draft_len: int):
    """Sessions with `context` tokens of KV each, prefilled in chunks."""
    from verify_server.engine import Row

    kvs = []
    for s in range(sessions):
        kv = engine.new_kv()
        kv.admit([], context + draft_len + 1, tenant=b"")
        tokens = [(7 * s + 13 * i) % 250 + 3 for i in range(context)]
        for start in range(0, context, 512):
            chunk = tokens[start:start + 512]
            engine.forward([Row(kv, chunk, False)])
            kv.commit(len(chunk))
        kvs.append(kv)
    return kvs


def _step(engine, kvs, draft_len: int) -> tuple[float, int]:
    from verify_server.engine import Row

    draft = list(range(5, 5 + draft_len + 1))
    copied = engine.bytes_copied
    started = time.perf_counter()
    engine.forward([Row(kv, draft, True) for kv in kvs])   # nothing committed: all rejected
    elapsed = time.perf_counter() - started
    return elapsed, engine.bytes_copied - copied


def bench(args) -> int:
    from rich.progress import Progress

    from lab.tiny import cached_pair
    from sled.models import resolve_model
    from verify_server.target import Target

    console = harness.bench_console()
    target = Target.load(resolve_model(args.model) if args.model else cached_pair()[0],
                         dtype=args.dtype, device=args.device)
    contexts = harness.split_list(args.contexts, int)
    sessions = harness.split_list(args.sessions, int)
    cells = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("engine steps", total=len(contexts) * len(sessions))
        for n in sessions:
            for context in contexts:
                cells.append(_cell(target.model, n, context, args))
                progress.update(task, advance=1)
    console.print(_table(cells, target, args.draft_len))
    harness.write_results(console, args.out, {
        "model": target.model_id, "device": target.device, "dtype": target.dtype,
        "bytes_per_token": _bytes_per_token(target.model), "reps": args.reps, "cells": cells},
        lambda png: _plot(cells, png, target.model_id))
    return harness.DONE


def _bytes_per_token(model) -> int:
    from verify_server.blocks import KVShape

    return KVShape.of(model).bytes_per_token


def _cell(model, n: int, context: int, args) -> dict:
    """Both engines on n sessions of `context` tokens: step times and bytes moved."""
    per_token = _bytes_per_token(model)
    tokens = n * (context + args.draft_len + 1 + args.block_tokens) + args.block_tokens
    need = tokens * per_token
    engines = _engines(model, need, args.block_tokens)
    kvs = {kind: _fill(engine, n, context, args.draft_len) for kind, engine in engines.items()}
    times = {kind: [] for kind in engines}
    copied = {}
    for rep in range(args.reps + 1):
        for kind, engine in engines.items():
            elapsed, moved = _step(engine, kvs[kind], args.draft_len)
            if rep:                     # the first pass warms up
                times[kind].append(elapsed * 1e3)
            copied[kind] = moved
    return {
        "sessions": n, "context": context, "k": args.draft_len,
        **{f"{kind}_ms_p50": statistics.median(t) for kind, t in times.items()},
        **{f"{kind}_ms_p90": percentile(t, 90) for kind, t in times.items()},
        **{f"{kind}_bytes_copied": copied[kind] for kind in engines},
        "padded_over_paged": statistics.median(times["padded"]) / statistics.median(times["paged"]),
    }


def _table(cells: list[dict], target, draft_len: int):
    from rich.table import Table

    table = Table(title=f"verify step (k={draft_len}): paged vs padded engine, "
                        f"{target.model_id} on {target.device}")
    for column in ("sessions", "context", "paged ms", "padded ms", "ratio", "paged copied",
                   "padded copied"):
        table.add_column(column, justify="right")
    for c in cells:
        table.add_row(str(c["sessions"]), str(c["context"]), f"{c['paged_ms_p50']:.2f}",
                      f"{c['padded_ms_p50']:.2f}", f"{c['padded_over_paged']:.2f}x",
                      _size(c["paged_bytes_copied"]), _size(c["padded_bytes_copied"]))
    return table


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
