"""An HF checkpoint (or a built-in alias) to an ONNX model with KV cache.

onnxruntime-genai's model builder does the work, in a child process (`python -m
drafters.onnx_export SOURCE OUT PRECISION EP`) whose output this process turns into a progress bar.
The result is a folder that drafters.onnx loads: model.onnx(.data), genai_config.json and the HF
tokenizer files. A built-in alias is first converted from its GGUF (sled.models.hf_checkpoint);
its export is cached under $SLED_CACHE/onnx/ALIAS-PRECISION, which is what onnx:ALIAS loads.

Builder quirks handled here (onnxruntime-genai 0.18, transformers 5):
  - gemma3: transformers 5 nests rope_parameters per layer type, the builder reads the flat form;
  - sliding-window models: windowed_kv_cache=false, else rewind_to() fails once the window cache
    has recycled the positions a rollback needs;
  - int8 with tied embeddings: shared_embeddings=false (the embedding Gather takes only 4 bits).

An export is written with its manifest (sled.cache.write_manifest) and a cached one is used only
while the manifest verifies (sizes and mtimes; a file is hashed only when its mtime moved, so the
250 MB model.onnx.data costs a stat per start); otherwise it is exported again. An export from
before manifests is kept only when it is structurally whole (its JSON files parse, and
model.onnx's external tensors all lie inside their data files), and is then given its manifest.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

from sled.cache import adopt, cache_dir, partial_dir, publish, verify_folder, write_manifest
from sled.extras import require_extra
from sled.models import BUILTIN, hf_checkpoint
from sled.progress import phase

PRECISIONS = ("int4", "int8", "fp32")
_LAYER = re.compile(r"(?:Reading layer |model[./]layers\.)(\d+)")  # reading, saving, quantizing


def alias_dir(alias: str, precision: str = "int4") -> Path:
    """Where the export of a built-in model is cached."""
    return cache_dir() / "onnx" / f"{alias}-{precision}"


def export_alias(alias: str, precision: str = "int4") -> Path:
    """The cached ONNX export of a built-in model, made on first use and again whenever the
    cached one does not verify."""
    out = alias_dir(alias, precision)
    if not (verify_folder(out) or adopt(out, export_is_whole)):   # or one from before manifests
        shutil.rmtree(out, ignore_errors=True)
        export(alias, out, precision)
    return out


def export_is_whole(out: Path) -> bool:
    """Its JSON files parse and every external tensor of model.onnx lies inside its data file
    (not judged without the onnx package, an export extra: then it is not adopted)."""
    if not (out / "model.onnx").is_file():
        return False
    try:   # the onnx package: the export extra, absent from a device's install
        import onnx
        from onnx.external_data_helper import ExternalDataInfo, uses_external_data
    except ImportError:
        return False
    try:
        for path in out.glob("*.json"):
            json.loads(path.read_bytes())
        model = onnx.load(str(out / "model.onnx"), load_external_data=False)
        for tensor in model.graph.initializer:
            if uses_external_data(tensor):
                info = ExternalDataInfo(tensor)
                data = out / Path(info.location).name
                if (info.offset or 0) + (info.length or 0) > data.stat().st_size:
                    return False
        return (out / "genai_config.json").is_file()
    except Exception:  # onnx raises its own decode errors on a damaged model.onnx
        return False


def resolve_onnx(arg: str) -> str:
    """"smollm2-135m" (int4) or "smollm2-135m-int8" -> its cached export; a folder unchanged."""
    if arg in BUILTIN:
        return str(export_alias(arg))
    for precision in PRECISIONS:
        if arg.endswith(f"-{precision}") and arg.removesuffix(f"-{precision}") in BUILTIN:
            return str(export_alias(arg.removesuffix(f"-{precision}"), precision))
    return arg


def export(source: str, out: str | Path, precision: str = "int4",
           execution_provider: str = "cpu") -> Path:
    """Export SOURCE (an HF checkpoint folder or a built-in alias) into the folder OUT."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    require_extra("export", f"exporting {source} to ONNX")   # the model builder's modules
    checkpoint = hf_checkpoint(source) if source in BUILTIN else Path(source)
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"{source} is neither a built-in model ({', '.join(BUILTIN)}) "
                                "nor an HF checkpoint folder (no config.json)")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / "genai_config.json").exists():
        raise FileExistsError(f"{out} exists and is not an ONNX export: choose an empty folder")
    # Build beside OUT and swap it in at the end: OUT is either a whole export or untouched.
    partial = partial_dir(out)
    console = Console(stderr=True)
    try:
        with _said(console, f"exporting {source} to ONNX ({precision})"):
            _run_builder(source, checkpoint, partial, precision, execution_provider, console)
        write_manifest(partial)
        publish(partial, out)  # a concurrent export of the same model may get there first
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    console.print(f"exported {source} ({precision}) -> {out}")
    return out


