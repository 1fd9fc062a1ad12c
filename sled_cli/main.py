"""`sled`: one command line for the server, the device side, benchmarks and the demo."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run the shared verify server")
    p.add_argument("--model", required=True, help="target: local path or HF id (safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
    p.add_argument("--dtype", default="float32", help="float32, float64, bfloat16, float16")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda:0")
    p.add_argument("--trust-remote-code", action="store_true", help="run the model repo's own code")
    p.add_argument("--max-sessions", type=int, default=256)
    p.add_argument("--max-draft-tokens", type=int, default=32)
    p.add_argument("--max-batch-sessions", type=int, default=64)
    p.add_argument("--context-length", type=int, default=None, help="cap below the model's limit")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate on this device, verified by a server")
    p.add_argument("--server", required=True, help="HOST:PORT of a sled server")
    p.add_argument("--drafter", default="ngram", help="ngram, ngram:N, hf:PATH_OR_ID")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-len", type=int, default=4, help="tokens drafted per round (k)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-id", type=int, action="append", default=[], help="extra stop token id")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True)
    o = bench.add_parser("overhead", help="per-round gRPC + scheduling overhead on loopback")
    o.add_argument("--model", default=None, help="target path (default: a tiny random model)")
    o.add_argument("--drafter", default="ngram")
    o.add_argument("--sessions", type=int, default=1, help="concurrent device sessions")
    o.add_argument("--rounds", type=int, default=300, help="rounds per session (at least)")
    o.add_argument("--draft-len", type=int, default=4)
    o.add_argument("--out", default="bench-results/overhead.json")


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="loopback demo: a server and several devices on this machine")
    p.add_argument("--max-new-tokens", type=int, default=48)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sled", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_generate(sub)
    _add_bench(sub)
    _add_demo(sub)
    t = sub.add_parser("make-tiny", help="write a tiny random target + drafter pair (testing)")
    t.add_argument("folder")
    t.add_argument("--arch", default="llama", choices=["llama", "gemma3"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.command == "serve" else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "serve":
        from sled_cli.serve import run_serve
        return run_serve(args)
    if args.command == "generate":
        from sled_cli.generate import run_generate
        return asyncio.run(run_generate(args))
    if args.command == "bench":
        from sled_cli.bench import run_overhead
        return asyncio.run(run_overhead(args))
    if args.command == "demo":
        from sled_cli.demo import run_demo
        return asyncio.run(run_demo(args))
    if args.command == "make-tiny":
        from sled_cli.tiny import save_pair
        for path in save_pair(args.folder, args.arch):
            print(path)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
