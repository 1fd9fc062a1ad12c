"""The simulator's centralized-spec mode: the server serves each session alone and drafts for
itself (GENERATION_MODE_SERVER_SAT) with a simulated draft head, switched off past
--spec-off-above live sessions."""
from __future__ import annotations

import pytest

from lab.sim.engine import ACCEPTANCE, DRAFTS, ScriptedEngine, SelfDraft
from test_simulator import rows_of, simulate, write_scenario

SPEC = ("--modes", "centralized,centralized-spec")


def tokens_per_pass(row: dict) -> float:
    return 1 / row["passes_per_token"]


def by_mode(rows: list[dict], devices: int) -> dict[str, dict]:
    return {r["mode"]: r for r in rows if r["devices"] == devices}


def test_the_default_head_emits_about_two_tokens_a_pass():
    """1 + a + a^2 at a = 0.62: EAGLE-3's 1.65x at batch 1 once the head's 2 x 0.1 of a step
    and the wider verify are paid."""
    assert DRAFTS == 2
    assert SelfDraft().tokens_per_pass() == pytest.approx(1 + ACCEPTANCE + ACCEPTANCE ** 2)
    assert 1.95 < SelfDraft().tokens_per_pass() < 2.05
    assert SelfDraft(acceptance=1.0).tokens_per_pass() == 3
    with pytest.raises(ValueError):
        SelfDraft(acceptance=1.5)


def test_every_output_is_its_script(tmp_path):
    rows = rows_of(simulate(tmp_path, write_scenario(tmp_path), "--modes",
                           "sled,centralized,centralized-spec"))
    assert [(r["mode"], r["devices"]) for r in rows] == [
        (mode, n) for n in (1, 8) for mode in ("sled", "centralized", "centralized-spec")]
    for r in rows:
        assert r["mismatches"] == 0 and r["tokens"] == 16 * r["devices"]
        assert r["gpu_s_per_1k"] > 0
    spec = [r for r in rows if r["mode"] == "centralized-spec"]
    assert all(0 < r["acceptance_rate"] < 1 for r in spec)       # the head drafts, and misses


def test_acceptance_sets_the_tokens_a_pass(tmp_path):
    """A head that never guesses right emits one token a pass, as plain decoding does; one
    that mostly does emits more, and spends less of the GPU per token."""
    scenario = write_scenario(tmp_path, fleet_sizes=[1], max_tokens=64)
    never = by_mode(rows_of(simulate(tmp_path, scenario, *SPEC, "--spec-acceptance", "0",
                                     out="never")), 1)
    often = by_mode(rows_of(simulate(tmp_path, scenario, *SPEC, "--spec-acceptance", "0.9",
                                     out="often")), 1)
    central = never["centralized"]
    assert tokens_per_pass(never["centralized-spec"]) <= tokens_per_pass(central)
    assert never["centralized-spec"]["acceptance_rate"] == 0
    assert tokens_per_pass(often["centralized-spec"]) > 2 * tokens_per_pass(central)
    assert often["centralized-spec"]["gpu_s_per_1k"] < central["gpu_s_per_1k"]
    assert often["centralized-spec"]["mismatches"] == never["centralized-spec"]["mismatches"] == 0


def test_past_spec_off_above_sessions_decode_plainly(tmp_path, monkeypatch):
    """--spec-off-above 4 with 8 devices: no step of more than 4 sessions carries SAT slots, and
    the sessions emit fewer tokens a pass than with the head always on."""
    steps = []
    forward = ScriptedEngine.forward

    def watched(engine, rows):
        steps.append((sum(r.want_logits for r in rows), sum(bool(r.sat_slots) for r in rows)))
        return forward(engine, rows)
    monkeypatch.setattr(ScriptedEngine, "forward", watched)
    scenario = write_scenario(tmp_path, fleet_sizes=[8], max_tokens=32)
    always = by_mode(rows_of(simulate(tmp_path, scenario, *SPEC, "--spec-off-above", "0",
                                      out="always")), 8)["centralized-spec"]
    assert any(sat for rows, sat in steps if rows > 4)
    steps.clear()
    loaded = by_mode(rows_of(simulate(tmp_path, scenario, *SPEC, "--spec-off-above", "4",
                                      out="off")), 8)["centralized-spec"]
    assert not any(sat for rows, sat in steps if rows > 4)
    assert loaded["mismatches"] == 0 and loaded["tokens"] == 8 * 32
    assert tokens_per_pass(loaded) < tokens_per_pass(always)


def test_the_same_seed_gives_the_same_result(tmp_path):
    scenario = write_scenario(tmp_path, fleet_sizes=[1], max_tokens=64)
    first = rows_of(simulate(tmp_path, scenario, "--modes", "centralized-spec", "--seed", "3",
                             out="a"))
    again = rows_of(simulate(tmp_path, scenario, "--modes", "centralized-spec", "--seed", "3",
                             out="b"))
    other = rows_of(simulate(tmp_path, scenario, "--modes", "centralized-spec", "--seed", "4",
                             out="c"))
    assert first == again
    assert first != other
