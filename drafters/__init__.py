"""Drafters: one per file behind the small protocol in drafters.base.

Specs: "ngram" or "ngram:N" (prompt lookup, longest n-gram N), "hf:PATH_OR_ID" (transformers),
"onnx:DIR" (an onnxruntime-genai export: sled export-onnx), "gguf:FILE" (llama.cpp).
"""
from __future__ import annotations

from drafters.base import Drafter, Proposal, SparseQ


def load_drafter(spec: str, q_support: int = 32) -> Drafter:
    kind, _, arg = spec.partition(":")
    if kind == "ngram":
        from drafters.ngram import NgramDrafter
        try:
            return NgramDrafter(max_ngram=int(arg)) if arg else NgramDrafter()
        except ValueError as exc:  # "ngram:x", "ngram:0": say which spec was wrong
            raise ValueError(f"bad drafter spec {spec!r}: {exc}; "
                             "use ngram or ngram:N with N >= 1") from None
    if kind == "hf" and arg:
        from drafters.hf import HFDrafter
        return HFDrafter.load(arg, q_support=q_support)
    if kind == "onnx" and arg:
        from drafters.onnx import ONNXDrafter
        return ONNXDrafter(arg, q_support=q_support)
    if kind == "gguf" and arg:
        from drafters.gguf import GGUFDrafter
        return GGUFDrafter(arg, q_support=q_support)
    raise ValueError(f"unknown drafter spec {spec!r}: use ngram, ngram:N, hf:PATH_OR_ID, onnx:DIR "
                     "or gguf:FILE")


__all__ = ["Drafter", "Proposal", "SparseQ", "load_drafter"]
