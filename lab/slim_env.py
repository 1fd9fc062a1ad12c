"""A fresh virtual environment with sled and only the extras a device chooses (`sled[gguf]`), and
what an environment holds: the size of its site-packages, and which modules it can import.

    python = build(folder, "gguf")         # python -m venv, then pip install "SOURCE[gguf]"
    size = environment_size(python)         # {"site_packages_mb": ..., "without_llama_cpp_mb": ...}

pip's own cache is used (a wheel built once is not built again); llama-cpp-python is the wheel
sled.llama_build made for this CPU.
The source is copied first, so installing never writes build output into a working tree.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sled import llama_build

REPO = Path(__file__).resolve().parents[1]
# What a sled wheel is built from (pyproject.toml's packages and the files it names).
SOURCE_PARTS = ["pyproject.toml", "README.md", "sled", "verify_server", "sdsat", "edge_client",
                "drafters", "lab", "sled_cli"]
LLAMA_CPP = ("llama_cpp",)     # site-packages entries of llama-cpp-python start with this
MB = 1e6


class BuildError(RuntimeError):
    """pip or venv failed: the message is the last line it wrote."""


def build(folder: str | Path, extras: str, source: str | Path = REPO,
          timeout: float = 1800) -> Path:
    """A venv in FOLDER with SOURCE installed with EXTRAS ("gguf", "gguf,onnx", "" for the core
    alone); its python. An existing venv in FOLDER is reused as it is."""
    folder = Path(folder)
    python = folder / "bin" / "python"
    if python.exists():
        return python
    _run([sys.executable, "-m", "venv", str(folder)], timeout)
    with tempfile.TemporaryDirectory(prefix="sled-src-") as copy:
        tree = _copy_source(Path(source), Path(copy) / "sled")
        wanted = [f"{tree}[{extras}]" if extras else str(tree)]
        if "gguf" in extras.split(","):     # llama.cpp as built for this CPU, never pip's own build
            wanted.append(str(llama_build.wheel_for_this_cpu()))
        _run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
              *wanted], timeout)
    return python


def _copy_source(source: Path, to: Path) -> Path:
    """The parts of SOURCE a wheel is built from, without caches."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    to.mkdir(parents=True)
    for part in SOURCE_PARTS:
        path = source / part
        if path.is_dir():
            shutil.copytree(path, to / part, ignore=ignore)
        elif path.exists():
            shutil.copy2(path, to / part)
    return to


def _run(command: list[str], timeout: float) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no message"]
        raise BuildError(f"{Path(command[0]).name} {' '.join(command[1:3])} failed: {lines[-1]}")


def _ask(python: str | Path, code: str) -> object:
    """The JSON that CODE prints when run by PYTHON (in the environment that python belongs to)."""
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=tempfile.gettempdir())     # not a folder with sled's code in it
    if done.returncode != 0:
        raise BuildError(f"{python} could not run: {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def site_packages(python: str | Path) -> list[Path]:
    """The folders PYTHON installs packages into (purelib and platlib, once each)."""
    code = ("import json, sysconfig; p = sysconfig.get_paths(); "
            "print(json.dumps(sorted({p['purelib'], p['platlib']})))")
    return [Path(path) for path in _ask(python, code)]


def importable(python: str | Path, modules: list[str]) -> dict[str, bool]:
    """Which of MODULES PYTHON finds, without importing them."""
    code = ("import importlib.util as u, json; "
            f"print(json.dumps({{m: u.find_spec(m) is not None for m in {modules!r}}}))")
    return _ask(python, code)


def _owners(folder: Path) -> dict[Path, str]:
    """Each file a distribution installed under FOLDER (its RECORD) -> the distribution's name.
    llama-cpp-python also puts lib/, include/ and bin/ there: RECORD finds them all."""
    owners = {}
    for record in folder.glob("*.dist-info/RECORD"):
        name = record.parent.name.split("-")[0].lower()
        for line in record.read_text(errors="replace").splitlines():
            path = Path(os.path.normpath(folder / line.rsplit(",", 2)[0]))
            if path.is_relative_to(folder):
                owners[path] = name
    return owners


def _sizes(folder: Path) -> dict[str, int]:
    """Bytes per distribution in FOLDER; a file no RECORD names (a later __pycache__) counts
    for the distribution whose files share its folder, else for its top-level entry."""
    root = folder.resolve()
    owners = _owners(root)
    folders = {}
    for path, name in owners.items():
        folders.setdefault(path.parent, name)
    sizes: dict[str, int] = {}
    for path in root.rglob("*"):
        if path.is_dir() and not path.is_symlink():
            continue
        owner = owners.get(path)
        parent = path.parent
        while owner is None and parent != root:
            owner, parent = folders.get(parent), parent.parent
        owner = owner or path.relative_to(root).parts[0].lower()
        sizes[owner] = sizes.get(owner, 0) + path.lstat().st_size
    return sizes


def environment_size(python: str | Path, largest: int = 8) -> dict:
    """MB (10^6 bytes, files' own sizes) of PYTHON's site-packages, the same without
    llama-cpp-python, and the LARGEST distributions."""
    sizes: dict[str, int] = {}
    for folder in site_packages(python):
        for name, size in _sizes(folder).items():
            sizes[name] = sizes.get(name, 0) + size
    total = sum(sizes.values())
    llama = sum(size for name, size in sizes.items() if name.startswith(LLAMA_CPP))
    top = sorted(sizes.items(), key=lambda item: -item[1])[:largest]
    return {"site_packages_mb": round(total / MB, 1),
            "without_llama_cpp_mb": round((total - llama) / MB, 1),
            "largest": [[name, round(size / MB, 1)] for name, size in top]}
