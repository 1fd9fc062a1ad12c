"""`sled demo`: a server and three devices on this machine (lab.demo)."""
from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=3, help="HumanEval prompts per device")


async def run(args) -> int:
    from lab.demo import run_demo

    return await run_demo(args.prompts, args.max_new_tokens)
