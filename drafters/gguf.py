"""A GGUF model as drafter on llama.cpp (llama-cpp-python): the quantized edge runtime.

Spec "gguf:FILE". Threads: the n_threads argument, else the SLED_DRAFTER_THREADS environment
variable, else llama-cpp-python's default (half the CPU cores for decoding).

Like drafters.hf it keeps the KV cache of the tokens it has seen: each proposal evaluates only the
new suffix of the context, and rollback() drops the cache past the committed length.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections.abc import Sequence
from pathlib import Path

import llama_cpp
import numpy as np
import torch

from drafters.base import Proposal, SparseQ, choose_token, common_prefix
from sled.sampling import Sampling

_FINGERPRINTS: dict[str, str] = {}  # cache key (file, size, mtime, transformers) -> fingerprint


class GGUFDrafter:
    def __init__(self, path: str | Path, n_threads: int | None = None, n_ctx: int = 4096,
                 q_support: int = 32) -> None:
        self.path = Path(path)
        self.llm = open_llama(self.path, n_threads, n_ctx)
        self.name = f"gguf:{self.path}"
        self.q_support = q_support
        self.n_ctx = len(self.llm.input_ids)  # the binding holds n_ctx (llama.cpp pads to 256s)
        self.n_vocab = self.llm.n_vocab()
        self.evaluated = 0               # tokens run through the model so far (prefill + drafts)
        self._seen: list[int] = []       # tokens whose keys/values are in llama.cpp's KV cache

    @property
    def tokenizer_fingerprint(self) -> str:
        return gguf_fingerprint(self.path)

    def propose(self, context: Sequence[int], k: int, sampling: Sampling,
                generator: torch.Generator | None = None) -> Proposal:
        if len(context) + k - 1 > self.n_ctx:
            raise ValueError(f"{len(context)} context + {k} draft tokens exceed the drafter's "
                             f"n_ctx {self.n_ctx}")
        # Reuse the cached prefix; at least the last context token is fed to get fresh logits.
        keep = min(common_prefix(self._seen, context), len(context) - 1)
        self.rollback(keep)
        logits = self._feed(list(context[keep:]))
        draft: list[int] = []
        qs: list[SparseQ] = []
        for j in range(k):
            # Greedy is a numpy argmax over llama.cpp's buffer: no per-token copy into torch.
            token, q = choose_token(logits, sampling, self.q_support, generator)
            draft.append(token)
            if q is not None:
                qs.append(q)
            if j + 1 < k:
                logits = self._feed([token])
        return Proposal(draft, qs if qs else None)

    def rollback(self, length: int) -> None:
        if length < len(self._seen):
            memory = llama_cpp.llama_get_memory(self.llm.ctx)
            if not llama_cpp.llama_memory_seq_rm(memory, 0, length, -1):
                # This cache cannot drop a suffix (recurrent models): start over.
                llama_cpp.llama_memory_clear(memory, True)
                length = 0
            self.llm.n_tokens = length
            del self._seen[length:]

    def _feed(self, tokens: list[int]) -> np.ndarray:
        """Evaluate new tokens at the next positions; the logits after the last one: [vocab].

        The array is a view of llama.cpp's buffer, valid until the next evaluation.
        """
        self.llm.eval(tokens)  # decodes in n_batch chunks from llm.n_tokens, logits for the last
        self._seen.extend(tokens)
        self.evaluated += len(tokens)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1),
                                     shape=(self.n_vocab,))


def open_llama(path: Path, n_threads: int | None = None, n_ctx: int = 4096) -> llama_cpp.Llama:
    """The llama.cpp model and context the drafter runs on (also what the bench compares with)."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF drafter: no such file: {path}")
    threads = n_threads or int(os.environ.get("SLED_DRAFTER_THREADS") or 0) or None
    # verbose=False still lets llama.cpp's warnings through (llama-cpp-python maps its log
    # levels off by one), so swallow the load-time chatter; a failed load raises anyway.
    # swa_full (llama.cpp's default too): sliding-window layers keep every position, so a
    # rollback never needs cells the window has recycled (gemma3).
    with contextlib.redirect_stderr(io.StringIO()):
        return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                               swa_full=True, verbose=False)


def gguf_fingerprint(path: Path) -> str:
    """sled.fingerprint of the tokenizer transformers converts from this GGUF file.

    That is what a target loaded (or converted) from the same GGUF reports, so a drafter and a
    target from one file match. The conversion takes seconds (gemma3: ~20 s), so the result is
    cached in memory and in $SLED_CACHE/fingerprints, keyed by file, size, mtime and the
    transformers version (the conversion's rules change between versions).
    """
    import transformers

    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    if key in _FINGERPRINTS:
        return _FINGERPRINTS[key]
    cache = Path(os.environ.get("SLED_CACHE", Path.home() / ".cache" / "sled")) / "fingerprints"
    file = cache / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".txt")
    if file.exists():
        fingerprint = file.read_text().strip()
    else:
        from sled.fingerprint import fingerprint_tokenizer

        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        fingerprint = fingerprint_tokenizer(tokenizer)
        cache.mkdir(parents=True, exist_ok=True)
        partial = file.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(fingerprint + "\n")
        partial.replace(file)  # atomic: a concurrent reader sees all of it or nothing
    _FINGERPRINTS[key] = fingerprint
    return fingerprint
