"""`sled demo`: a server and three devices on this machine (lab.demo)."""
from __future__ import annotations

from sled_cli.flags import positive_int


def add_arguments(parser) -> None:
    parser.add_argument("--max-new-tokens", type=positive_int, default=48,
                        help="new tokens per prompt")
    parser.add_argument("--prompts", type=positive_int, default=3,
                        help="HumanEval prompts per device")


async def run(args) -> int:
    from lab.demo import run_demo

    return await run_demo(args.prompts, args.max_new_tokens)
