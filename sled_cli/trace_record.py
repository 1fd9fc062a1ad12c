"""`sled trace record`: a drafter's proposals along the target's greedy output, saved as a trace
file that emulated devices replay (lab.traces)."""
from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from lab.bench.harness import add_recording_flags
from lab.traces.record import default_specs, record_trace_set
from sled.flags import builtin_aliases


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None,
                        help=f"target: a built-in alias ({builtin_aliases()}) or a checkpoint path "
                             "(default: a tiny random one)")
    add_recording_flags(parser, max_new_tokens=48)
    parser.add_argument("--dtype", default="float32", help="the target's dtype")
    parser.add_argument("--out", required=True, help="trace file (.jsonl)")


def run(args) -> int:
    console = Console(stderr=True)
    model, drafter = default_specs(args.model, args.drafter)
    try:
        traces = record_trace_set(model, drafter, args.workload, args.max_new_tokens,
                                  args.max_draft_len, args.dtype, args.prompts, console)
    except (ValueError, OSError) as exc:
        print(f"sled trace record: {exc}", file=sys.stderr)
        return 2
    path = traces.save(Path(args.out))
    tokens = sum(len(t.target_ids) for t in traces.traces)
    ms = sum(t.draft_ms_per_token * len(t.target_ids) for t in traces.traces) / max(tokens, 1)
    console.print(f"wrote {path}: {len(traces.traces)} prompts, {tokens} target tokens, "
                  f"drafter {drafter} at {ms:.2f} ms/token here")
    return 0
