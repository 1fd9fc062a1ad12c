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
from pathlib import Path

from lab.report import write_json

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


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
    from sled.sampling import Sampling

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


def run_drafter_bench(args) -> int:
    if args.model.startswith("onnx:"):
        return run_onnx_bench(args)
    from rich.console import Console
    from rich.table import Table

    from drafters import resolve_spec
    from drafters.gguf import GGUFDrafter, open_llama

    console = Console()
    kind, _, file = resolve_spec(args.model).partition(":")
    if kind != "gguf" or not file:
        console.print(f"sled bench drafter: need gguf:ALIAS or gguf:FILE, got {args.model!r}")
        return 2
    k, accept = args.draft_len, min(args.accept if args.accept is not None else args.draft_len,
                                     args.draft_len - 1)
    threads = args.threads or os.cpu_count()
    drafter = GGUFDrafter(file, n_threads=threads)
    native = open_llama(Path(file), threads, drafter.n_ctx)
    prompt = native.tokenize(PROMPT.encode(), add_bos=True)

    native_tps: list[float] = []
    drafter_tps: list[float] = []
    same_text = True
    native_run(native, prompt, 8)  # warm up both: page in the weights, size the buffers
    drafter_run(drafter, prompt, 8, k, accept)
    for rep in range(args.reps):  # no spinner: its refresh thread would compete for the cores
        for which in ("native", "drafter") if rep % 2 == 0 else ("drafter", "native"):
            if which == "native":
                seconds, native_tokens = native_run(native, prompt, args.tokens)
                native_tps.append(args.tokens / seconds)
            else:
                seconds, drafted, committed = drafter_run(drafter, prompt, args.tokens, k, accept)
                drafter_tps.append(drafted / seconds)
        same_text &= committed == native_tokens
        console.print(f"repetition {rep + 1}/{args.reps}: native {native_tps[-1]:.1f}, "
                      f"drafter {drafter_tps[-1]:.1f} tokens/s")

    # Median: the typical run; best: the run least disturbed by anything else on the machine.
    median = {"native": statistics.median(native_tps), "drafter": statistics.median(drafter_tps)}
    best = {"native": max(native_tps), "drafter": max(drafter_tps)}
    table = Table(title=f"{Path(file).name}, {threads} thread(s)",
                  caption=f"{args.tokens} tokens per run, k={k}, {accept + 1} committed per round, "
                          f"{args.reps} repetitions, load average {os.getloadavg()[0]:.2f}")
    for column in ("tokens/s", "median", "best"):
        table.add_column(column, justify="left" if column == "tokens/s" else "right")
    table.add_row("llama.cpp generate", f"{median['native']:.1f}", f"{best['native']:.1f}")
    table.add_row("GGUFDrafter propose", f"{median['drafter']:.1f}", f"{best['drafter']:.1f}")
    table.add_row("drafter / native", f"{median['drafter'] / median['native']:.3f}",
                  f"{best['drafter'] / best['native']:.3f}")
    console.print(table)
    console.print(f"same greedy text as llama.cpp: {'yes' if same_text else 'NO'}")
    out = write_json(args.out or f"bench-results/drafter-{Path(file).stem}-t{threads}.json", {
        "model": file, "threads": threads, "tokens": args.tokens, "draft_len": k,
        "committed_per_round": accept + 1, "reps": args.reps, "cpus": os.cpu_count(),
        "native_tokens_per_s": native_tps, "drafter_tokens_per_s": drafter_tps,
        "ratio_median": median["drafter"] / median["native"],
        "ratio_best": best["drafter"] / best["native"], "same_text": same_text,
    })
    console.print(f"wrote {out}")
    return 0


# --- onnx:DIR_OR_ALIAS: the ONNX drafter next to onnxruntime-genai's own loop -------------------

def onnx_native_run(model, prompt: list[int], n: int, max_length: int) -> tuple[float, list[int]]:
    """onnxruntime-genai's loop: seconds for up to n greedy tokens (prefill included), the tokens.

    Greedy search stops early at EOS; the tokens/s then counts the tokens it did generate.
    """
    import numpy as np
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=max_length)
    generator = og.Generator(model, params)  # allocates the KV buffer, as ONNXDrafter() does
    start = time.perf_counter()
    generator.append_tokens(np.asarray(prompt, dtype=np.int32))
    while generator.token_count() - len(prompt) < n and not generator.is_done():
        generator.generate_next_token()
    seconds = time.perf_counter() - start
    return seconds, generator.get_sequence(0)[len(prompt):].tolist()


def run_onnx_bench(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoTokenizer

    from drafters import resolve_spec
    from drafters.onnx import ONNXDrafter

    console = Console()
    folder = resolve_spec(args.model).partition(":")[2]
    k, accept = args.draft_len, min(args.accept if args.accept is not None else args.draft_len,
                                     args.draft_len - 1)
    threads = args.threads or os.cpu_count()
    drafter = ONNXDrafter(folder, n_threads=threads)  # the native loop runs on its og.Model too
    prompt = AutoTokenizer.from_pretrained(folder)(PROMPT).input_ids

    def native(n: int) -> tuple[float, list[int]]:
        return onnx_native_run(drafter.model, prompt, n, drafter.max_length)

    native_tps: list[float] = []
    drafter_tps: list[float] = []
    same_text = True
    native(8)  # warm up both: page in the weights, let onnxruntime size its buffers
    drafter_run(drafter, prompt, 8, k, accept)
    for rep in range(args.reps):  # no spinner: its refresh thread would compete for the cores
        for which in ("native", "drafter") if rep % 2 == 0 else ("drafter", "native"):
            if which == "native":
                seconds, native_tokens = native(args.tokens)
                native_tps.append(len(native_tokens) / seconds)
            else:
                seconds, drafted, committed = drafter_run(drafter, prompt, args.tokens, k, accept)
                drafter_tps.append(drafted / seconds)
        same_text &= committed[:len(native_tokens)] == native_tokens
        console.print(f"repetition {rep + 1}/{args.reps}: native {native_tps[-1]:.1f}, "
                      f"drafter {drafter_tps[-1]:.1f} tokens/s")

    ratios = [d / n for d, n in zip(drafter_tps, native_tps)]
    name = Path(folder).name
    table = Table(title=f"{name}: {args.tokens} tokens, {threads} thread(s), k={k}, "
                        f"{accept + 1} committed per round, {args.reps} repetitions")
    for column in ("", "tokens/s p50", "min", "max"):
        table.add_column(column, justify="right" if column else "left")
    for label, values in (("onnxruntime-genai generate", native_tps),
                          ("ONNXDrafter propose", drafter_tps)):
        table.add_row(label, f"{statistics.median(values):.1f}", f"{min(values):.1f}",
                      f"{max(values):.1f}")
    table.add_row("drafter / native", f"{statistics.median(ratios):.3f}", f"{min(ratios):.3f}",
                  f"{max(ratios):.3f}")
    console.print(table)
    console.print(f"same greedy text as onnxruntime-genai: {'yes' if same_text else 'NO'}")
    out = write_json(args.out or f"bench-results/drafter-onnx-{name}-t{threads}.json", {
        "model": folder, "runtime": "onnxruntime-genai", "threads": threads, "tokens": args.tokens,
        "draft_len": k, "committed_per_round": accept + 1, "reps": args.reps,
        "cpus": os.cpu_count(),
        "native_tokens_per_s": native_tps, "drafter_tokens_per_s": drafter_tps,
        "ratio_median": statistics.median(ratios), "same_text": same_text,
    })
    console.print(f"wrote {out}")
    return 0
