"""`sled run-device`: run a workload as one device; JSON lines of progress (lab.device_runner)."""
from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("--server", required=True)
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--workload", default="humaneval:3", help="humaneval[:N] or a prompt file")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--name", default="device")


async def run(args) -> int:
    from lab.device_runner import run_workload
    from lab.workload import load_workload

    return await run_workload(args.server, args.drafter, load_workload(args.workload),
                              name=args.name, max_new_tokens=args.max_new_tokens,
                              draft_len=args.draft_len)