def _said(console, message: str):
    """A terminal gets the builder's progress bar; anywhere else (a pipe, a log) the plain line
    of sled.progress says what the wait is for, at once."""
    return contextlib.nullcontext() if console.is_terminal else phase("onnx.export", message)


def _run_builder(source: str, checkpoint: Path, partial: Path, precision: str,
                 execution_provider: str, console) -> None:
    """The model builder in a child process, its output shown as a progress bar."""
    layers = json.loads((checkpoint / "config.json").read_text()).get("num_hidden_layers", 1)
    tail: deque[str] = deque(maxlen=40)  # the builder's last lines, shown if it fails
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  MofNCompleteColumn(), console=console, transient=True) as progress:
        task = progress.add_task(f"{precision} export of {source}: loading", total=layers)
        current = "loading"
        child = subprocess.Popen(
            [sys.executable, "-m", "drafters.onnx_export", str(checkpoint), str(partial),
             precision, execution_provider],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_MININTERVAL": "1"})
        for line in _lines(child.stdout):
            tail.append(line)
            stage = _stage(line)
            if stage and stage != current:
                current = stage
                progress.update(task, description=f"{precision} export of {source}: {stage}",
                                completed=0)
            if (match := _LAYER.search(line)):  # layer N in progress: N done
                progress.update(task, completed=min(int(match.group(1)), layers))
        if child.wait() != 0:
            raise RuntimeError(f"the ONNX model builder failed ({child.returncode}):\n"
                               + "\n".join(tail))


def _lines(stream):
    """Lines of the child's output, splitting tqdm's carriage-return updates too."""
    buffer = ""
    while chunk := stream.read(256):
        buffer += chunk
        *done, buffer = re.split(r"[\r\n]", buffer)
        yield from (line for line in done if line.strip())
    if buffer.strip():
        yield buffer


def _stage(line: str) -> str | None:
    for marker, stage in (("Reading ", "reading layers"), ("Saving ONNX", "saving"),
                          ("quantiz", "quantizing"), ("Saving GenAI", "writing genai_config"),
                          ("processing files", "copying the tokenizer")):
        if marker in line:
            return stage
    return None


def build(checkpoint: str, out: str, precision: str, execution_provider: str) -> None:
    """The child's side: run the model builder in this process, with the compatibility fixes."""
    # onnxruntime-genai's builder (the export extra) imports torch and transformers: the child only
    from onnxruntime_genai.models.builder import create_model, parse_extra_options

    config = json.loads(Path(checkpoint, "config.json").read_text())
    options = []
    if config.get("sliding_window"):
        options.append("windowed_kv_cache=false")
    if precision == "int8" and config.get("tie_word_embeddings"):
        options.append("shared_embeddings=false")
    with tempfile.TemporaryDirectory() as cache:
        kwargs = parse_extra_options(None, checkpoint, out, precision, execution_provider, cache,
                                     options)
        _flatten_rope(kwargs["hf_details"]["hf_config"])
        create_model(None, checkpoint, out, precision, execution_provider, cache, **kwargs)


def _flatten_rope(config) -> None:
    """{"full_attention": {..}, "sliding_attention": {..}} -> the global dict + the local theta."""
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "full_attention" in rope:
        config.rope_parameters = dict(rope["full_attention"])
        config.rope_theta = rope["full_attention"]["rope_theta"]
        if "sliding_attention" in rope:
            config.rope_local_base_freq = rope["sliding_attention"]["rope_theta"]


if __name__ == "__main__":
    build(*sys.argv[1:5])
