"""`sled bench soak`: a short soak of real device daemons against the tiny target goes through
every fault step without losing or repeating a token, and reports memory growth and round
latency per window; the arithmetic behind those figures."""
from __future__ import annotations

import json
import math

import pytest

from conftest import run_main
from lab.bench.soak import fault_steps
from lab.round_trips import RoundTrips, quantile
from lab.rss import RssSeries, growth


def test_a_percentile_is_read_within_its_bucket():
    buckets = {0.1: 2.0, 0.2: 4.0, math.inf: 4.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.75, buckets) == pytest.approx(0.15)
    assert quantile(0.99, {0.1: 0.0, 0.5: 0.0, math.inf: 3.0}) == 0.5   # past the last bound
    assert quantile(0.99, {0.1: 0.0, math.inf: 0.0}) is None


def test_round_trips_are_differenced_per_window():
    trips = RoundTrips([])
    trips.series = [(0.0, {0.1: 0.0, math.inf: 0.0}), (30.0, {0.1: 10.0, math.inf: 10.0}),
                    (60.0, {0.1: 10.0, math.inf: 20.0}), (90.0, {0.1: 12.0, math.inf: 30.0})]
    windows = trips.per_window(60.0)
    assert [w["rounds"] for w in windows] == [20, 10]
    assert windows[0]["p50_ms"] == pytest.approx(100.0) and windows[1]["p99_ms"] == 100.0


def test_growth_compares_the_first_window_with_the_last():
    assert growth([(0, 100.0), (60, 100.0), (120, 104.0)], 30)["growth_pct"] == pytest.approx(4.0)


def test_a_restarted_server_counts_from_its_own_start():
    series = RssSeries()
    series.samples = [{"at_s": t, "server_pid": pid, "server_mib": mib, "devices_mib": {}}
                      for t, pid, mib in [(0, 1, 500), (10, 1, 510), (20, 2, 90),
                                          (30, 2, 500), (40, 2, 500), (50, 2, 505)]]
    server = series.server_growth(window_s=5, serving_since_s=30)
    assert server["processes"] == 2 and server["first_mib"] == 500 and server["last_mib"] == 505
    assert server["growth_pct"] == pytest.approx(1.0)


def test_the_fault_steps_come_early_and_cut_one_link_for_10_s():
    steps = fault_steps(1800.0)
    assert [s["kind"] for s in steps] == ["server_kill", "link_cut", "broker_restart"]
    assert max(s["at_s"] for s in steps) <= 600 and steps[1]["down_s"] == 10.0


@pytest.mark.parametrize("flag, value", [("--device-profile", "pi9"), ("--link", "wifi:rtt_ms=-3")])
def test_a_bad_profile_is_one_line_naming_its_flag_and_exit_2(capsys, tmp_path, flag, value):
    """Said before any process starts."""
    code, _, err = run_main(capsys, "bench", "soak", flag, value, "--out", str(tmp_path / "s.json"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sled bench soak: {flag}: "), err
    assert not (tmp_path / "s").exists()


@pytest.mark.serial    # a fleet on both cores, with fault steps at set times: run alone
@pytest.mark.slow
def test_a_short_soak_is_lossless_through_every_fault_step(capsys, tmp_path):
    out = tmp_path / "soak.json"
    code, stdout, err = run_main(capsys, "bench", "soak", "--devices", "3", "--minutes", "0.5",
                                 "--out", str(out))
    assert code == 0, stdout + err[-3000:]
    results = json.loads(out.read_text())
    assert results["lossless"] is True and results["errors"] == 0 and results["requests"] > 0
    steps = results["fault_steps"]
    assert sorted(s["kind"] for s in steps) == ["broker_restart", "link_cut", "server_kill"]
    for step in steps:
        assert step["ok"], step
        assert step["requests_overlapping"] > 0, f"no request was open across {step}"
        assert step["lost_tokens"] == 0 and step["duplicated_tokens"] == 0, step
    assert results["rss"]["server"]["processes"] == 2        # killed once, started again
    assert results["rss"]["devices"]["devices"] == 3
    assert sum(w["rounds"] for w in results["round_trip"]) > 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert (tmp_path / "soak" / "report.html").is_file()
