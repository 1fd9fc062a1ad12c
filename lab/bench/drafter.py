"""`sled bench drafter`: the GGUF drafter's speed next to llama.cpp's own generation loop.

Same file, same context settings, same threads, same prompt, greedy. Each repetition times
(a) Llama.generate for N tokens and (b) the drafter proposing rounds of k with a simulated verdict
and rollback until N tokens; the two alternate which goes first. Both runs include the prompt's
prefill. The verdict accepts `accept` of the k drafts and then takes the drafter's own next token
as the correction, so every round exercises rollback and both loops commit the same greedy text.

--model onnx:DIR_OR_ALIAS does the same for the ONNX drafter next to onnxruntime-genai's own loop
(og.Generator, greedy search, generate_next_token), both on one og.Model, so the same session
and threads.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.table import Table
from transformers import AutoTokenizer

from drafters import resolve_spec
from drafters.gguf import GGUFDrafter, open_llama
from drafters.onnx import ONNXDrafter
from lab.bench import harness
from sled.flags import non_negative_int, positive_int
from sled.wire.sampling import Sampling

RUNTIMES = {"gguf": "llama.cpp", "onnx": "onnxruntime-genai"}
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True,
                        help="gguf:ALIAS, gguf:FILE, onnx:ALIAS or onnx:DIR")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="runtime threads (default: all cores)")
    parser.add_argument("--tokens", type=positive_int, default=128, help="tokens generated per run")
    parser.add_argument("--draft-len", type=positive_int, default=4, help="tokens drafted per round (k)")
    parser.add_argument("--accept", type=non_negative_int, default=None,
                        help="drafts accepted per simulated verdict (default: all)")
    parser.add_argument("--reps", type=positive_int, default=5, help="repetitions of each, interleaved")
    parser.add_argument("--out", default=None, help="default: bench-results/drafter-MODEL-tN.json")


def run(args) -> int:
    return harness.run_bench("drafter", bench, args)


def bench(args) -> int:
    kind, _, path = resolve_spec(args.model).partition(":")
    if kind not in ("gguf", "onnx") or not path:
        raise harness.Stop(f"need gguf:ALIAS, gguf:FILE, onnx:ALIAS or onnx:DIR, got {args.model!r}")
    console = harness.bench_console()
    setup = Setup.of(args, path)
    drafter, prompt, native = (_gguf if kind == "gguf" else _onnx)(setup)
    race = Race(RUNTIMES[kind], [], [], True)
    _race(race, console, native, drafter, prompt, setup, args)
    summarize = _gguf_summary if kind == "gguf" else _onnx_summary
    table, data, name = summarize(race, setup, args)
    console.print(table)
    console.print(f"same greedy text as {race.runtime}: {'yes' if race.same_text else 'NO'}")
    harness.write_results(console, args.out or f"bench-results/{name}-t{setup.threads}.json", {
        **data, "native_tokens_per_s": race.native_tps, "drafter_tokens_per_s": race.drafter_tps,
        **_ratios(race, kind), "same_text": race.same_text})
    return harness.DONE


@dataclass(frozen=True, slots=True)
class Setup:
    """One drafter file under test: its path, threads, k and drafts accepted per round."""
    path: str
    threads: int
    draft_len: int
    accept: int

    @classmethod
    def of(cls, args, path: str) -> "Setup":
        accept = min(args.accept if args.accept is not None else args.draft_len, args.draft_len - 1)
        return cls(path, args.threads or os.cpu_count(), args.draft_len, accept)


@dataclass(slots=True)
class Race:
    """Tokens/s of the runtime's own loop and of the drafter, repetition by repetition."""
    runtime: str
    native_tps: list[float]
    drafter_tps: list[float]
    same_text: bool


def native_run(llm, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """llama.cpp's loop: seconds for n greedy tokens from a cold cache, and the tokens."""
    llm.reset()
    tokens: list[int] = []
    start = time.perf_counter()
    for token in llm.generate(prompt, temp=0.0, reset=True):
        tokens.append(token)
        if len(tokens) == n:
            break
    return time.perf_counter() - start, tokens


def drafter_run(drafter, prompt: list[int], n: int, k: int, accept: int) -> tuple[float, int, list[int]]:
    """Rounds of k drafts until n tokens are committed: seconds, tokens drafted, committed tokens."""
    greedy = Sampling()
    drafter.rollback(0)
    context = list(prompt)
    drafted = 0
    start = time.perf_counter()
    while len(context) - len(prompt) < n:
        draft = drafter.propose(context, k, greedy).token_ids
        drafted += k
        # Verdict: accept a prefix; the "target" corrects with the token the drafter drafted next.
        context += draft[:accept + 1]
        drafter.rollback(len(context))
    return time.perf_counter() - start, drafted, context[len(prompt):len(prompt) + n]


def _gguf(setup: Setup):
    """The GGUF drafter, the prompt, and llama.cpp's own loop on the same file and threads."""
    drafter = GGUFDrafter(setup.path, n_threads=setup.threads)
    llm = open_llama(Path(setup.path), setup.threads, drafter.n_ctx)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=True)
    return drafter, prompt, lambda n: native_run(llm, prompt, n)


def _onnx(setup: Setup):
    """The ONNX drafter, the prompt, and onnxruntime-genai's own loop on the drafter's og.Model
    (the same session and threads)."""
    drafter = ONNXDrafter(setup.path, n_threads=setup.threads)
    prompt = AutoTokenizer.from_pretrained(setup.path)(PROMPT).input_ids
    return drafter, prompt, lambda n: onnx_native_run(drafter.model, prompt, n, drafter.max_length)


