"""`sled bench fuzz`: generated hostile streams against a `sled serve` child while a normal greedy
session generates beside them the whole time.

The streams are lab.fuzz's traffic (every field of every DeviceMessage drawn from the protobuf
descriptor, plausible sessions, raw frames), sent one at a time in lockstep until --messages
messages were written. Counted: streams and messages, endings by status, unclear endings
(UNKNOWN or INTERNAL, an error without a message or the service's ErrorDetail, a hang until the
stream's deadline), server crashes (the child exited, or stopped answering its health check),
sessions and KV blocks left afterwards (the server's /metrics), the server's RSS growth, and
whether every output of the normal session was the target's generate(do_sample=False).

Hypothesis draws in a worker thread (a @given function called directly, in batches seeded from
--seed); each stream is exchanged on the event loop that runs the normal session.

Exit codes: 0 every stream ended clearly, nothing crashed or leaked and the normal session was
lossless; 3 a crash, an unclear ending or a leak (sessions or KV left, RSS grown more than
lab.fuzz.RSS_GROWTH_MIB); 1 (otherwise) a normal output differed from the target's.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import psutil
from hypothesis import HealthCheck, Phase, given, seed as seeded, settings, strategies as st
from rich.progress import Progress
from rich.table import Table

from lab.bench import harness
from lab.fuzz import (RSS_GROWTH_MIB, STREAM_TIMEOUT_S, NormalSession, Wire, exchange, fuzz_traffic,
                      raw_generate, unclear_ending)
from lab.oracle import greedy_references
from lab.tiny import cached_pair
from sled.flags import non_negative_int, positive_int
from sled.models import resolve_model
from sled.v1 import verifier_pb2 as pb
from sled.v1.verifier_pb2_grpc import VerifierStub

BATCH = 100                     # examples per hypothesis run; a new seed for each
LIMITS = {"--context-length": 64, "--max-draft-tokens": 4, "--max-q-support": 4, "--kv-budget": "64MiB"}
NORMAL_PROMPT = "def fib(n):\n    if n < 2:\n        return n\n"
NORMAL_TOKENS = 24
SETTLE_S = 10.0                 # for the server to drop the last streams' sessions and KV
UNCLEAR_KEPT = 10               # unclear endings quoted in the results


def add_arguments(parser) -> None:
    parser.add_argument("--messages", type=positive_int, default=10_000,
                        help="DeviceMessages to send in fuzzed streams")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seeds the generated streams (the same seed, the same streams)")
    harness.add_server_flags(parser, model_help="target alias or path (default: the tiny "
                                                "random target)")
    harness.add_out_flag(parser, "fuzz")


def run(args) -> int:
    return harness.run_bench("fuzz", bench, args)


def server_args(args) -> list[str]:
    """The server's limits, small so that fuzzed values cross them, then --dtype/--server-args."""
    limits = [str(part) for flag, value in LIMITS.items() for part in (flag, value)]
    return [*limits, *harness.server_flags(args)]


@dataclass
class Tally:
    """What the fuzzed streams did."""
    streams: int = 0
    messages: int = 0
    endings: Counter = field(default_factory=Counter)      # status name -> streams
    unclear: list[str] = field(default_factory=list)       # what was wrong, one per stream
    crash: str | None = None

    def add(self, ending) -> None:
        self.streams += 1
        self.messages += ending.sent
        self.endings[ending.code.name] += 1
        problem = unclear_ending(ending)
        if problem is not None:
            self.unclear.append(problem)


async def bench(args) -> int:
    """The reference, the server, the fuzz beside the normal session, the table and the JSON."""
    console = harness.bench_console()
    model = resolve_model(args.model) if args.model else cached_pair()[0]
    flags = server_args(args)
    reference = await _reference(model, flags, console)
    started = time.monotonic()
    async with harness.serving(model, flags, console) as served:
        results = await _fuzz_beside_normal(served, reference, args, console)
    results = {"model": args.model or "tiny random llama", "seed": args.seed,
               "seconds": round(time.monotonic() - started, 1), **results}
    _table(console, results)
    harness.write_results(console, args.out, results)
    return _verdict(console, results)


