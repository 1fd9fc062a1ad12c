"""A server started wrong says so in one line and exit 2, quickly, never in a traceback: a device
this torch cannot use, a dtype the GPU cannot run, a model that is neither a checkpoint folder
here nor a hub id the hub or its cache can give (with no network, within seconds, not after
transformers' retries: 51 s)."""
from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import huggingface_hub
import pytest
import torch

from conftest import run_main
from lab.server_process import free_port
from lab.tiny import save_pair
from verify_server.accelerator import DeviceUnavailable, check_device
from verify_server.target import locate_target

SLED = [sys.executable, "-m", "sled_cli.main"]
REPO = "owner/tiny-target"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# transformers' retries took 51 s with no network; the whole command, torch's import included,
# takes a few seconds
NO_NETWORK_S = 25.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_pair(tmp_path_factory.mktemp("tiny"), "llama")[0]


@pytest.fixture(autouse=True)
def no_hub(monkeypatch, tmp_path):
    """No test here reaches past loopback: the hub is a closed loopback port unless a test
    serves one, and the hub cache is empty and this test's own."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")     # restored after a test that goes offline


def serve(*argv: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([*SLED, "serve", *argv, "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    return done, time.monotonic() - started


def said(done: subprocess.CompletedProcess) -> str:
    """The command's one error line (after its progress lines), checked to be the only one."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if not line.endswith("...")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("sled serve: ")
    return errors[0]


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="this torch has CUDA")
def test_cuda_on_torchs_cpu_build_names_the_build_to_install(checkpoint):
    done, _ = serve("--model", str(checkpoint), "--device", "cuda")
    line = said(done)
    assert "built without CUDA" in line and "CUDA build" in line and "--device cpu" in line


def test_a_folder_that_is_not_there_names_what_to_give():
    line = said(serve("--model", "/nonexistent")[0])
    assert "/nonexistent is not a folder here" in line
    assert "config.json" in line and "hub id" in line and "gemma3-270m" in line


