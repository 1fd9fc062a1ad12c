"""`sled bench kv-windows`: how many sessions a GPU's KV memory holds at each context, with a
model's sliding-window layers keeping only their window and with every layer keeping every
token, side by side.

    sled bench kv-windows --profile h200-gemma3-4b-sled-forward --contexts 512,2048,8192,32768

It fills the server's own pool (verify_server.engines.blocks, in a pool that holds no keys or
values, as the simulator's) with sessions of each context until it is full: each one admitted as
the server admits it (its prompt and answer, rows of up to --max-step-tokens), then narrowed to
its rounds' rows once its prompt is in. Memory and model shape come from the profile.
"""
from __future__ import annotations

import sys

from rich.table import Table

from lab.bench import harness
from lab.bench.harness import bench_console
from sled.flags import one_line, positive_int
from lab.sim.engine import bookkeeping_pool
from lab.sim.server import kv_tokens, kv_windows
from verify_server.engines.blocks import PoolExhausted
from verify_server.engines.kv import SessionKV
from verify_server.gpu_memory import describe, gpu_memory
from verify_server.settings import ServerSettings
from verify_server.step_costs import load_profile

ROUND_TOKENS = 33      # a session's widest round once its prompt is in: the last token, 32 drafted


def sessions_held(tokens: int, windows: tuple[int | None, ...], context: int, answer: int,
                  block_tokens: int, row_tokens: int) -> int:
    """Sessions of `context` + `answer` tokens a pool of `tokens` of every layer's KV holds."""
    pool = bookkeeping_pool(tokens, block_tokens, windows, row_tokens)
    held = 0
    while True:
        kv = SessionKV(pool)
        try:
            kv.admit([], context + answer, b"")
        except PoolExhausted:
            return held
        kv.narrow(ROUND_TOKENS)        # its prompt in: its rows are a draft wide
        held += 1


def add_arguments(parser) -> None:
    parser.add_argument("--profile", default="h200-gemma3-4b-sled-forward",
                        help="the step-cost profile whose GPU memory and model shape to use")
    parser.add_argument("--contexts", default="512,2048,8192,32768",
                        type=harness.listed(positive_int), help="comma-separated prompt lengths")
    parser.add_argument("--answer", type=positive_int, default=64,
                        help="each session's answer tokens")
    parser.add_argument("--max-step-tokens", type=positive_int, default=2048,
                        help="the server's widest row: a prefill chunk")


def run(args) -> int:
    try:
        profile = load_profile(args.profile)
        settings = ServerSettings(max_step_tokens=args.max_step_tokens)
        tokens = kv_tokens(profile, settings)
        windows = kv_windows(profile, settings)
        if not windows:
            raise ValueError(f"{profile.name}'s model has no sliding-window layers: the pool "
                             "keeps every token either way")
    except ValueError as exc:
        print(f"sled bench kv-windows: {one_line(exc)}", file=sys.stderr)
        return 2
    console = bench_console()
    table = Table(title=f"sessions the KV memory holds: {describe(profile, gpu_memory(profile))}")
    for column in ("context", "every token", "windows kept", "ratio"):
        table.add_column(column, justify="right")
    for context in (int(c) for c in args.contexts.split(",")):
        before = sessions_held(tokens, (), context, args.answer, settings.kv_block_tokens,
                               args.max_step_tokens)
        after = sessions_held(tokens, windows, context, args.answer, settings.kv_block_tokens,
                              args.max_step_tokens)
        table.add_row(str(context), str(before), str(after),
                      f"{after / before:.2f}x" if before else "-")
    console.print(table)
    return 0
