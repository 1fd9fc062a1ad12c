"""An ONNX export as drafter on onnxruntime-genai: spec "onnx:DIR", a `sled export-onnx` folder.

Threads: the n_threads argument, else the SLED_DRAFTER_THREADS environment variable, else
onnxruntime's default (one per core). They are the decoder session's intra_op_num_threads, set by
overlaying genai_config.json through og.Config, so the export folder itself is left unchanged.

Like drafters.hf it keeps the KV cache of the tokens it has seen (the og.Generator's sequence):
each proposal appends only the new suffix of the context, and rollback() is generator.rewind_to(),
so a round never re-runs the prefix.
"""
from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path

import numpy as np
import onnxruntime_genai as og

from drafters.base import (KVDrafter, drafter_threads, read_fingerprint, tokenizer_json_fingerprint,
                           write_fingerprint)
from sled.cache import cache_dir
from sled.progress import phase


DEFAULT_MAX_LENGTH = 4096  # context + draft positions a drafter holds (the GGUF drafter's n_ctx)


class ONNXDrafter(KVDrafter):
    capacity_name = "max_length"

    def __init__(self, path: str | Path, n_threads: int | None = None, q_support: int = 32,
                 max_length: int | None = DEFAULT_MAX_LENGTH) -> None:
        super().__init__()
        self.path = Path(path)
        if not (self.path / "genai_config.json").is_file():
            raise FileNotFoundError(f"ONNX drafter: {self.path} is not an onnxruntime-genai model "
                                    "folder (no genai_config.json); make one with sled export-onnx")
        config = og.Config(str(self.path))
        threads = drafter_threads(n_threads)
        if threads:
            config.overlay(json.dumps(
                {"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        params = og.GeneratorParams(self.model)
        # The KV buffer is allocated for max_length up front: cap the model's context length
        # (gemma3: 32k positions, ~1.2 GB in fp32) unless asked for more; None keeps it whole.
        context_length = int(params.get_search_options()["max_length"])
        if max_length and max_length < context_length:
            params.set_search_options(max_length=max_length)
        self.max_length = int(params.get_search_options()["max_length"])
        self.capacity = self.max_length
        self.generator = og.Generator(self.model, params)
        self.name = f"onnx:{self.path}"
        self.q_support = q_support
        self.n_threads = threads

    @cached_property
    def tokenizer_fingerprint(self) -> str:
        """Of the HF tokenizer files the model builder copied into the export folder: read from
        $SLED_CACHE/fingerprints while tokenizer.json keeps its size and mtime, else computed
        (sled.progress shows it) and kept there."""
        path = (self.path / "tokenizer.json").resolve()
        stat = path.stat()
        key = f"onnx|{path}|{stat.st_size}|{stat.st_mtime_ns}"
        name = hashlib.sha256(key.encode()).hexdigest()[:32] + ".json"
        file = cache_dir() / "fingerprints" / name
        fingerprint = read_fingerprint(file, key)
        if fingerprint is None:
            with phase("drafter.fingerprint", f"fingerprinting the tokenizer of {self.path.name}"):
                fingerprint = tokenizer_json_fingerprint(path)
            write_fingerprint(file, key, fingerprint)
        return fingerprint

    def _truncate(self, length: int) -> int:
        self.generator.rewind_to(length)
        return length

    def _run(self, tokens: list[int]) -> np.ndarray:  # [vocab]
        self.generator.append_tokens(np.asarray(tokens, dtype=np.int32))
        # get_logits() is a copy of the last position's logits only: [batch 1, 1, vocab].
        return self.generator.get_logits().reshape(-1)
