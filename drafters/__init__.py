"""Drafters: one per file behind the small protocol in drafters.base.

Specs: "ngram" or "ngram:N" (prompt lookup, longest n-gram N), "cacheback" or
"cacheback:NAME=N:..." (an LRU table of what followed what, shared by the device's sessions;
NAME one of leader, follower, size, width), "hier:CHEAP>MODEL" (CHEAP's guesses checked by the
model drafter MODEL in one evaluation), "xtok:MODEL" (the model drafter MODEL with a tokenizer
other than the target's, re-tokenized at the text boundary), "hf:PATH_OR_ID" (transformers),
"onnx:DIR" or "onnx:ALIAS[-PRECISION]" (an onnxruntime-genai export: sled export-onnx),
"gguf:FILE" or "gguf:ALIAS" (llama.cpp). ALIAS names a built-in model (sled.models).
Any other KIND:ARG is looked up among the installed `sled.drafters` entry points: a package
registers a loader (ARG, q_support) -> Drafter under the kind's name. The lab registers
`trace:FILE` that way (emulated devices replaying a trace file), so the daemon drafts from a
trace without importing the lab.
load_drafter is the one place a spec becomes a drafter: every caller accepts every spec.
"""
from __future__ import annotations

from contextlib import nullcontext
from difflib import get_close_matches
from pathlib import Path

from drafters.base import Drafter, Proposal, SparseQ
from drafters.cacheback import CachebackDrafter, parse_options
from drafters.capabilities import Capabilities, capabilities_of
from drafters.cross_tokenizer import CrossTokenizerDrafter
from drafters.hier import HierDrafter
from drafters.ngram import NgramDrafter
from drafters.onnx_export import resolve_onnx
from sled.extras import require_extra
from sled.models import BUILTIN, gguf_path
from sled.plugins import plugin, plugin_names
from sled.progress import phase

SPECS = ("ngram, ngram:N, cacheback[:NAME=N...], hier:CHEAP>MODEL, xtok:MODEL, hf:PATH_OR_ID, "
         "onnx:ALIAS_OR_DIR or gguf:ALIAS_OR_FILE")
RUNTIMES = ("hf", "onnx", "gguf")   # the model drafters; each kind is also the extra it needs
PLUGINS = "sled.drafters"           # the entry point group of drafter kinds other packages add


def resolve_spec(spec: str) -> str:
    """gguf:ALIAS -> gguf:/path/to/the.gguf for a built-in alias; onnx:ALIAS (int4) or
    onnx:ALIAS-PRECISION -> onnx:/its/cached/export (exported on first use); others unchanged."""
    kind, _, arg = spec.partition(":")
    if kind == "onnx" and arg:
        return f"onnx:{resolve_onnx(arg)}"
    return f"gguf:{gguf_path(arg)}" if kind == "gguf" and arg in BUILTIN else spec


def check_alias(kind: str, arg: str) -> None:
    """A bare name after gguf: or onnx: that is neither a file nor a built-in alias (a typo such
    as gguf:gemma3-270): say so and list the aliases. A path is left to the drafter to report."""
    bare = Path(arg).name == arg and not arg.endswith(".gguf")
    if kind not in ("gguf", "onnx") or not arg or not bare or Path(arg).exists():
        return
    what = "file" if kind == "gguf" else "folder"
    close = get_close_matches(arg, BUILTIN, n=1)
    hint = f" (did you mean {kind}:{close[0]}?)" if close else ""
    raise ValueError(f"drafter {kind}:{arg} is neither a {what} nor a built-in alias{hint}; "
                     f"built-in aliases: {', '.join(BUILTIN)}")


def load_drafter(spec: str, q_support: int = 32) -> Drafter:
    """The drafter SPEC names; one loaded from a built-in alias keeps it as `alias`, the name a
    person gave it (its `name` says which file it is)."""
    if spec.startswith("hier:"):
        return _load_hier(spec, q_support)
    if spec.startswith("xtok:"):
        return _load_xtok(spec, q_support)
    require_runtime(spec)   # a missing extra is said before anything resolves or loads
    resolved = resolve_spec(spec)
    check_alias(*resolved.partition(":")[::2])   # a typo is said before anything loads
    with _loading(spec, resolved):
        drafter = _load_resolved(spec, resolved, q_support)
    if resolved != spec:
        drafter.alias = spec
    return drafter