def _race(race: Race, console, native, drafter, prompt: list[int], setup: Setup, args) -> None:
    """Warm both up, then alternate which goes first, repetition by repetition, into `race`.
    The native loop may stop early at EOS; its tokens/s counts the tokens it did generate."""
    k, accept = setup.draft_len, setup.accept
    native(8)  # warm up both: page in the weights, size the buffers
    drafter_run(drafter, prompt, 8, k, accept)
    for rep in range(args.reps):  # no spinner: its refresh thread would compete for the cores
        for which in ("native", "drafter") if rep % 2 == 0 else ("drafter", "native"):
            if which == "native":
                seconds, native_tokens = native(args.tokens)
                race.native_tps.append(len(native_tokens) / seconds)
            else:
                seconds, drafted, committed = drafter_run(drafter, prompt, args.tokens, k, accept)
                race.drafter_tps.append(drafted / seconds)
        race.same_text &= committed[:len(native_tokens)] == native_tokens
        console.print(f"repetition {rep + 1}/{args.reps}: native {race.native_tps[-1]:.1f}, "
                      f"drafter {race.drafter_tps[-1]:.1f} tokens/s")


def _gguf_summary(race: Race, setup: Setup, args):
    """Median (the typical run) and best (the run least disturbed by anything else on the
    machine) of each: (table, JSON fields, file name)."""
    median = {"native": statistics.median(race.native_tps), "drafter": statistics.median(race.drafter_tps)}
    best = {"native": max(race.native_tps), "drafter": max(race.drafter_tps)}
    table = Table(title=f"{Path(setup.path).name}, {setup.threads} thread(s)",
                  caption=f"{args.tokens} tokens per run, k={setup.draft_len}, {setup.accept + 1} "
                          f"committed per round, {args.reps} repetitions, load average "
                          f"{os.getloadavg()[0]:.2f}")
    for column in ("tokens/s", "median", "best"):
        table.add_column(column, justify="left" if column == "tokens/s" else "right")
    table.add_row("llama.cpp generate", f"{median['native']:.1f}", f"{best['native']:.1f}")
    table.add_row("GGUFDrafter propose", f"{median['drafter']:.1f}", f"{best['drafter']:.1f}")
    table.add_row("drafter / native", f"{median['drafter'] / median['native']:.3f}",
                  f"{best['drafter'] / best['native']:.3f}")
    data = {"model": setup.path, "threads": setup.threads, "tokens": args.tokens,
            "draft_len": setup.draft_len, "committed_per_round": setup.accept + 1,
            "reps": args.reps, "cpus": os.cpu_count()}
    return table, data, f"drafter-{Path(setup.path).stem}"


def _onnx_summary(race: Race, setup: Setup, args):
    """p50, min and max of each and of their per-repetition ratio: (table, JSON fields, name)."""
    ratios = [d / n for d, n in zip(race.drafter_tps, race.native_tps)]
    name = Path(setup.path).name
    table = Table(title=f"{name}: {args.tokens} tokens, {setup.threads} thread(s), "
                        f"k={setup.draft_len}, {setup.accept + 1} committed per round, "
                        f"{args.reps} repetitions")
    for column in ("", "tokens/s p50", "min", "max"):
        table.add_column(column, justify="right" if column else "left")
    for label, values in (("onnxruntime-genai generate", race.native_tps),
                          ("ONNXDrafter propose", race.drafter_tps), ("drafter / native", ratios)):
        digits = 3 if label == "drafter / native" else 1
        table.add_row(label, *(f"{v:.{digits}f}" for v in (statistics.median(values), min(values),
                                                           max(values))))
    data = {"model": setup.path, "runtime": "onnxruntime-genai", "threads": setup.threads,
            "tokens": args.tokens, "draft_len": setup.draft_len,
            "committed_per_round": setup.accept + 1, "reps": args.reps, "cpus": os.cpu_count()}
    return table, data, f"drafter-onnx-{name}"


def _ratios(race: Race, kind: str) -> dict:
    """gguf: the ratio of the medians and of the bests; onnx: the median per-repetition ratio."""
    if kind == "onnx":
        return {"ratio_median": statistics.median(d / n for d, n in zip(race.drafter_tps,
                                                                         race.native_tps))}
    return {"ratio_median": statistics.median(race.drafter_tps) / statistics.median(race.native_tps),
            "ratio_best": max(race.drafter_tps) / max(race.native_tps)}


# --- onnx:DIR_OR_ALIAS: onnxruntime-genai's own loop ---------------------------------------------

def onnx_native_run(model, prompt: list[int], n: int, max_length: int) -> tuple[float, list[int]]:
    """onnxruntime-genai's loop: seconds for up to n greedy tokens (prefill included), the tokens.

    Greedy search stops early at EOS; the tokens/s then counts the tokens it did generate.
    """
    import onnxruntime_genai as og   # optional: the onnx extra

    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=max_length)
    generator = og.Generator(model, params)  # allocates the KV buffer, as ONNXDrafter() does
    start = time.perf_counter()
    generator.append_tokens(np.asarray(prompt, dtype=np.int32))
    while generator.token_count() - len(prompt) < n and not generator.is_done():
        generator.generate_next_token()
    seconds = time.perf_counter() - start
    return seconds, generator.get_sequence(0)[len(prompt):].tolist()
