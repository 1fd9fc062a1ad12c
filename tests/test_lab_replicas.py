"""`sled lab run replicas` on this machine's processes, in small: two `sled serve` replicas of
the tiny target behind HAProxy, the devices dialing the proxy, replica 1 SIGKILLed while they
generate; every greedy output is the target's, and the report shows each replica's load.

Skipped only where HAProxy is not installed (make haproxy installs it)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lab.proxy import haproxy_binary
from test_lab_run import sled

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(haproxy_binary() is None,
                    reason="HAProxy is not installed (make haproxy, or apt-get install haproxy)")
@pytest.mark.serial    # a fleet with a fault step at a set time: run alone
def test_the_replicas_scenario_runs_behind_haproxy(tmp_path):
    scenario = yaml.safe_load((ROOT / "lab" / "scenarios" / "replicas.yaml").read_text())
    scenario.update(name="replicas-small", target="tiny", requests=4, max_tokens=48,
                    workload={"source": "humaneval", "limit": 4})
    scenario["fleet"][0]["count"] = 4
    scenario["faults"][0].update(at_s=2.0, down_s=1.0)     # after a scrape of both replicas
    path = tmp_path / "replicas-small.yaml"
    path.write_text(yaml.safe_dump(scenario))
    done = sled("lab", "run", str(path), "--out", str(tmp_path), "--run", "small", timeout=300)
    folder = tmp_path / "small"
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 server replicas behind HAProxy" in done.stderr
    report = json.loads((folder / "report.json").read_text())
    assert report["lossless"] is True
    results = json.loads((folder / "results.json").read_text())
    requests = [r for p in results["phases"] for r in p["requests"]]
    assert len(requests) == 16 and all(r["error"] is None and r["lossless"] for r in requests)
    assert sum(r["lost_tokens"] + r["duplicated_tokens"] for r in requests) == 0
    kill, = results["faults"]
    assert (kill["kind"], kill["replica"], kill["ok"]) == ("server_kill", 1, True), kill
    # the kill hit live traffic: requests were open across it
    assert [r for r in requests if r["sent_at"] < kill["done_at_s"] and r["done_at"] > kill["at_s"]]
    # both replicas served: each opened sessions and committed tokens
    load = report["replicas"]
    assert [row["replica"] for row in load] == [0, 1]
    assert all(row["sessions"] > 0 and row["tokens"] > 0 for row in load), load
    page = (folder / "report.html").read_text()
    assert "Load per replica" in page and "replica 1" in page
    logs = folder / "logs"
    assert (logs / "server-0.log").is_file() and (logs / "server-1.log").is_file()
    assert "replica-1 is DOWN" in (logs / "proxy" / "haproxy.log").read_text()
