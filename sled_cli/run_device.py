"""`sled run-device`: run a workload as one device; JSON lines of progress (lab.device_runner)."""
from __future__ import annotations

from lab.device_runner import run_workload
from lab.workload import load_workload
from sled.flags import builtin_aliases, positive_int


def add_arguments(parser) -> None:
    parser.add_argument("--server", required=True, help="HOST:PORT of a sled server")
    parser.add_argument("--drafter", default="ngram",
                        help="ngram, ngram:N, cacheback[:NAME=N...], hier:CHEAP>MODEL, hf:PATH_OR_ID, "
                             "gguf:ALIAS_OR_FILE, onnx:ALIAS_OR_DIR "
                             f"(built-in aliases: {builtin_aliases()})")
    parser.add_argument("--workload", default="humaneval:3", help="humaneval[:N] or a prompt file")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64,
                        help="new tokens per prompt")
    parser.add_argument("--draft-len", type=positive_int, default=4,
                        help="tokens drafted per round")
    parser.add_argument("--name", default="device", help="the device's name in its progress")


async def run(args) -> int:
    return await run_workload(args.server, args.drafter, load_workload(args.workload),
                              name=args.name, max_new_tokens=args.max_new_tokens,
                              draft_len=args.draft_len)
