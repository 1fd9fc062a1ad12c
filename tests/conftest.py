"""Shared fixtures: tiny random targets (float64, so batched and unbatched arithmetic agree to
far below any argmax gap), an in-process server, and the greedy oracle (for real models, kept
on disk: cached_reference)."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path
import signal
import subprocess
import sys

import pytest

# grpc core's INFO lines ("Got goaway" each time a test stops a server with calls open) say
# nothing a failing test needs; set before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import torch
import transformers

from lab.tiny import make_model, make_tokenizer, perturbed, save_pair
from sled.cache import cache_dir, read_manifest, verify_folder, write_atomically
from verify_server.settings import ServerSettings
from verify_server.server import start_server
from verify_server.target import Target

# A suite started in the background by a shell without job control inherits SIGINT ignored, and
# so would every command it starts: the Ctrl-C tests need the interrupt to reach those commands.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser) -> None:
    """--device: where the device-aware engine tests (tests/test_engines_on_device.py) place
    their model, e.g. cuda on a GPU machine (lab/gpu/check.sh); every other test runs on the CPU."""
    parser.addoption("--device", default="cpu", help="torch device of the device-aware engine "
                     "tests (default cpu)")


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The --device the device-aware tests run on; a CUDA one that is not there skips them."""
    chosen = torch.device(request.config.getoption("--device"))
    if chosen.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("--device cuda: no CUDA device here")
    return chosen


def pytest_collection_modifyitems(config, items) -> None:
    """The files with real-model (slow) tests go first: make test hands whole files to two
    workers in this order (--dist loadfile), and the long ones started last would leave one
    worker alone at the end."""
    heavy = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in heavy)      # stable: file order kept within


PROMPT_TEXTS = [
    "def add(a, b):",
    "for i in range(10):",
    "The server verifies",
    "import math",
    "class Session:",
    "Small devices draft tokens",
    "print(",
    "x",
]


SLED = [sys.executable, "-m", "sled_cli.main"]


def serve_settings_of(*argv: str) -> ServerSettings:
    """The settings `sled serve ARGV` runs with: its flags parsed, its config and environment read."""
    import argparse

    from sled_cli import serve as serve_cli
    from verify_server.settings import load_settings

    parser = argparse.ArgumentParser(prog="sled serve")
    serve_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    return load_settings(args.config, {k: v for k, v in vars(args).items() if k != "config"})


def status_kib(field: str, pid: int | str = "self") -> int:
    """One KiB field of a process's /proc/PID/status, e.g. VmRSS (resident now) or VmHWM (its
    peak)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def zombie_or_gone(pid: int) -> bool:
    """Whether process PID has ended: a zombie its parent has not reaped yet, or gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def rss_mib() -> float:
    """This process's resident memory now, MiB."""
    return status_kib("VmRSS") / 1024


