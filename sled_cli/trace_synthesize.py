"""`sled trace synthesize`: a trace file for emulated devices from a stated acceptance process
(lab.traces.synthetic) along a running server's own server-mode output: for a target whose text
means nothing (synthetic:NAME) or a drafter that cannot run here."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc

from edge_client.connection import Connection
from edge_client.server_side import generate_server_side
from edge_client.wire import SessionRequest
from lab.bench.harness import add_max_draft_len_flag, add_workload_flags
from lab.traces.format import TraceSet
from lab.traces.synthetic import (SyntheticDrafter, acceptance_profile, check_profile,
                                  synthetic_trace_set)
from lab.workload import prompt_texts
from sled.flags import non_negative_float, non_negative_int, positive_int


def add_arguments(parser) -> None:
    parser.add_argument("--server", required=True, help="HOST:PORT of the sled server whose "
                        "target the traces are for (plaintext)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--acceptance", default=None,
                        help="the profile: conditional acceptance of draft positions 1, 2, ..., "
                             "comma-separated, e.g. 0.9,0.85,0.8 (the last one repeats)")
    source.add_argument("--calibrate", default=None,
                        help="a `sled trace record` file of a real pair to measure the profile from")
    add_workload_flags(parser, default="humaneval:16", max_new_tokens=128)
    parser.add_argument("--prompts", type=positive_int, default=None,
                        help="use at most this many prompts")
    add_max_draft_len_flag(parser)
    parser.add_argument("--draft-ms-per-token", type=non_negative_float, default=0.0,
                        help="drafting time kept in the traces (a device profile overrides it)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="the draws' seed")
    parser.add_argument("--out", required=True, help="trace file (.jsonl)")


def run(args) -> int:
    try:
        if args.calibrate:
            profile = acceptance_profile(TraceSet.load(args.calibrate), args.max_draft_len)
            source = f"calibrated from {Path(args.calibrate).name}"
        else:
            profile = check_profile(args.acceptance.split(","))
            source = "given"
    except (ValueError, OSError) as exc:
        print(f"sled trace synthesize: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_synthesize(args, profile, f"{source}: {','.join(map(str, profile))}"))


async def _synthesize(args, profile: list[float], source: str) -> int:
    async with Connection(args.server) as conn:
        try:
            info = await conn.model_info(timeout=15, wait_for_ready=False)
            tokenizer = await conn.tokenizer()
        except grpc.aio.AioRpcError as exc:
            print(f"sled trace synthesize: {await conn.explain(exc)}", file=sys.stderr)
            return 3
        prompts = [tokenizer(t).input_ids for t in prompt_texts(args.workload, args.prompts)]
        outputs = []
        for i, prompt in enumerate(prompts):   # the server's own output: what replays must match
            result = await generate_server_side(
                conn.stub, SessionRequest(prompt, max_new_tokens=args.max_new_tokens))
            outputs.append(result.token_ids)
            print(f"sled trace synthesize: {i + 1} of {len(prompts)} server-mode outputs",
                  file=sys.stderr, flush=True)
    drafter = SyntheticDrafter(profile, args.max_draft_len, args.seed, source,
                               args.draft_ms_per_token)
    traces = synthetic_trace_set(prompts, outputs, drafter, info.vocab_size, info.model_id,
                                 info.tokenizer_fingerprint)
    path = traces.save(Path(args.out))
    print(f"wrote {path}: {len(prompts)} prompts, {sum(map(len, outputs))} target tokens, "
          f"profile {source}", file=sys.stderr)
    return 0