def test_a_hub_id_with_no_network_is_one_line_in_seconds(tmp_path):
    done, seconds = serve("--model", "meta-llama/Llama-3.1-8B-Instruct", env={
        "HF_HOME": str(tmp_path), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"})
    line = said(done)
    assert "is not in the hub cache" in line and "the hub did not answer" in line
    assert "hf download meta-llama/Llama-3.1-8B-Instruct" in line and "HF_HUB_OFFLINE=1" in line
    assert seconds < NO_NETWORK_S, f"{seconds:.1f} s: retried instead of failing at once"


def test_offline_a_hub_id_the_cache_lacks_asks_nothing_of_the_hub(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info",
                        lambda *a, **k: pytest.fail("the hub was asked while offline"))
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set: .*hf download owner/tiny-target"):
        locate_target(REPO)


def cache_snapshot(checkpoint: Path, files: list[str] | None = None) -> Path:
    """REPO's main revision in the hub cache, laid out as huggingface_hub lays it out."""
    repo = Path(huggingface_hub.constants.HF_HUB_CACHE) / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for path in checkpoint.iterdir():
        if files is None or path.name in files:
            shutil.copy(path, snapshot / path.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.mark.parametrize("offline", [True, False], ids=["offline", "no answer"])
def test_a_cached_hub_id_loads_from_its_snapshot_without_the_hub(checkpoint, monkeypatch,
                                                                   offline):
    snapshot = cache_snapshot(checkpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    started = time.monotonic()
    assert locate_target(REPO) == str(snapshot)
    assert time.monotonic() - started < 5.0
    # what loads it afterwards (and a split server's ranks) asks the cache, not the hub
    assert huggingface_hub.constants.is_offline_mode()
    assert offline or os.environ["HF_HUB_OFFLINE"] == "1"


def test_a_partly_cached_hub_id_says_what_is_missing(checkpoint):
    cache_snapshot(checkpoint, files=["config.json"])
    with pytest.raises(ValueError, match=r"only partly in the hub cache \(no model.safetensors"):
        locate_target(REPO)


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The hub's model API on loopback: `models` maps a repo id to its gating ("" for none);
    `granted` the gated ones this caller may read."""
    models: dict[str, str] = {}
    granted: set[str] = set()

    def do_GET(self) -> None:
        path = self.path.split("?")[0].removeprefix("/api/models/")
        repo, check = path.removesuffix("/auth-check"), path.endswith("/auth-check")
        if repo not in self.models:
            return self._reply(404, {"error": "Repository not found"}, "RepoNotFound")
        if check and self.models[repo] and repo not in self.granted:
            return self._reply(403, {"error": "gated"}, "GatedRepo")
        self._reply(200, {"id": repo, "gated": self.models[repo] or False, "sha": COMMIT})

    def _reply(self, status: int, body: dict, error_code: str | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if error_code:
            self.send_header("X-Error-Code", error_code)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def hub(monkeypatch):
    """A FakeHub on loopback, as the endpoint huggingface_hub asks."""
    FakeHub.models = {REPO: "", "meta-llama/Llama-3.1-8B-Instruct": "manual"}
    FakeHub.granted = set()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT",
                        f"http://127.0.0.1:{server.server_address[1]}")
    yield FakeHub
    server.shutdown()
    server.server_close()


def test_a_hub_that_answers_gets_the_id_and_says_what_it_lacks_or_gates(hub):
    assert locate_target(REPO) == REPO          # transformers fetches it from here
    with pytest.raises(ValueError, match="the hub has no model owner/missing .*HF_TOKEN"):
        locate_target("owner/missing")
    with pytest.raises(ValueError, match="is gated on the hub: accept its terms"):
        locate_target("meta-llama/Llama-3.1-8B-Instruct")
    hub.granted.add("meta-llama/Llama-3.1-8B-Instruct")
    assert locate_target("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    assert not huggingface_hub.constants.is_offline_mode()     # a hub that answers stays asked


def test_a_cached_hub_id_loads_and_steps_with_the_hub_silent(checkpoint, capsys):
    snapshot = cache_snapshot(checkpoint)
    code, out, err = run_main(capsys, "doctor", "--server", "--model", REPO, "--device", "cpu")
    assert code == 0, out + err
    assert f"model: {REPO} ({snapshot})" in out.splitlines()
    assert out.splitlines()[-1].endswith("the same as the plain transformers forward")


@pytest.mark.parametrize("spec, wanted", [
    ("foo bar", "neither a folder here nor a hub id"),
    ("./missing-folder", "is not a folder here"),
])
def test_a_spec_that_names_nothing_names_what_to_give(spec, wanted):
    with pytest.raises(ValueError, match=wanted):
        locate_target(spec)


def test_a_folder_without_safetensors_says_sled_loads_safetensors(checkpoint, tmp_path):
    folder = tmp_path / "bin-only"
    shutil.copytree(checkpoint, folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no model.safetensors \(sled loads safetensors"):
        locate_target(str(folder))
    assert locate_target(str(checkpoint)) == str(checkpoint)


def gpus(monkeypatch, count: int, capability: tuple[int, int] = (9, 0)) -> None:
    """torch sees COUNT CUDA GPUs of CAPABILITY (none of them touched)."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")


def test_a_gpu_past_the_machines_count_names_those_there_are(monkeypatch):
    gpus(monkeypatch, 2)
    with pytest.raises(DeviceUnavailable, match=r"cuda:7: this machine shows 2 GPUs \(cuda:0 to "
                                                r"cuda:1\)"):
        check_device("cuda:7", "float32")
    assert check_device("cuda:1", "float32") == torch.device("cuda:1")


def test_a_cuda_build_that_sees_no_gpu_says_where_to_look(monkeypatch):
    gpus(monkeypatch, 0)
    with pytest.raises(DeviceUnavailable, match="sees no GPU: nvidia-smi"):
        check_device("cuda", "bfloat16")


def test_bfloat16_before_ampere_asks_for_float16(monkeypatch):
    gpus(monkeypatch, 1, capability=(7, 5))
    with pytest.raises(DeviceUnavailable, match=r"8.0 or newer .*Tesla T4 is 7.5: give --dtype "
                                                "float16"):
        check_device("cuda:0", "bfloat16")
    assert check_device("cuda:0", "float16") == torch.device("cuda:0")


def test_mps_and_xpu_where_torch_has_none_and_float64_on_mps(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailable, match="no MPS device .*--device cpu"):
        check_device("mps", "float32")
    with pytest.raises(DeviceUnavailable, match=r"xpu:1: .*sees no Intel GPU"):
        check_device("xpu:1", "float32")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    with pytest.raises(DeviceUnavailable, match="float64: MPS computes in at most 32 bits"):
        check_device("mps", "float64")


@pytest.mark.parametrize("spelling", ["gpu", "cuda:x", "meta", "hpu"])
def test_a_device_sled_does_not_serve_on_is_a_bad_flag(spelling):
    with pytest.raises(ValueError, match=f"--device {spelling}: not a device sled serves") as info:
        check_device(spelling, "float32")
    assert not isinstance(info.value, DeviceUnavailable)


def test_float16_and_bfloat16_on_a_cpu_are_served():
    """torch computes both on a CPU (slowly): nothing to refuse."""
    for dtype in ("float16", "bfloat16", "float64"):
        assert check_device("cpu", dtype) == torch.device("cpu")