async def _reference(model: str, flags: list[str], console) -> list[int]:
    """The target's greedy output for the normal session's prompt, as the server computes it."""
    with console.status("the target's greedy reference"), harness.flag_errors():
        return (await asyncio.to_thread(greedy_references, model, [NORMAL_PROMPT],
                                        NORMAL_TOKENS, flags))[0]


async def _fuzz_beside_normal(served, reference: list[int], args, console) -> dict:
    """Warm up with one normal generation, take the RSS baseline, fuzz with the normal session
    running, stop it, and read what is left."""
    log = served.server.child      # tail(): the end of its log
    prompt_ids = (await served.prompt_ids([NORMAL_PROMPT]))[0]
    normal = NormalSession(served.stub, prompt_ids, reference)
    with harness.server_errors():
        await normal.once()
    process = psutil.Process(served.server.proc.pid)
    rss_start = process.memory_info().rss
    normal.start()
    try:
        tally = await _fuzz(served, args, console, log)
    except BaseException:          # Ctrl-C: not a moment longer for the normal session
        await normal.cancel()
        raise
    await normal.stop()
    left = await _settled(served, tally)
    rss_end = process.memory_info().rss if tally.crash is None else None
    return {**_tally_dict(tally), **left, **_rss(rss_start, rss_end),
            "normal": {"generations": normal.sessions, "tokens": normal.tokens,
                       "mismatches": normal.mismatches, "error": normal.error,
                       "lossless": normal.lossless}}


# --- the fuzzed streams ----------------------------------------------------------------------------

async def _fuzz(served, args, console, log) -> Tally:
    """Streams until --messages were written or the server crashed, with a progress bar."""
    tally, stop = Tally(), threading.Event()
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(served.server.address) as channel:
        calls = {False: VerifierStub(channel).Generate, True: raw_generate(channel)}
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("fuzzed messages", total=args.messages)

            async def one(raw: bool, frames: list) -> None:
                await _stream(served, calls[raw], frames, tally, log)
                progress.update(task, completed=min(tally.messages, args.messages))

            def each(stream: tuple[bool, list]) -> None:   # in the worker thread
                if stop.is_set() or tally.crash or tally.messages >= args.messages:
                    return
                try:
                    asyncio.run_coroutine_threadsafe(one(*stream), loop).result()
                except (concurrent.futures.CancelledError, asyncio.CancelledError):
                    stop.set()                             # Ctrl-C: the loop is going away
            try:
                await asyncio.to_thread(_draw_streams, fuzz_traffic(Wire.of(served.info)),
                                        args.seed, each, lambda: stop.is_set() or tally.crash
                                        or tally.messages >= args.messages)
            finally:
                stop.set()
    return tally


async def _stream(served, generate, frames: list, tally: Tally, log) -> None:
    """One fuzzed stream, tallied; the child's exit is a crash (told with its last log lines)."""
    tally.add(await exchange(generate(timeout=STREAM_TIMEOUT_S), frames))
    code = served.server.proc.poll()
    if code is not None:
        tally.crash = (f"the server exited with code {code} after {tally.streams} streams; "
                       f"its last lines: {log.tail()}")


