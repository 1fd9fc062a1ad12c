"""`sled make-tiny FOLDER`: a tiny random target + drafter pair with a real tokenizer (testing)."""
from __future__ import annotations

from lab.tiny import save_pair


def add_arguments(parser) -> None:
    parser.add_argument("folder", help="where the pair is written")
    parser.add_argument("--arch", default="llama", choices=["llama", "gemma3"],
                        help="the architecture of both models")


def run(args) -> int:
    for path in save_pair(args.folder, args.arch):
        print(path)
    return 0