def run_sled(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """The `sled` command as a person runs it, in a child process."""
    return subprocess.run([*SLED, *args], capture_output=True, text=True, timeout=timeout)


def count_fingerprints(monkeypatch, module) -> list[int]:
    """Counts the vocabulary hashes MODULE makes through its fingerprint_tokenizer (one 1 each)."""
    from sled.wire.fingerprint import fingerprint_tokenizer

    calls: list[int] = []

    def counted(tokenizer):
        calls.append(1)
        return fingerprint_tokenizer(tokenizer)

    monkeypatch.setattr(module, "fingerprint_tokenizer", counted)
    return calls


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    """sled's main(argv) in this process: (exit code, stdout, stderr)."""
    from sled_cli.main import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny random Llama target + drafter saved as checkpoints: (target dir, drafter dir)."""
    return save_pair(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(text).input_ids for text in PROMPT_TEXTS]


@pytest.fixture(scope="session")
def models(tokenizer) -> dict[str, torch.nn.Module]:
    """Tiny float64 targets by architecture."""
    return {arch: make_model(arch, len(tokenizer), dtype=torch.float64) for arch in ("llama", "gemma3")}


@pytest.fixture(autouse=True)
def _shared_models_stay_float64(request):
    """The session's tiny targets are shared by every test of a worker: a test that converts
    one in place (model.float()) changes the oracle, the KV bytes a token and so the pool of every
    later test there. Such a test errors at its teardown."""
    yield
    if "models" in request.fixturenames:
        changed = [arch for arch, model in request.getfixturevalue("models").items()
                   if next(model.parameters()).dtype != torch.float64]
        assert not changed, (f"the test converted the shared models {changed} in place: convert "
                             "a copy (copy.deepcopy(models[arch]).float())")


@pytest.fixture(scope="session")
def drafter_models(models) -> dict[str, torch.nn.Module]:
    """Each target with weight noise: agrees with it often, not always."""
    return {arch: perturbed(model, 0.1) for arch, model in models.items()}


def greedy_reference(model, prompt: list[int], max_new_tokens: int, eos: int | list[int] | None = None):
    """The oracle: transformers generate(do_sample=False) of the target, generated part only."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0, eos_token_id=eos)
    return out[0, len(prompt):].tolist()


# -- the oracle of a real model, computed once and kept on disk ---------------------------------

def cached_reference(model, prompt: list[int], max_new_tokens: int,
                     eos: int | list[int] | None = None) -> list[int]:
    """generate(do_sample=False) of MODEL (loaded from a checkpoint folder) on PROMPT, generated
    part only; EOS None: the checkpoint's own. Kept under $SLED_CACHE/references by everything it
    depends on, so later runs, and a suite running beside this one, compute nothing."""
    asked = reference_key(model, prompt, max_new_tokens, eos)
    path = reference_path(asked)
    if (kept := read_reference(path, asked)) is not None:
        return kept
    with held_lock(path):          # a concurrent suite waits here for this one's answer
        if (kept := read_reference(path, asked)) is None:
            kept = generated(model, prompt, max_new_tokens, eos)     # temp file, then os.replace:
            write_atomically(path, json.dumps({"key": asked, "tokens": kept}).encode())
    return kept


def reference_key(model, prompt: list[int], max_new_tokens: int, eos) -> dict:
    """Everything a greedy reference depends on: the checkpoint's files, dtype, device, the
    libraries generate() runs in, and the request (as JSON gives it back: compared on read)."""
    return json.loads(json.dumps({
        "checkpoint": checkpoint_identity(checkpoint_of(model)), "dtype": str(model.dtype),
        "device": str(model.device), "torch": torch.__version__,
        "transformers": transformers.__version__, "prompt": list(prompt),
        "max_new_tokens": max_new_tokens, "eos": eos}))


def checkpoint_of(model) -> Path:
    """The folder MODEL was loaded from; a model made in memory has none to key a reference by."""
    name = model.config.name_or_path
    if not name or not Path(name).is_dir():
        raise ValueError(f"{name!r} is not a checkpoint folder: only a model loaded from one "
                         "has its reference kept")
    return Path(name).resolve()


def checkpoint_identity(folder: Path) -> dict:
    """The checkpoint's files: their sha256s from sled's manifest when the folder verifies
    against it (a few stat calls), else each file's size and mtime."""
    if verify_folder(folder):
        return {"path": str(folder), "sha256": {name: entry["sha256"] for name, entry
                                                 in sorted(read_manifest(folder).items())}}
    return {"path": str(folder), "stat": {p.name: [p.stat().st_size, p.stat().st_mtime_ns]
                                          for p in sorted(folder.iterdir()) if p.is_file()}}


def reference_path(key: dict) -> Path:
    """Where KEY's reference is kept: named by its checkpoint folder and a digest of all of KEY."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "references" / f"{Path(key['checkpoint']['path']).name}-{digest}.json"


def read_reference(path: Path, key: dict) -> list[int] | None:
    """The kept tokens when PATH holds a whole answer to KEY; anything else (missing, torn,
    corrupted, unreadable, another key) is None: computed again."""
    try:
        kept = json.loads(path.read_bytes())
        tokens = kept["tokens"]
        whole = kept["key"] == key and all(type(t) is int for t in tokens)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return list(tokens) if whole else None


@contextlib.contextmanager
def held_lock(path: Path):
    """An exclusive lock beside PATH for as long as the block runs (released on close)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def generated(model, prompt: list[int], max_new_tokens: int, eos) -> list[int]:
    """The computation cached_reference keeps: transformers' own greedy loop."""
    stop = {} if eos is None else {"eos_token_id": eos}
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device),
                             max_new_tokens=max_new_tokens, do_sample=False, **stop)
    return out[0, len(prompt):].tolist()


@pytest.fixture
async def serve(tokenizer):
    """serve(model, **settings) -> a running in-process server (sat: the target's SATs; with
    another tokenizer than the tiny one where given); all stopped after the test."""
    running = []
    tiny_tokenizer = tokenizer

    async def start(model, model_id: str = "tiny", sat=None, tokenizer=None, **settings):
        settings.setdefault("kv_budget", 64 << 20)
        target = Target.from_model(model, tokenizer or tiny_tokenizer, model_id, sat=sat)
        server = await start_server(target, ServerSettings(**settings))
        running.append(server)
        return server

    yield start
    for server in running:
        await server.stop(grace=0)


def assert_same_proposal(got, want, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Two drafter proposals agree: same tokens, and the same sparse q within tolerance."""
    assert got.token_ids == want.token_ids
    if want.q is None:
        assert got.q is None
        return
    assert len(got.q) == len(want.q)
    for a, b in zip(got.q, want.q):
        assert a.ids == b.ids
        torch.testing.assert_close(torch.tensor(a.probs), torch.tensor(b.probs), rtol=rtol, atol=atol)


def assert_valid_q(proposal, k: int, sampling, q_support: int, vocab: int) -> list[int]:
    """A sampled proposal carries, per token, the sparse q it was drawn from; returns q widths."""
    assert len(proposal.token_ids) == k
    assert proposal.q is not None and len(proposal.q) == k
    widths = []
    for token, q in zip(proposal.token_ids, proposal.q):
        assert token in q.ids
        assert len(q.ids) == len(q.probs) == len(set(q.ids))
        assert len(q.ids) <= q_support
        if sampling.top_k:
            assert len(q.ids) <= sampling.top_k
        assert all(p > 0 for p in q.probs)
        assert abs(sum(q.probs) - 1.0) < 1e-5
        assert all(0 <= i < vocab for i in q.ids)
        widths.append(len(q.ids))
    return widths


def keep_tokenizer(tokenizer, fingerprint: str, staging: Path) -> tuple[Path, str]:
    """TOKENIZER's files (save_pretrained) placed where the device keeps that fingerprint made of
    those files, with no manifest yet: (the folder, its files digest)."""
    tokenizer.save_pretrained(staging)
    return rekey(Path(staging), fingerprint)


def rekey(folder: Path, fingerprint: str) -> tuple[Path, str]:
    """FOLDER moved to where the device keeps FINGERPRINT made of the files it holds now."""
    import hashlib
    import shutil

    from sled.cache import tokenizer_dir
    from sled.wire.fingerprint import files_fingerprint

    files = files_fingerprint({p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                               for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")})
    place = tokenizer_dir(fingerprint, files)
    if place != folder:
        place.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(place, ignore_errors=True)
        shutil.move(str(folder), str(place))
    return place, files
