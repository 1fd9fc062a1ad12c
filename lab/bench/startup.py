"""`sled bench startup`: where the wait before serving, and before a device's first token, goes.

Each start runs in a fresh child process, as a person's command would: the server's (imports,
assembling and converting a built-in on first use, the target's tokenizer and weights, the rest:
fingerprint and GetTokenizer reply), the drafter's (imports, loading it, its tokenizer
fingerprint) and the device's copy of the target's tokenizer (model info and the tokenizer from
the device's cache, as `sled generate` gets them while its drafter loads). The phases are
sled.progress's own, so the table names what the progress lines say. Last, `sled generate`
against the started server gives the seconds to its first token.

--cold runs everything twice: first in an empty temporary sled cache (first use: the GGUF is
assembled and converted, fingerprints computed, the tokenizer fetched), then warm in that cache.
Without it the user's cache is used, warm.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

from rich.table import Table

from lab.bench import harness
from lab.bench.startup_child import DEVICE_PHASES, DRAFTER_PHASES, SERVER_PHASES
from sled.flags import positive_int
from sled.models import resolve_model


def add_arguments(parser) -> None:
    parser.add_argument("--target", default="gemma3-270m", help="the server's target alias or path")
    parser.add_argument("--drafter", default="gguf:gemma3-270m", help="drafter spec")
    parser.add_argument("--reps", type=positive_int, default=1, help="warm starts measured")
    parser.add_argument("--cold", action="store_true",
                        help="first measure a first use, in an empty temporary sled cache")
    harness.add_out_flag(parser, "startup")


def run(args) -> int:
    return harness.run_bench("startup", bench, args)


def bench(args) -> int:
    console = harness.bench_console()
    runs = {}
    starts = (["cold"] if args.cold else []) + [f"warm {i + 1}" for i in range(args.reps)]
    with tempfile.TemporaryDirectory(prefix="sled-startup-") as empty, _cache(empty, args.cold):
        for name in starts:
            console.print(f"[bold]{name}[/]: starting {args.target} and {args.drafter}")
            runs[name] = _one_start(args, dict(os.environ))
    _print(console, runs, args)
    harness.write_results(console, args.out, {"target": args.target, "drafter": args.drafter,
                                              "runs": runs})
    return harness.DONE


@contextmanager
def _cache(folder: str, use: bool):
    """With USE, every child (and the server) works in the sled cache FOLDER meanwhile."""
    before = os.environ.get("SLED_CACHE")
    if use:
        os.environ["SLED_CACHE"] = folder
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SLED_CACHE", None)
        else:
            os.environ["SLED_CACHE"] = before


def _one_start(args, env: dict) -> dict:
    """A server start, a drafter start and a `sled generate` against the server: their phases."""
    server = _child("server", args.target, env)
    drafter = _child("drafter", args.drafter, env)
    device, first_token = _first_token(args, env)
    return {"server": server, "drafter": drafter, "device": device, "first_token_s": first_token}


def _child(kind: str, spec: str, env: dict) -> dict:
    """Phase seconds of one start in a child process (child() below)."""
    code = f"from lab.bench.startup_child import child; child({kind!r}, {spec!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=1800)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no message"]
        raise harness.Stop(f"the {kind} start failed: {tail[0]}", harness.SERVER_FAILED)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _first_token(args, env: dict) -> tuple[dict, float]:
    """Against a server started beforehand (not counted), both in ENV's sled cache: the device's
    tokenizer phases, then the seconds from `sled generate --drafter D` starting to its first
    byte of text."""
    async def measure() -> tuple[dict, float]:
        async with harness.serving(resolve_model(args.target)) as served:
            address = served.server.address
            await asyncio.to_thread(_child, "device", address, env)     # fetched on a first use
            device = await asyncio.to_thread(_child, "device", address, env)
            return device, await asyncio.to_thread(_generate, address, args.drafter, env)

    return asyncio.run(measure())


def _generate(address: str, drafter: str, env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "sled_cli.main", "generate", "--server", address,
                             "--drafter", drafter, "--prompt", "hi", "--max-new-tokens", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)
    seconds = time.perf_counter() - start
    _, err = proc.communicate(timeout=600)
    if not first or proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise harness.Stop(f"sled generate failed: {tail[0]}", harness.SERVER_FAILED)
    return seconds


def _print(console, runs: dict, args) -> None:
    """One table per side: a row per phase, a column per start."""
    names = list(runs)
    sides = {"server": (SERVER_PHASES, args.target), "drafter": (DRAFTER_PHASES, args.drafter),
             "device": (DEVICE_PHASES, f"the tokenizer of {args.target}")}
    for side, (phases, what) in sides.items():
        table = Table(title=f"{side} start-up ({what}), seconds per phase")
        table.add_column("phase")
        for name in names:
            table.add_column(name, justify="right")
        for phase in phases:
            table.add_row(phase, *(f"{runs[n][side].get(phase, 0.0):.2f}" for n in names))
        console.print(table)
    console.print("first token of `sled generate --drafter " + args.drafter + "` (server up): " +
                  ", ".join(f"{n} {runs[n]['first_token_s']:.2f} s" for n in names))
