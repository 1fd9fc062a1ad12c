"""Workloads and the built-in model registry."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from drafters import resolve_spec
from sled.models import BUILTIN, builtin, gguf_path, resolve_model
from lab.workload import load_workload


def test_humaneval_prompts_come_from_the_package():
    prompts = load_workload("humaneval:5")
    assert len(prompts) == 5 and all("def " in p for p in prompts)
    assert load_workload("humaneval:5") == load_workload("humaneval")[:5]
    assert len(load_workload("humaneval")) == 164


def test_prompt_files(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps({"prompt": p}) for p in ["a b", "def f():"]) + "\n")
    text = tmp_path / "p.txt"
    text.write_text("first prompt\nline two\n\nsecond\n")
    assert load_workload(str(jsonl)) == ["a b", "def f():"]
    assert load_workload(str(text)) == ["first prompt\nline two", "second"]


@pytest.mark.parametrize("spec", ["humaneval:x", "no/such/file.txt"])
def test_bad_workloads_say_what_they_accept(spec):
    with pytest.raises(ValueError, match="humaneval"):
        load_workload(spec)


def test_builtin_aliases_resolve_to_real_gguf_files():
    for alias in BUILTIN:
        path = gguf_path(alias)
        assert path.is_file() and path.read_bytes()[:4] == b"GGUF"
    assert resolve_spec("gguf:smollm2-135m") == f"gguf:{gguf_path('smollm2-135m')}"
    assert resolve_spec("ngram") == "ngram" and resolve_model("some/path") == "some/path"
    with pytest.raises(ValueError, match="gemma3-270m"):
        builtin("llama-70b")


def test_models_list_shows_every_alias():
    done = subprocess.run([sys.executable, "-m", "sled_cli.main", "models", "list"],
                          capture_output=True, text=True, timeout=120, env={"COLUMNS": "200",
                                                                          **__import__("os").environ})
    assert done.returncode == 0, done.stderr
    assert all(alias in done.stdout for alias in BUILTIN)
