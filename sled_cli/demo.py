"""`sled demo`: a server and three devices on this machine (lab.demo)."""
from __future__ import annotations

from lab.demo import run_demo
from sled.flags import positive_int


def add_arguments(parser) -> None:
    parser.add_argument("--max-new-tokens", type=positive_int, default=48,
                        help="new tokens per prompt")
    parser.add_argument("--prompts", type=positive_int, default=3,
                        help="HumanEval prompts per device")
    parser.add_argument("--simulated-devices", type=positive_int, default=512,
                        help="the larger fleet of the closing table, against a simulated H200 "
                             "(the smaller is the demo's three devices)")


async def run(args) -> int:
    return await run_demo(args.prompts, args.max_new_tokens, args.simulated_devices)
