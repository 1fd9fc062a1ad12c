"""`sled bench placement` as a person runs it: a real `sled serve --placement latency` process and
devices joining and leaving, on the tiny pair; greedy outputs held to generate(), seeded ones to
a fixed-placement server's."""
from __future__ import annotations

import json

import pytest

from conftest import run_sled


@pytest.mark.parametrize("seeded", [False, True])
def test_bench_placement_moves_sessions_and_keeps_every_output(tmp_path, seeded):
    out = tmp_path / "placement.json"
    done = run_sled("bench", "placement", "--devices", "4", "--base", "1", "--phase-s", "1.5",
                    "--max-new-tokens", "24", *(["--seeded"] if seeded else []),
                    "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    sessions = result["sessions"]
    assert result["seeded"] is seeded and result["identical"] == len(sessions) > 0
    assert result["moved"] > 0 and all(s["seed"] is not None for s in sessions) is seeded
    assert sum(sum(s["placements"].values()) for s in sessions) > 0
    assert result["loads"] and all(0.0 <= load <= 1.0 for _, load in result["loads"])
