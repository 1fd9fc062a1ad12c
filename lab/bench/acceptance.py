"""`sled bench acceptance`: how much of each drafter's draft the target accepts, per draft length.

One server process (the target), every drafter in turn over the same workload, greedy, for each
k: acceptance rate (accepted / verified draft tokens), mean accepted length per round, and tokens
per round (accepted + the target's own token). Writes JSON and a PNG plot.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from rich.progress import Progress
from rich.table import Table

from drafters import bind_target_tokenizer, load_drafter
from edge_client.session import RoundSettings, Target, generate
from edge_client.wire import SessionRequest
from lab.bench import harness
from lab.bench.report import save_figure, subplots
from lab.workload import prompt_texts
from sled.flags import positive_int


def add_arguments(parser) -> None:
    parser.add_argument("--target", default="gemma3-270m", help="alias or checkpoint path")
    parser.add_argument("--drafters", default="gguf:gemma3-270m,onnx:gemma3-270m,ngram",
                        help="comma-separated drafter specs")
    harness.add_draft_lens_flag(parser, default="2,4,6,8", help="comma-separated draft lengths")
    harness.add_workload_flags(parser, default="humaneval:20", max_new_tokens=64)
    parser.add_argument("--devices", type=positive_int, default=4, help="concurrent sessions per drafter")
    harness.add_out_flag(parser, "acceptance")


def run(args) -> int:
    return harness.run_bench("acceptance", bench, args)


async def _measure(served, spec: str, prompts: list[list[int]], draft_len: int, max_new: int,
                   devices: int) -> dict:
    stub, fingerprint = served.stub, served.fingerprint
    drafters = [load_drafter(spec) for _ in range(devices)]
    tokenizer = await served.conn.tokenizer()
    for drafter in drafters:
        bind_target_tokenizer(drafter, tokenizer)   # an xtok: drafter drafts in the target's ids
    results = []

    async def device(slot: int) -> None:
        for i in range(slot, len(prompts), devices):
            results.append(await generate(stub, drafters[slot],
                                          SessionRequest(prompts[i], max_new_tokens=max_new),
                                          settings=RoundSettings(draft_len=draft_len),
                                          target=Target(fingerprint=fingerprint)))

    await asyncio.gather(*(device(s) for s in range(devices)))
    rounds = sum(r.rounds for r in results)
    verified = sum(r.draft_tokens for r in results)
    accepted = sum(r.accepted_tokens for r in results)
    tokens = sum(len(r.token_ids) for r in results)
    return {"drafter": spec, "k": draft_len, "rounds": rounds, "verified": verified,
            "accepted": accepted, "tokens": tokens, "acceptance_rate": accepted / verified,
            "mean_accepted": accepted / rounds, "tokens_per_round": tokens / rounds}


async def bench(args) -> int:
    console = harness.bench_console()
    specs = harness.split_list(args.drafters)
    with harness.flag_errors():
        draft_lens = harness.split_list(args.draft_lens, int)
        texts = prompt_texts(args.workload)
    async with harness.serving(args.target) as served:
        prompts = await served.prompt_ids(texts)
        rows = await _sweep(served, specs, draft_lens, prompts, args, console)
    console.print(_table(rows, args))
    harness.write_results(console, args.out, {
        "target": args.target, "workload": args.workload, "max_new_tokens": args.max_new_tokens,
        "results": rows}, lambda png: _plot(rows, specs, png, f"{args.target} on {args.workload}"))
    return harness.DONE


async def _sweep(served, specs: list[str], draft_lens: list[int], prompts: list[list[int]], args,
                 console) -> list[dict]:
    """Every drafter at every k, one after another."""
    rows = []
    with Progress(console=console) as progress:
        task = progress.add_task("drafter x k", total=len(specs) * len(draft_lens))
        for spec in specs:
            for draft_len in draft_lens:
                progress.update(task, description=f"{spec} k={draft_len}")
                rows.append(await _measure(served, spec, prompts, draft_len, args.max_new_tokens,
                                           args.devices))
                progress.advance(task)
    return rows


def _table(rows: list[dict], args):
    table = Table(title=f"acceptance on {args.workload}, target {args.target}, "
                        f"{args.max_new_tokens} new tokens, greedy")
    for column in ("drafter", "k", "acceptance", "mean accepted", "tokens/round", "rounds"):
        table.add_column(column, justify="left" if column == "drafter" else "right")
    for r in rows:
        table.add_row(r["drafter"], str(r["k"]), f"{r['acceptance_rate']:.1%}",
                      f"{r['mean_accepted']:.2f}", f"{r['tokens_per_round']:.2f}", str(r["rounds"]))
    return table


def _plot(rows: list[dict], specs: list[str], path: Path, title: str) -> None:
    fig, (left, right) = subplots(2)
    for spec in specs:
        mine = [r for r in rows if r["drafter"] == spec]
        draft_lens = [r["k"] for r in mine]
        left.plot(draft_lens, [r["acceptance_rate"] for r in mine], marker="o", label=spec)
        right.plot(draft_lens, [r["tokens_per_round"] for r in mine], marker="o", label=spec)
    left.set(xlabel="draft length k", ylabel="acceptance rate", ylim=(0, 1), title="acceptance")
    right.set(xlabel="draft length k", ylabel="tokens per round", title="tokens per target pass")
    save_figure(fig, (left, right), path, title)
