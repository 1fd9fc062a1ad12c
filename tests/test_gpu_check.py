"""lab/gpu/check.sh, the prepared check of a borrowed GPU machine: its dry run on this CPU runs
every part (the engines against generate(); the engine bench of prefill, verify, decode and SAT
steps with their floor, kernels and profile; the server against centralized on the machine,
warmed up first, and held to the profile just measured, with the simulator beside it and both
against the real run; SAT self-drafting against plain decoding) and writes the same files; a
flag it does not know is refused; the limits of a run on a GPU add up to its 10 minutes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from verify_server.step_costs import load_profile

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "lab" / "gpu" / "check.sh"
PARTS = ["tests", "engine-llama-8b", "engine-gemma3-4b", "serve-real", "serve-emulated", "sdsat"]
FILES = {"summary.json", "engine-llama-8b.json", "engine-gemma3-4b.json", "profile-llama-8b.json",
         "profile-gemma3-4b.json", "serve.json", "sdsat.json", "tests.log", "check.log"}
KINDS = ["prefill", "verify", "decode", "sat"]   # the dry run's cells, in order (one a kind: none
#                                                  can be "faster than a smaller one" by noise)


def check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_the_dry_run_runs_every_part_and_writes_every_file(tmp_path):
    done = check("--dry-run", str(tmp_path), timeout=900)
    assert done.returncode == 0, done.stderr
    assert {p.name for p in tmp_path.iterdir()} == FILES
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device"] == "cpu" and summary["dry_run"] and summary["torch"]
    assert [(p["name"], p["status"]) for p in summary["parts"]] == [(p, 0) for p in PARTS], \
        (tmp_path / "check.log").read_text()[-3000:]
    for shape in ("llama-8b", "gemma3-4b"):
        results = json.loads((tmp_path / f"engine-{shape}.json").read_text())
        cells = results["models"][0]["cells"]
        assert [cell["kind"] for cell in cells] == KINDS
        for kind in results["engines"]:
            for cell in cells:
                assert cell["floor_ms"] == max(cell["floor_bytes_ms"], cell["floor_flops_ms"])
                assert cell[f"{kind}_over_floor"] > 0
                assert cell[f"{kind}_kernels"]["count"] > 0
        profile = load_profile(str(tmp_path / f"profile-{shape}.json"))
        assert [cell.kind for cell in profile.cells] == KINDS
        assert set(profile.rules) == {"prefill", "sat"} and profile.floor is not None
    assert " passed" in (tmp_path / "tests.log").read_text()
    serve = json.loads((tmp_path / "serve.json").read_text())
    real = serve["real"]
    modes = {(r["mode"], r["devices"]) for r in real["results"]}
    assert modes == {(m, n) for m in ("sled", "centralized") for n in (1, 2)}
    assert real["warm_up"]["fleets"] == [1, 2] and real["warm_up"]["steps"] > 0
    assert all("slow_steps" in r for r in real["results"])
    emulated = serve["emulated"]
    assert emulated["emulated"]["profile"] and {r["mode"] for r in emulated["simulated"]} == {
        "sled", "centralized"}
    assert all("throughput_error" in row for row in emulated["agreement"])
    against = {(r["mode"], r["devices"]): r for r in emulated["against"]}
    assert set(against) == modes
    assert all({"throughput_error_emulated", "throughput_error_simulated"} <= set(r)
               for r in against.values())
    sdsat = json.loads((tmp_path / "sdsat.json").read_text())
    plain, sat = sdsat["self_drafting"]["rows"]
    assert (plain["mode"], sat["mode"]) == ("plain", "sat") and sdsat["sat_slots"] == 4
    assert sat["tokens_per_s_vs_plain"] > 0 and sat["passes_per_token_vs_plain"] > 0
    assert sdsat["sat_adapter"].endswith("sdsat-random-sat.safetensors")


def test_the_limits_of_a_gpu_run_fit_its_ten_minutes():
    """The parts' limits, each with its grace after it, leave 45 s of the 600 s for the
    script's own start-up (wheels, tokenizer, the device's name)."""
    text = SCRIPT.read_text()
    gpu = text[text.index("\nelse\n"):text.index("\nfi\n", text.index("\nelse\n"))]
    limits = [int(n) for name in ("ENGINE_LIMITS", "SERVE_LIMITS")
              for n in re.search(rf"{name}=\(([\d ]+)\)", gpu).group(1).split()]
    limits += [int(re.search(rf"{name}=(\d+)", gpu).group(1)) for name in ("TEST_LIMIT",
                                                                           "SDSAT_LIMIT")]
    assert len(limits) == len(PARTS)
    grace = int(re.search(r"KILL_S=(\d+)", text).group(1))
    assert sum(limits) + grace * len(limits) <= 600 - 45, limits
    assert 'echo 600)' in text        # and the script cuts each part to what is left of 600 s


def test_a_flag_it_does_not_know_is_refused(tmp_path):
    done = check("--fast", str(tmp_path), timeout=30)
    assert done.returncode == 2 and "unknown flag --fast" in done.stderr
    assert check(timeout=30).returncode == 2           # no OUTDIR
