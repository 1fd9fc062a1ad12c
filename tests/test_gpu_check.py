"""lab/gpu/check.sh, the prepared check of a borrowed GPU machine: its dry run on this CPU runs
every part (the engines against generate(), the engine bench with its floor and kernels, the
server against centralized on the machine and held to the profile just measured, with the
simulator beside it) and writes the same files; a flag it does not know is refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "lab" / "gpu" / "check.sh"
PARTS = ["tests", "engine-llama-8b", "engine-gemma3-4b", "serve-real", "serve-emulated"]
FILES = {"summary.json", "engine-llama-8b.json", "engine-gemma3-4b.json", "profile-llama-8b.json",
         "profile-gemma3-4b.json", "serve.json", "tests.log", "check.log"}


def check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_the_dry_run_runs_every_part_and_writes_every_file(tmp_path):
    done = check("--dry-run", str(tmp_path), timeout=480)
    assert done.returncode == 0, done.stderr
    assert {p.name for p in tmp_path.iterdir()} == FILES
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device"] == "cpu" and summary["dry_run"] and summary["torch"]
    assert [(p["name"], p["status"]) for p in summary["parts"]] == [(p, 0) for p in PARTS], \
        (tmp_path / "check.log").read_text()[-3000:]
    for shape in ("llama-8b", "gemma3-4b"):
        results = json.loads((tmp_path / f"engine-{shape}.json").read_text())
        for kind in results["engines"]:
            for cell in results["models"][0]["cells"]:
                assert cell["floor_ms"] == max(cell["floor_bytes_ms"], cell["floor_flops_ms"])
                assert cell[f"{kind}_over_floor"] > 0
                assert cell[f"{kind}_kernels"]["count"] > 0
        assert json.loads((tmp_path / f"profile-{shape}.json").read_text())["cells"]
    assert " passed" in (tmp_path / "tests.log").read_text()
    serve = json.loads((tmp_path / "serve.json").read_text())
    modes = {(r["mode"], r["devices"]) for r in serve["real"]["results"]}
    assert modes == {(m, n) for m in ("sled", "centralized") for n in (1, 2)}
    emulated = serve["emulated"]
    assert emulated["emulated"]["profile"] and {r["mode"] for r in emulated["simulated"]} == {
        "sled", "centralized"}
    assert all("throughput_error" in row for row in emulated["agreement"])


def test_a_flag_it_does_not_know_is_refused(tmp_path):
    done = check("--fast", str(tmp_path), timeout=30)
    assert done.returncode == 2 and "unknown flag --fast" in done.stderr
    assert check(timeout=30).returncode == 2           # no OUTDIR
