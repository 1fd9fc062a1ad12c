"""Recording drafter traces: the target's greedy output for each workload prompt, and a real
drafter's proposal at every position of it (lab.traces.format), for emulated devices to replay
(lab.traces.replay). With no model named, the tiny random target + drafter pair (lab.tiny).
"""
from __future__ import annotations

import shlex
import time
from collections.abc import Sequence

from rich.progress import Progress

from drafters import bind_target_tokenizer, load_drafter
from drafters.base import reports_confidence
from lab.traces.calibrated import calibrated_trace_set, is_calibrated
from lab.traces.format import Trace, TraceSet
from lab.workload import prompt_texts
from sled.models import resolve_model
from sled.wire.sampling import Sampling


def record_traces(drafter, prompts_ids: Sequence[Sequence[int]],
                  target_outputs: Sequence[Sequence[int]], max_draft_len: int,
                  progress=None) -> list[Trace]:
    """Drive a real drafter greedily along each target output, one proposal per position.

    The context grows by one target token per position; rolling the drafter back to the context
    after each proposal keeps the KV of the context, so each position costs one fed token plus
    max_draft_len - 1 drafted ones, not a prefill. A drafter that reports confidences
    (drafters.base.reports_confidence) has them recorded too. `progress` is an optional rich
    Progress.
    """
    if max_draft_len < 1:
        raise ValueError(f"max_draft_len must be >= 1, got {max_draft_len}")
    greedy = Sampling()
    options = {"with_confidence": True} if reports_confidence(drafter) else {}
    task = progress.add_task(f"recording {drafter.name}", total=sum(map(len, target_outputs))) \
        if progress is not None else None
    traces = []
    for prompt, target in zip(prompts_ids, target_outputs, strict=True):
        context = list(prompt)
        drafter.rollback(0)
        proposals: list[list[int]] = []
        confidences: list[list[float]] | None = [] if options else None
        seconds = 0.0
        for token in target:
            started = time.perf_counter()
            proposal = drafter.propose(context, max_draft_len, greedy, **options)
            seconds += time.perf_counter() - started
            proposals.append(list(proposal.token_ids))
            if confidences is not None:
                confidences.append([round(c, 6) for c in proposal.confidence])
            drafter.rollback(len(context))
            context.append(token)
            if task is not None:
                progress.advance(task)
        drafted = sum(map(len, proposals))
        traces.append(Trace(list(prompt), list(target), proposals,
                            seconds * 1e3 / drafted if drafted else 0.0, drafter.name,
                            drafter.tokenizer_fingerprint, confidences))
    return traces


def default_specs(model: str | None, drafter: str | None) -> tuple[str, str]:
    """(target, drafter spec): the tiny pair when no model is named; ngram when no drafter is."""
    if model is None:
        # not at the top: a device imports lab.traces (the trace drafter), which imports this
        # module, and lab.tiny imports torch
        from lab.tiny import cached_pair

        target, tiny_drafter = cached_pair()
        return target, drafter or f"hf:{tiny_drafter}"
    return model, drafter or "ngram"


def greedy_outputs(target, prompts: list[list[int]], max_new_tokens: int, progress=None) -> list[list[int]]:
    """The target's own greedy continuation of each prompt (transformers generate, do_sample=False),
    cut after EOS as the server cuts it."""
    # not at the top: no torch on the device side (see above)
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


def record_trace_set(model: str, drafter_spec: str, workload: str, max_new_tokens: int,
                     max_draft_len: int, dtype: str = "float32", prompts_limit: int | None = None,
                     console=None):
    """Load the target (alias or path), take its greedy outputs, drive the drafter along them."""
    # not at the top: no torch on the device side (see above)
    from verify_server.target import Target

    target = Target.load(resolve_model(model), dtype=dtype)
    prompts = [target.tokenizer(text).input_ids for text in prompt_texts(workload, prompts_limit)]
    drafter = load_drafter(drafter_spec)
    if drafter.tokenizer_fingerprint not in (None, target.fingerprint):
        raise ValueError(f"drafter {drafter_spec} does not share the tokenizer of target {model} "
                         f"(xtok:{drafter_spec} drafts across tokenizers)")
    bind_target_tokenizer(drafter, target.tokenizer)
    with Progress(console=console, transient=True) as progress:
        outputs = greedy_outputs(target, prompts, max_new_tokens, progress)
        traces = record_traces(drafter, prompts, outputs, max_draft_len, progress)
    for trace in traces:
        trace.tokenizer_fingerprint = target.fingerprint
    return TraceSet(target=model, drafter=drafter_spec, max_draft_len=max_draft_len, traces=traces,
                    tokenizer_fingerprint=target.fingerprint)


def traces_for(args, console):
    """(target, TraceSet) for a benchmark: --traces FILE, or calibrated:NAME (that pair's
    acceptance drawn along the target's greedy output), else recorded now with the default (or
    --model/--drafter) pair over --workload."""
    if args.traces and is_calibrated(args.traces):
        model = resolve_model(args.model or default_specs(None, None)[0])
        console.print(f"drawing {args.traces} traces along {model}'s greedy output")
        # the target as the benchmark's server computes it (its dtype, and torch device)
        server_args = ["--dtype", args.dtype, *shlex.split(getattr(args, "server_args", ""))]
        return model, calibrated_trace_set(args.traces, model, prompt_texts(args.workload,
                                           args.prompts), args.max_new_tokens, server_args)
    if args.traces:
        traces = TraceSet.load(args.traces)
        return args.model or traces.target, traces
    model, drafter = default_specs(args.model, args.drafter)
    console.print(f"recording {drafter} traces against {model}")
    return model, record_trace_set(model, drafter, args.workload, args.max_new_tokens,
                                   args.max_draft_len, args.dtype, args.prompts, console)
