"""A GGUF model as drafter on llama.cpp (llama-cpp-python): the quantized edge runtime.

Spec "gguf:FILE". Threads: the n_threads argument, else the SLED_DRAFTER_THREADS environment
variable, else llama-cpp-python's default (half the CPU cores for decoding).

Like drafters.hf it keeps the KV cache of the tokens it has seen: each proposal evaluates only the
new suffix of the context, and rollback() drops the cache past the committed length.

Its tokenizer fingerprint comes from the file's own token table (gguf_fingerprint), read by
sled.gguf_metadata: no tokenizer is converted and transformers is never imported.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import logging
from pathlib import Path

import llama_cpp
import numpy as np

from drafters.base import KVDrafter, drafter_threads, read_fingerprint, write_fingerprint
from drafters.capabilities import Capabilities
from sled.cache import cache_dir
from sled.wire.fingerprint import fingerprint_vocab
from sled.gguf_metadata import read_metadata
from sled.progress import phase

log = logging.getLogger("sled.drafter")

MODEL_KEY, TOKENS_KEY = "tokenizer.ggml.model", "tokenizer.ggml.tokens"
# How gguf_vocab spells the tokens; a cached fingerprint made by other rules is made again.
RULES = "gguf-tokens-1"
_FINGERPRINTS: dict[str, str] = {}  # cache key (file, size, mtime, RULES) -> fingerprint
# Tokens per llama.cpp decode call when a prompt is fed (llama-cpp-python's default is 512).
N_BATCH = 128


class GGUFDrafter(KVDrafter):
    capacity_name = "n_ctx"
    capabilities = KVDrafter.capabilities | Capabilities(checks_guesses=True)

    def __init__(self, path: str | Path, n_threads: int | None = None, n_ctx: int = 4096,
                 q_support: int = 32) -> None:
        super().__init__()
        self.path = Path(path)
        self.llm = open_llama(self.path, n_threads, n_ctx)
        self.name = f"gguf:{self.path}"
        self.q_support = q_support
        self.n_ctx = len(self.llm.input_ids)  # the binding holds n_ctx (llama.cpp pads to 256s)
        self.capacity = self.n_ctx
        self.n_vocab = self.llm.n_vocab()

    @property
    def tokenizer_fingerprint(self) -> str:
        return gguf_fingerprint(self.path)

    def _truncate(self, length: int) -> int:
        memory = llama_cpp.llama_get_memory(self.llm.ctx)
        if not llama_cpp.llama_memory_seq_rm(memory, 0, length, -1):
            # This cache cannot drop a suffix (recurrent models): start over.
            llama_cpp.llama_memory_clear(memory, True)
            length = 0
        self.llm.n_tokens = length
        return length

    def _run(self, tokens: list[int]) -> np.ndarray:  # [vocab]
        """A view of llama.cpp's logits buffer, valid until the next evaluation; greedy takes a
        numpy argmax of it, with no per-token copy into torch."""
        self.llm.eval(tokens)  # decodes in n_batch chunks from llm.n_tokens, logits for the last
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1),
                                     shape=(self.n_vocab,))

    def _run_tail(self, tokens: list[int], rows: int) -> np.ndarray:  # [rows, vocab]
        """The head as _run does; the last `rows` tokens in one decode that keeps every row's
        logits (llama.cpp sizes its output buffer by the rows asked for, not by n_ctx)."""
        if rows > N_BATCH:
            raise ValueError(f"cannot check {rows - 1} tokens at once (at most {N_BATCH - 1})")
        head, tail = tokens[:-rows], tokens[-rows:]
        if head:
            self.llm.eval(head)
        n_past = self._truncate(self.llm.n_tokens)     # nothing stale after the tokens seen
        self.llm._batch.set_batch(batch=tail, n_past=n_past, logits_all=True)
        self.llm._ctx.decode(self.llm._batch)
        self.llm.input_ids[n_past:n_past + rows] = tail
        self.llm.n_tokens += rows
        return np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, i),
                                               shape=(self.n_vocab,)) for i in range(rows)])


def open_llama(path: Path, n_threads: int | None = None, n_ctx: int = 4096) -> llama_cpp.Llama:
    """The llama.cpp model and context the drafter runs on (also what the bench compares with)."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF drafter: no such file: {path}")
    threads = drafter_threads(n_threads)
    # verbose=False still lets llama.cpp's warnings through (llama-cpp-python maps its log
    # levels off by one), so swallow the load-time chatter; a failed load raises anyway.
    # swa_full (llama.cpp's default too): sliding-window layers keep every position, so a
    # rollback never needs cells the window has recycled (gemma3).
    # n_batch/n_ubatch: a prompt is fed N_BATCH tokens at a time (llama.cpp's compute buffer is
    # sized by it and grows with use: +31 MB for gemma3 at 512, +8 MB at 128), same logits.
    with contextlib.redirect_stderr(io.StringIO()):
        return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                               n_batch=N_BATCH, n_ubatch=N_BATCH, swa_full=True, verbose=False)


def gguf_fingerprint(path: Path) -> str:
    """sled.wire.fingerprint of the tokenizer the GGUF file carries in its metadata.

    The (id, token) table is tokenizer.ggml.tokens, spelled the way transformers' conversion of
    the same file spells it (gguf_vocab), so a drafter and a target loaded or converted from one
    file match, with no transformers on the device. Reading gemma3's 262k tokens takes about a
    second, so the result is cached in memory and in $SLED_CACHE/fingerprints, keyed by file,
    size, mtime and RULES. A cached entry is used only when it is whole: it names its key, holds a
    well-formed fingerprint and a sha256 of both (a truncated or altered entry is computed again).
    """
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{RULES}"
    if key in _FINGERPRINTS:
        return _FINGERPRINTS[key]
    file = cache_dir() / "fingerprints" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")
    fingerprint = read_fingerprint(file, key)
    if fingerprint is None:
        with phase("drafter.fingerprint", f"fingerprinting the tokenizer of {path.name} "
                   "(first use of this file, a few seconds)"):
            fingerprint = fingerprint_vocab(gguf_vocab(path))
        write_fingerprint(file, key, fingerprint)
    else:
        log.debug("drafter tokenizer fingerprint of %s read from %s", path.name, file)
    _FINGERPRINTS[key] = fingerprint
    return fingerprint


def gguf_vocab(path: Path) -> dict[str, int]:
    """token -> id from the file's tokenizer.ggml.tokens. A SentencePiece vocabulary
    (tokenizer.ggml.model "llama", e.g. gemma3) stores a space as " " where transformers' tokenizer
    says "\u2581"; a byte-level BPE one ("gpt2", e.g. smollm2) is taken as stored."""
    try:
        fields = read_metadata(path, (MODEL_KEY, TOKENS_KEY))
    except ValueError as exc:   # empty, cut short, hostile, or not GGUF at all
        raise ValueError(f"GGUF drafter: {exc}") from None
    if TOKENS_KEY not in fields:
        raise ValueError(f"GGUF drafter: {path} carries no tokenizer (no {TOKENS_KEY})")
    tokens = fields[TOKENS_KEY]
    if not isinstance(tokens, list) or not all(isinstance(token, str) for token in tokens):
        raise ValueError(f"GGUF drafter: {path}: {TOKENS_KEY} is not a list of strings")
    if fields.get(MODEL_KEY) == "llama":
        tokens = [token.replace(" ", "\u2581") for token in tokens]
    return {token: token_id for token_id, token in enumerate(tokens)}
