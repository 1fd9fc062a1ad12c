"""`sled bench engine --tp N`: the verify step of a target split over N ranks against the same
target whole on one device, side by side in one run.

The bench is rank 0 of N ranks (verify_server.ranks: it starts the others, each running the same
command): every rank loads its shard of `--model` and builds the first `--engines` kind over its
pool, led by rank 0 as `sled serve --tp N` leads them. Rank 0 also loads the whole model on its
own device, with an engine of the same kind. For each (sessions, context) cell both verify the
same drafts of the same contexts, repetition by repetition alternating, and the table gives the
median step of each, their ratio and how many emitted tokens agree. A model that fits one GPU
is what this compares on; one that needs N GPUs has no single-GPU step to compare with.

    sled bench engine --model /models/llama-3.1-8b --device cuda --dtype bfloat16 --tp 2 \\
        --engines flex-graph --sessions 1,16,64 --contexts 512,2048
"""
from __future__ import annotations

import statistics
import sys

from rich.table import Table

from lab.bench import harness
from lab.bench.report import percentile, write_json
from sled.models import resolve_model
from verify_server.engines import make_engine
from verify_server.engines.blocks import KVShape
from verify_server.engines.sharded import Channel, LeadingEngine
from verify_server.follower import follow_leader
from verify_server.ranks import start_ranks
from verify_server.target import Target, check_splittable

# the engines a split server runs (`sled serve --engine`: flex with CUDA graphs on a GPU)
KINDS = ("paged", "flex")


def split_bench(args, fill, step, agreement) -> int:
    """Rank 0: the table of one device against --tp ranks (results in args.out); another rank:
    rank 0's steps until it is done. `fill`, `step`, `agreement`: the engine bench's own
    (sessions filled, one timed verify step, emitted tokens compared)."""
    kind = _kind(args)
    model_id = resolve_model(args.model)
    try:
        check_splittable(model_id, args.tp)
    except ValueError as exc:
        raise harness.Stop(f"--tp {args.tp}: {exc}", harness.BAD_FLAGS)
    ranks = start_ranks(args.tp, args.device, sys.argv[1:])
    shard = Target.load(model_id, dtype=args.dtype, device=ranks.device, tp=args.tp)
    if not ranks.leads:
        follow_leader(shard, ranks, **_follower_limits(kind, args))
        ranks.end()
        return harness.DONE
    whole = Target.load(model_id, dtype=args.dtype, device=ranks.device).model
    budget = _budget(whole, args)
    ranks.kv_budget(ranks.device, 0.0)      # the others ask it first, as of a server's rank 0
    split = LeadingEngine(_engine(shard.model, budget, kind, args), Channel(ranks.group))
    one = _engine(whole, budget, kind, args)
    results = {"model": shard.model_id, "device": args.device, "dtype": args.dtype,
               "tp": args.tp, "engine": args.engines, "k": args.draft_len, "reps": args.reps,
               # whose forward the split ranks run: sled's decoder, or transformers'
               "forward": "sled" if split.sled_forward else "transformers", "cells": []}
    console = harness.bench_console()
    try:
        for n in harness.split_list(args.sessions, int):
            for context in harness.split_list(args.contexts, int):
                results["cells"].append(_cell({"one": one, "split": split}, n, context, args,
                                              fill, step, agreement))
                write_json(args.out, results)
    finally:
        split.close()
        ranks.end()
    console.print(_table(results))
    harness.write_results(console, args.out, results)
    return harness.DONE


def _kind(args) -> str:
    kinds = harness.split_list(args.engines, str)
    if len(kinds) != 1 or kinds[0] not in KINDS:
        raise harness.Stop(f"--tp {args.tp} times one engine of a split server: give --engines "
                           f"{' or '.join(KINDS)}", harness.BAD_FLAGS)
    if not args.model or args.shape:
        raise harness.Stop(f"--tp {args.tp} splits a checkpoint: give --model (a --shape has "
                           "random weights made in each process)", harness.BAD_FLAGS)
    return kinds[0]


def _follower_limits(kind: str, args) -> dict:
    """What another rank takes from rank 0 here: a step of every session's verify rows, or a
    prefill chunk of a context at most."""
    rows = max(harness.split_list(args.sessions, int))
    tokens = max(harness.split_list(args.contexts, int)) + args.draft_len + 1
    return {"max_rows": rows, "max_step_tokens": tokens, "block_tokens": args.block_tokens,
            "engine": kind}


def _budget(model, args) -> int:
    """The whole server's KV bytes: the largest cell's sessions, with room for the drafts."""
    n = max(harness.split_list(args.sessions, int))
    context = max(harness.split_list(args.contexts, int))
    tokens = n * (context + args.draft_len + 1 + args.block_tokens) + args.block_tokens
    return tokens * KVShape.of(model).bytes_per_token


def _engine(model, budget: int, kind: str, args):
    return make_engine(model, kv_budget_bytes=budget, block_tokens=args.block_tokens, kind=kind)


def _cell(engines: dict, n: int, context: int, args, fill, step, agreement) -> dict:
    """Both engines on n sessions of `context` tokens, alternating: step times and agreement."""
    kvs = {name: fill(engine, n, context, args.draft_len) for name, engine in engines.items()}
    times = {name: [] for name in engines}
    emitted = {}
    for rep in range(args.reps + 1):
        for name, engine in engines.items():
            elapsed, _, _, emitted[name] = step(engine, kvs[name], args.draft_len)
            if rep:                     # the first pass warms up (compiles, captures)
                times[name].append(elapsed * 1e3)
    for session_kvs in kvs.values():
        for kv in session_kvs:
            kv.free()
    one, split = (statistics.median(times[name]) for name in ("one", "split"))
    return {"sessions": n, "context": context, "one_ms_p50": one, "split_ms_p50": split,
            "one_ms_p90": percentile(times["one"], 90),
            "split_ms_p90": percentile(times["split"], 90), "split_over_one": split / one,
            "emitted_agree": agreement(emitted["split"], emitted["one"])}


def _table(results: dict) -> Table:
    table = Table(title=f"{results['model']}: a verify step on one device and split over "
                        f"{results['tp']} ranks ({results['engine']}, {results['device']}, "
                        f"k={results['k']})")
    for column in ("sessions", "context", "one device ms", f"tp {results['tp']} ms", "ratio",
                   "emitted agree"):
        table.add_column(column, justify="right")
    for cell in results["cells"]:
        table.add_row(str(cell["sessions"]), str(cell["context"]), f"{cell['one_ms_p50']:.2f}",
                      f"{cell['split_ms_p50']:.2f}", f"{cell['split_over_one']:.2f}x",
                      cell["emitted_agree"])
    return table
