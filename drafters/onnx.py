"""An ONNX export as drafter on onnxruntime-genai: spec "onnx:DIR", a `sled export-onnx` folder.

Threads: the n_threads argument, else the SLED_DRAFTER_THREADS environment variable, else
onnxruntime's default (one per core). They are the decoder session's intra_op_num_threads, set by
overlaying genai_config.json through og.Config, so the export folder itself is left unchanged.

Like drafters.hf it keeps the KV cache of the tokens it has seen (the og.Generator's sequence):
each proposal appends only the new suffix of the context, and rollback() is generator.rewind_to(),
so a round never re-runs the prefix.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
import onnxruntime_genai as og
import torch

from drafters.base import Proposal, SparseQ, choose_token, common_prefix
from sled.sampling import Sampling


class ONNXDrafter:
    def __init__(self, path: str | Path, n_threads: int | None = None, q_support: int = 32,
                 max_length: int | None = None) -> None:
        self.path = Path(path)
        if not (self.path / "genai_config.json").is_file():
            raise FileNotFoundError(f"ONNX drafter: {self.path} is not an onnxruntime-genai model "
                                    "folder (no genai_config.json); make one with sled export-onnx")
        config = og.Config(str(self.path))
        threads = n_threads or int(os.environ.get("SLED_DRAFTER_THREADS") or 0) or None
        if threads:
            config.overlay(json.dumps(
                {"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        params = og.GeneratorParams(self.model)
        if max_length:  # the KV buffer is allocated for max_length up front
            params.set_search_options(max_length=max_length)
        self.max_length = int(params.get_search_options()["max_length"])  # default: context_length
        self.generator = og.Generator(self.model, params)
        self.name = f"onnx:{self.path}"
        self.q_support = q_support
        self.n_threads = threads
        self.evaluated = 0               # tokens run through the model so far (prefill + drafts)
        self._seen: list[int] = []       # the generator's sequence: tokens whose KV is cached

    @cached_property
    def tokenizer_fingerprint(self) -> str:
        """Of the HF tokenizer files the model builder copied into the export folder."""
        from transformers import AutoTokenizer

        from sled.fingerprint import fingerprint_tokenizer

        return fingerprint_tokenizer(AutoTokenizer.from_pretrained(str(self.path)))

    def propose(self, context: Sequence[int], k: int, sampling: Sampling,
                generator: torch.Generator | None = None) -> Proposal:
        if len(context) + k - 1 > self.max_length:
            raise ValueError(f"{len(context)} context + {k} draft tokens exceed the drafter's "
                             f"max_length {self.max_length}")
        # Reuse the cached prefix; at least the last context token is fed to get fresh logits.
        keep = min(common_prefix(self._seen, context), len(context) - 1)
        self.rollback(keep)
        logits = self._feed(list(context[keep:]))
        draft: list[int] = []
        qs: list[SparseQ] = []
        for j in range(k):
            token, q = choose_token(logits, sampling, self.q_support, generator)
            draft.append(token)
            if q is not None:
                qs.append(q)
            if j + 1 < k:
                logits = self._feed([token])
        return Proposal(draft, qs if qs else None)

    def rollback(self, length: int) -> None:
        if length < len(self._seen):
            self.generator.rewind_to(length)
            del self._seen[length:]

    def _feed(self, tokens: list[int]) -> np.ndarray:
        """Run new tokens at the next positions; the logits after the last one: [vocab]."""
        self.generator.append_tokens(np.asarray(tokens, dtype=np.int32))
        self._seen.extend(tokens)
        self.evaluated += len(tokens)
        # get_logits() is a copy of the last position's logits only: [batch 1, 1, vocab].
        return self.generator.get_logits().reshape(-1)