def _draw_streams(traffic, seed: int, each, done) -> None:
    """Hypothesis draws streams, typed message sequences or raw frames as (raw, frames), and
    hands each to EACH, BATCH examples per seed (seed, seed + 1, ...) until DONE()."""
    streams = st.one_of(traffic.messages.map(lambda messages: (False, messages)),
                        traffic.frames.map(lambda frames: (True, frames)))
    batch = 0
    while not done():
        @seeded(seed * 1_000_003 + batch)
        @settings(max_examples=BATCH, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(stream=streams)
        def drawn(stream) -> None:
            each(stream)

        drawn()
        batch += 1


# --- after the fuzz ----------------------------------------------------------------------------------

async def _settled(served, tally: Tally) -> dict:
    """Sessions and KV blocks the server still holds once it has had SETTLE_S to drop the last
    streams' (None: unknown after a crash); a failed health check is a crash."""
    if tally.crash is None and not await _healthy(served):
        tally.crash = "the server stopped answering its health check"
    if tally.crash is not None:
        return {"sessions_left": None, "kv_blocks_left": None}
    give_up = time.monotonic() + SETTLE_S
    while True:
        left = await asyncio.to_thread(_held, served.server)
        if not any(left.values()) or time.monotonic() > give_up:
            return left
        await asyncio.sleep(0.2)


def _held(server) -> dict:
    return {"sessions_left": int(server.metric("sled_active_sessions")),
            "kv_blocks_left": int(server.metric("sled_kv_blocks_used"))}


async def _healthy(served) -> bool:
    """The server still answers GetModelInfo."""
    try:
        await served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        return True
    except grpc.aio.AioRpcError:
        return False


def _tally_dict(tally: Tally) -> dict:
    return {"streams": tally.streams, "messages": tally.messages, "endings": dict(tally.endings),
            "unclear": len(tally.unclear), "unclear_examples": tally.unclear[:UNCLEAR_KEPT],
            "crashes": int(tally.crash is not None), "crash": tally.crash}


def _rss(start: int, end: int | None) -> dict:
    mib = 1 << 20
    if end is None:
        return {"rss_start_mib": round(start / mib, 1), "rss_end_mib": None,
                "rss_growth_mib": None, "rss_growth_pct": None}
    return {"rss_start_mib": round(start / mib, 1), "rss_end_mib": round(end / mib, 1),
            "rss_growth_mib": round((end - start) / mib, 1),
            "rss_growth_pct": round(100 * (end - start) / start, 2)}


# --- the verdict and the table -----------------------------------------------------------------------

def _problems(results: dict) -> list[str]:
    """What makes the run fail as the server's fault: crashes, unclear endings, leaks, a
    normal session that could not go on."""
    problems = [results["crash"]] if results["crash"] else []
    if results["unclear"]:
        problems.append(f"{results['unclear']} unclear endings, the first: "
                        f"{results['unclear_examples'][0]}")
    if results["sessions_left"] or results["kv_blocks_left"]:
        problems.append(f"left behind: {results['sessions_left']} sessions, "
                        f"{results['kv_blocks_left']} KV blocks")
    if (results["rss_growth_mib"] or 0) > RSS_GROWTH_MIB:
        problems.append(f"the server's RSS grew {results['rss_growth_mib']:.0f} MiB "
                        f"(more than {RSS_GROWTH_MIB} MiB)")
    if results["normal"]["error"]:
        problems.append(f"the normal session failed: {results['normal']['error']}")
    return problems


def _verdict(console, results: dict) -> int:
    """The exit code, after a red line per problem."""
    problems = _problems(results)
    for problem in problems:
        console.print(f"[red]{problem}[/]")
    if problems:
        return harness.SERVER_FAILED
    normal = results["normal"]
    return harness.lossless_exit(console, [f"normal session: {normal['mismatches']} of "
                                           f"{normal['generations']} outputs"]
                                 if normal["mismatches"] else [])


def _table(console, results: dict) -> None:
    table = Table(title=f"fuzz: {results['streams']} streams against one `sled serve` child "
                        f"({results['model']}, seed {results['seed']}, {results['seconds']:.0f} s)")
    for column in ("measurement", "figure", "detail"):
        table.add_column(column)
    endings = ", ".join(f"{name} {count}" for name, count in sorted(results["endings"].items()))
    table.add_row("messages fuzzed", f"{results['messages']:,}", f"in {results['streams']:,} "
                  f"streams; endings: {endings}")
    table.add_row("unclear endings", str(results["unclear"]),
                  "UNKNOWN/INTERNAL, no message or ErrorDetail, a hang")
    table.add_row("server crashes", str(results["crashes"]), results["crash"] or "")
    table.add_row("left after", f"{results['sessions_left']} sessions, "
                  f"{results['kv_blocks_left']} KV blocks", "sled_active_sessions, sled_kv_blocks_used")
    growth = results["rss_growth_mib"]
    table.add_row("server RSS growth", "unknown" if growth is None else
                  f"{growth:+.1f} MiB ({results['rss_growth_pct']:+.1f}%)",
                  f"from {results['rss_start_mib']:.0f} MiB after a warm-up generation")
    normal = results["normal"]
    table.add_row("normal session", "lossless" if normal["lossless"] else "NOT lossless",
                  f"{normal['generations']} greedy generations, {normal['tokens']} tokens, "
                  f"{normal['mismatches']} differed from the target's")
    console.print(table)
