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
import logging
from pathlib import Path

import llama_cpp
import numpy as np

from drafters.base import (KVDrafter, drafter_threads, read_fingerprint, tokenizer_json_fingerprint,
                           write_fingerprint)
from sled.cache import cache_dir
from sled.progress import phase

log = logging.getLogger("sled.drafter")

_FINGERPRINTS: dict[str, str] = {}  # cache key (file, size, mtime, transformers) -> fingerprint


class GGUFDrafter(KVDrafter):
    capacity_name = "n_ctx"

    def __init__(self, path: str | Path, n_threads: int | None = None, n_ctx: int = 4096,
                 q_support: int = 32, converted: Path | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.converted = converted   # a transformers copy of this GGUF (a built-in's), if any
        self.llm = open_llama(self.path, n_threads, n_ctx)
        self.name = f"gguf:{self.path}"
        self.q_support = q_support
        self.n_ctx = len(self.llm.input_ids)  # the binding holds n_ctx (llama.cpp pads to 256s)
        self.capacity = self.n_ctx
        self.n_vocab = self.llm.n_vocab()

    @property
    def tokenizer_fingerprint(self) -> str:
        return gguf_fingerprint(self.path, self.converted)

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


def open_llama(path: Path, n_threads: int | None = None, n_ctx: int = 4096) -> llama_cpp.Llama:
    """The llama.cpp model and context the drafter runs on (also what the bench compares with)."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF drafter: no such file: {path}")
    threads = drafter_threads(n_threads)
    # verbose=False still lets llama.cpp's warnings through (llama-cpp-python maps its log
    # levels off by one), so swallow the load-time chatter; a failed load raises anyway.
    # swa_full (llama.cpp's default too): sliding-window layers keep every position, so a
    # rollback never needs cells the window has recycled (gemma3).
    with contextlib.redirect_stderr(io.StringIO()):
        return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                               swa_full=True, verbose=False)


def gguf_fingerprint(path: Path, converted: Path | None = None) -> str:
    """sled.fingerprint of the tokenizer transformers converts from this GGUF file.

    That is what a target loaded (or converted) from the same GGUF reports, so a drafter and a
    target from one file match. The conversion takes seconds (gemma3: ~20 s), so the result is
    cached in memory and in $SLED_CACHE/fingerprints, keyed by file, size, mtime and the
    transformers version (the conversion's rules change between versions; read from the package's
    metadata, so a cached fingerprint costs no import of transformers). A cached entry is
    used only when it is whole: it names its key, holds a well-formed fingerprint and a sha256
    of both (a truncated or altered entry is computed again). When the file is a built-in
    model's whose transformers copy is cached (CONVERTED), the fingerprint is read from that
    copy's tokenizer.json (a few seconds) instead of converting the GGUF again.
    """
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_transformers_version()}"
    if key in _FINGERPRINTS:
        return _FINGERPRINTS[key]
    file = cache_dir() / "fingerprints" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")
    fingerprint = read_fingerprint(file, key)
    if fingerprint is None:
        first = " (first use of this file, seconds)" if converted else \
            " (first use of this file, up to half a minute)"
        with phase("drafter.fingerprint", f"fingerprinting the tokenizer of {path.name}{first}"):
            fingerprint = _fingerprint_of(path, converted)
        write_fingerprint(file, key, fingerprint)
    else:
        log.debug("drafter tokenizer fingerprint of %s read from %s", path.name, file)
    _FINGERPRINTS[key] = fingerprint
    return fingerprint


def _transformers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "none"


def _fingerprint_of(path: Path, converted: Path | None) -> str:
    """The fingerprint from the converted copy's tokenizer.json when there is one, else from the
    tokenizer transformers converts out of the GGUF's metadata."""
    from sled.fingerprint import fingerprint_tokenizer

    if converted is not None and (converted / "tokenizer.json").is_file():
        return tokenizer_json_fingerprint(converted / "tokenizer.json")
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return fingerprint_tokenizer(tokenizer)
