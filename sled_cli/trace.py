"""`sled trace record`: the target's greedy output for each workload prompt, and a real drafter's
proposal at every position of it, saved as a trace file that emulated devices replay
(drafters/trace.py). With no --model, a tiny random target + drafter pair made on the fly."""
from __future__ import annotations

import sys
from pathlib import Path


def tiny_pair() -> tuple[str, str]:
    """The cached tiny random target and its perturbed drafter (written on first use)."""
    from sled.cache import cache_dir
    from sled_cli.tiny import save_pair

    target, drafter = save_pair(cache_dir() / "tiny")
    return str(target), str(drafter)


def default_specs(model: str | None, drafter: str | None) -> tuple[str, str]:
    """(target, drafter spec): the tiny pair when no model is named; ngram when no drafter is."""
    if model is None:
        target, tiny_drafter = tiny_pair()
        return target, drafter or f"hf:{tiny_drafter}"
    return model, drafter or "ngram"


def workload_ids(workload: str, tokenizer, limit: int | None = None) -> list[list[int]]:
    """Prompt ids of a workload spec (sled_cli/workload.py) or, for "tiny", the tiny corpus."""
    from sled_cli.tiny import CORPUS
    from sled_cli.workload import load_workload

    texts = list(dict.fromkeys(CORPUS)) if workload == "tiny" else load_workload(workload)
    return [tokenizer(text).input_ids for text in texts[:limit]]


def greedy_outputs(target, prompts: list[list[int]], max_new_tokens: int, progress=None) -> list[list[int]]:
    """The target's own greedy continuation of each prompt (transformers generate, do_sample=False),
    cut after EOS as the server cuts it."""
    import torch

    tokenizer = target.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (target.eos_ids or (0,))[0]
    task = progress.add_task("target greedy output", total=len(prompts)) if progress is not None else None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=target.device)
            out = target.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                        pad_token_id=pad, eos_token_id=list(target.eos_ids) or None)
            outputs.append(out[0, len(prompt):].tolist())
            if task is not None:
                progress.advance(task)
    return outputs


def record_trace_set(model: str, drafter_spec: str, workload: str, max_new_tokens: int, max_k: int,
                     dtype: str = "float32", prompts_limit: int | None = None, console=None):
    """Load the target (alias or path), take its greedy outputs, drive the drafter along them."""
    from rich.progress import Progress
    from transformers.utils import logging as hf_logging

    from drafters import load_drafter
    from drafters.trace import TraceSet, record_traces
    from sled.models import resolve_model
    from verify_server.target import Target

    hf_logging.disable_progress_bar()
    target = Target.load(resolve_model(model), dtype=dtype)
    prompts = workload_ids(workload, target.tokenizer, prompts_limit)
    drafter = load_drafter(drafter_spec)
    if drafter.tokenizer_fingerprint not in (None, target.fingerprint):
        raise ValueError(f"drafter {drafter_spec} does not share the tokenizer of target {model}")
    with Progress(console=console, transient=True) as progress:
        outputs = greedy_outputs(target, prompts, max_new_tokens, progress)
        traces = record_traces(drafter, prompts, outputs, max_k, progress)
    for trace in traces:
        trace.tokenizer_fingerprint = target.fingerprint
    return TraceSet(target=model, drafter=drafter_spec, max_k=max_k, traces=traces,
                    tokenizer_fingerprint=target.fingerprint)


def run_trace_record(args) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    model, drafter = default_specs(args.model, args.drafter)
    try:
        traces = record_trace_set(model, drafter, args.workload, args.max_new_tokens, args.max_k,
                                  args.dtype, args.prompts, console)
    except (ValueError, OSError) as exc:
        print(f"sled trace record: {exc}", file=sys.stderr)
        return 2
    path = traces.save(Path(args.out))
    tokens = sum(len(t.target_ids) for t in traces.traces)
    ms = sum(t.draft_ms_per_token * len(t.target_ids) for t in traces.traces) / max(tokens, 1)
    console.print(f"wrote {path}: {len(traces.traces)} prompts, {tokens} target tokens, "
                  f"drafter {drafter} at {ms:.2f} ms/token here")
    return 0


def traces_for(args, console):
    """(target, TraceSet) for a benchmark: --traces FILE, else recorded now with the default
    (or --model/--drafter) pair over --workload."""
    from drafters.trace import TraceSet

    if args.traces:
        traces = TraceSet.load(args.traces)
        return args.model or traces.target, traces
    model, drafter = default_specs(args.model, args.drafter)
    console.print(f"recording {drafter} traces against {model}")
    return model, record_trace_set(model, drafter, args.workload, args.max_new_tokens,
                                   args.max_k, args.dtype, args.prompts, console)