def _load_hier(spec: str, q_support: int) -> Drafter:
    """hier:CHEAP>MODEL: both loaded as any spec is."""
    cheap, sep, model = spec.removeprefix("hier:").partition(">")
    if not sep or not cheap or not model or cheap.startswith("hier:") or model.startswith("hier:"):
        raise ValueError(f"bad drafter spec {spec!r}: use hier:CHEAP>MODEL, e.g. "
                         "hier:cacheback>gguf:gemma3-270m")
    return HierDrafter(load_drafter(cheap, q_support), load_drafter(model, q_support))


def _load_xtok(spec: str, q_support: int) -> Drafter:
    """xtok:MODEL: the model drafter loaded as any spec is, with its own tokenizer."""
    model = spec.removeprefix("xtok:")
    kind, _, arg = model.partition(":")
    if not model:
        raise ValueError(f"bad drafter spec {spec!r}: use xtok:MODEL, e.g. xtok:gguf:smollm2-135m")
    if kind == "xtok":
        raise ValueError(f"bad drafter spec {spec!r}: xtok: wraps a model drafter, not another "
                         "xtok: drafter; use xtok:MODEL, e.g. xtok:gguf:smollm2-135m")
    if kind not in RUNTIMES or not arg:
        raise ValueError(f"bad drafter spec {spec!r}: {model} has no tokenizer of its own to "
                         "re-tokenize (it drafts in the target's ids already); xtok: wraps a "
                         "model drafter: gguf:, onnx: or hf:")
    return CrossTokenizerDrafter.around(load_drafter(model, q_support))


def bind_target_tokenizer(drafter, tokenizer) -> None:
    """Hand the target's tokenizer to a drafter that drafts across tokenizers (xtok:), once it
    is known; other drafters need none."""
    if capabilities_of(drafter).target_tokenizer:
        drafter.bind_target_tokenizer(tokenizer)


def require_runtime(spec: str) -> None:
    """MissingExtra (sled.extras) when the runtime SPEC's kind drafts on is not installed."""
    kind, _, arg = spec.partition(":")
    if kind in RUNTIMES and arg:
        require_extra(kind, f"the {kind} drafter")


def _load_resolved(spec: str, resolved: str, q_support: int) -> Drafter:
    kind, _, arg = resolved.partition(":")
    if kind == "ngram":
        try:
            return NgramDrafter(max_ngram=int(arg)) if arg else NgramDrafter()
        except ValueError as exc:  # "ngram:x", "ngram:0": say which spec was wrong
            raise ValueError(f"bad drafter spec {spec!r}: {exc}; "
                             "use ngram or ngram:N with N >= 1") from None
    if kind == "cacheback":
        try:
            return CachebackDrafter(**parse_options(arg))
        except ValueError as exc:
            raise ValueError(f"bad drafter spec {spec!r}: {exc}") from None
    # Each runtime is imported only when its drafter is chosen: onnxruntime-genai and
    # llama-cpp-python are extras a device may lack, and torch/transformers stay off the device.
    if kind == "hf" and arg:
        from drafters.hf import HFDrafter
        return HFDrafter.load(arg, q_support=q_support)
    if kind == "onnx" and arg:
        from drafters.onnx import ONNXDrafter
        return ONNXDrafter(arg, q_support=q_support)
    if kind == "gguf" and arg:
        from drafters.gguf import GGUFDrafter
        return GGUFDrafter(arg, q_support=q_support)
    lent = plugin(PLUGINS, kind)
    if lent is not None:
        return lent.load()(arg, q_support)
    raise ValueError(f"unknown drafter spec {spec!r}: use {SPECS}{_plugin_hint()}")


def _plugin_hint() -> str:
    kinds = plugin_names(PLUGINS)
    return f", or one of the installed kinds {', '.join(k + ':ARG' for k in kinds)}" if kinds else ""


def _loading(spec: str, resolved: str):
    """A progress line (sled.progress) while a model drafter loads; nothing for the others."""
    kind, _, arg = resolved.partition(":")
    if kind in ("hf", "onnx", "gguf") and arg:
        return phase("drafter", f"loading the drafter {spec}")
    return nullcontext()


__all__ = ["Capabilities", "Drafter", "Proposal", "SparseQ", "bind_target_tokenizer",
           "capabilities_of", "load_drafter", "resolve_spec"]
