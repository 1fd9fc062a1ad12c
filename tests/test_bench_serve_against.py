"""`sled bench serve`: the warm-up it reports before the timed runs, and the error per N of the
emulation and the simulator against a run on the real server (--against), on hand-made rows."""
from __future__ import annotations

import json

import pytest

from conftest import run_main
from lab.bench.serve import real_errors, real_rows, warm_up_lines


def row(mode: str, n: int, throughput: float, tpot: float, slow: float = 0) -> dict:
    return {"mode": mode, "devices": n, "throughput": throughput, "tpot_ms_p95": tpot,
            "slow_steps": slow}


def test_each_row_gets_its_error_against_the_real_server():
    real = [row("sled", 1, 100.0, 20.0), row("centralized", 1, 50.0, 10.0),
            row("sled", 4, 400.0, 25.0)]
    emulated = [row("sled", 1, 110.0, 19.0), row("centralized", 1, 45.0, 11.0),
                row("sled", 4, 380.0, 30.0)]
    simulated = [row("sled", 1, 90.0, 22.0), row("centralized", 1, 50.0, 10.0)]
    got = real_errors(real, emulated, simulated)
    assert [(r["mode"], r["devices"]) for r in got] == [("sled", 1), ("centralized", 1),
                                                        ("sled", 4)]
    first = got[0]
    assert first["throughput"] == {"real": 100.0, "emulated": 110.0, "simulated": 90.0}
    assert first["throughput_error_emulated"] == pytest.approx(0.10)
    assert first["throughput_error_simulated"] == pytest.approx(-0.10)
    assert first["tpot_ms_p95_error_emulated"] == pytest.approx(-0.05)
    assert got[2]["throughput_error_emulated"] == pytest.approx(-0.05)
    assert "throughput_error_simulated" not in got[2]       # the simulator did not run N = 4
    assert "throughput_error_simulated" not in real_errors(real, emulated, None)[0]


def test_a_results_file_that_is_not_one_is_refused_in_one_line(tmp_path, capsys):
    good = tmp_path / "real.json"
    good.write_text(json.dumps({"results": [row("sled", 1, 1.0, 1.0)]}))
    assert real_rows(str(good))[0]["devices"] == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a `sled bench serve` results file"):
        real_rows(str(bad))
    code, _, err = run_main(capsys, "bench", "serve", "--against", str(good))
    assert code == 2 and "--against needs --emulate PROFILE" in err and "Traceback" not in err


def test_the_warm_up_says_what_it_took_and_whether_the_timed_runs_met_new_steps():
    warm = {"seconds": 12.5, "fleets": [1, 4], "modes": ["sled", "centralized"], "tokens": 8,
            "steps": 40.0, "slow_steps": 6.0}
    quiet = warm_up_lines(warm, [row("sled", 1, 1.0, 1.0), row("sled", 4, 1.0, 1.0)])
    assert quiet[0].startswith("warm-up: sled and centralized at N = 1, 4 (8 tokens a device)")
    assert "6 over 0.5 s" in quiet[0] and quiet[1] == "the timed runs took no step over 0.5 s"
    slow = warm_up_lines(warm, [row("sled", 1, 1.0, 1.0, slow=2)])
    assert "the timed runs took 2 steps over 0.5 s" in slow[1]
    held = warm_up_lines(warm, [row("sled", 1, 1.0, 1.0, slow=2)], emulated=True)
    assert len(held) == 1 and "overrun" in held[0]
