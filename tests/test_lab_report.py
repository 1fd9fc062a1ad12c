"""The lab report from a synthetic results document: losslessness verdict, headline numbers,
capacity, costs, fault accounting, the PNGs and a self-contained, escaped report.html."""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest

from lab import costs as lab_costs
from lab.report import build_report, summarise

HOSTILE = "dev-<script>alert(1)</script>"
DEVICES = [("dev-00", "pi5", "wifi", "ngram"), ("dev-01", "pi4", "lte", "gguf:gemma3-270m"),
           (HOSTILE, "pi5", "ethernet", "ngram")]
# (ttft s, tpot s) per device index, per (system, fleet size); every request has 21 tokens
TIMINGS = {("sled", 2): [(0.5, 0.1), (1.0, 0.2)],
           ("sled", 3): [(0.5, 0.1), (1.0, 0.2), (0.8, 0.15)],
           ("centralized", 2): [(0.4, 0.2), (0.6, 0.2)],
           ("centralized", 3): [(0.4, 0.25), (2.0, 0.3), (0.6, 0.25)]}
SLO = {"tokens_per_s": 4.0, "ttft_s": 1.5}


def record(slot, system, n, ttft, tpot, sent=0.0, lossless=True, **extra) -> dict:
    device, profile, link, drafter = slot
    tokens = list(range(21))
    first = sent + ttft
    return {"device": device, "profile": profile, "link": link, "drafter": drafter, "system": system,
            "fleet_size": n, "prompt_index": 0, "sent_at": sent, "first_token_at": first,
            "done_at": first + 20 * tpot, "token_ids": tokens, "text": "x", "chunks": 3,
            "duplicated_chunks": [], "missing_chunks": [], "error": None, "attempts": 1,
            "lossless": lossless, "lost_tokens": 0, "duplicated_tokens": 0, **extra}


def phase(system: str, n: int) -> dict:
    requests = [record(DEVICES[i], system, n, *t) for i, t in enumerate(TIMINGS[(system, n)])]
    drafting = system == "sled"
    devices = {d: {"profile": p, "link": link, "drafter": dr,
                   "position_drafted": [10, 10, 10] if drafting else [],
                   "position_accepted": [8, 5, 2] if drafting else [],
                   "drafted": 30 if drafting else 0, "accepted": 15 if drafting else 0}
               for d, p, link, dr in DEVICES[:n]}
    return {"system": system, "fleet_size": n, "wall_s": 10.0, "requests": requests,
            "server": {"forward_passes": 21 * n if drafting else 42 * n, "forward_seconds": 2.5,
                       "batch_sizes": {"1": 4, "2": 6, "4": 0, "+Inf": 0},
                       "kv_blocks_used": [[0.0, 0], [1.0, 12], [2.0, 20]], "kv_blocks_total": 256,
                       "active_sessions": [[0.0, 0], [1.0, n]],
                       # a placing server's sled phase: sessions move to it, then back
                       "placed_sessions": ([[0.0, n, 0, 0], [1.0, 0, n, 0], [2.0, n, 0, 0]]
                                           if drafting else [[0.0, 0, 0, 0], [1.0, 0, 0, 0]])},
            "devices": devices}


def document() -> dict:
    phases = [phase(s, n) for s in ("sled", "centralized") for n in (2, 3)]
    # the only request of the largest sled phase open during the fault (6 s to 7 s)
    phases[1]["requests"].append(record(DEVICES[0], "sled", 3, 0.5, 0.1, sent=6.5))
    return {"run": "lab-<b>test</b>", "mode": "local", "started_at": "2026-11-23T21:00:00+00:00",
            "scenario": {"name": "synthetic", "slo": SLO, "costs": {}},
            "machine": {"cpus": 2, "memory_gb": 8.0, "platform": "Linux", "gpu": None},
            "link_emulation": {"dev-00": "user-space", "dev-01": "user-space", HOSTILE: "netem"},
            "phases": phases,
            "faults": [{"kind": "server_kill", "at_s": 6.0, "device": None, "down_s": 1.0,
                        "done_at_s": 7.0, "ok": True, "note": "restarted <quickly>"}],
            "server_power": {"source": "assumed", "watts": 200.0}}


def row(report: dict, system: str, n: int) -> dict:
    return next(r for r in report["headline"] if r["system"] == system and r["fleet_size"] == n)


def test_headline_numbers_match_hand_computed_values():
    report = summarise(document())
    r = row(report, "sled", 2)
    assert r["tokens"] == 42 and r["requests"] == 2 and r["errors"] == 0
    assert r["system_tokens_per_s"] == pytest.approx(4.2)           # 42 tokens / 10 s
    # dev-00: 21 tokens in 0.5 + 2.0 s = 8.4 tok/s; dev-01: 21 in 1.0 + 4.0 s = 4.2 tok/s
    # nearest rank over two values: p5 and p50 take the lower, p95 and p99 the higher
    assert r["device_tokens_per_s"] == pytest.approx({"p5": 4.2, "p50": 4.2, "p95": 8.4})
    assert r["ttft_s"] == pytest.approx({"p50": 0.5, "p95": 1.0, "p99": 1.0})
    assert r["tpot_s"] == pytest.approx({"p50": 0.1, "p95": 0.2, "p99": 0.2})
    assert r["forward_passes_per_token"] == pytest.approx(1.0)     # 42 passes / 42 tokens
    c = row(report, "centralized", 2)
    assert c["forward_passes_per_token"] == pytest.approx(2.0)     # 84 passes / 42 tokens


def test_capacity_picks_the_largest_fleet_size_meeting_the_slo():
    report = summarise(document())
    # sled x3: slowest device 21 / (1.0 + 4.0) = 4.2 >= 4; TTFT p95 1.0 <= 1.5 -> 3 devices
    assert report["capacity"]["sled"]["fleet_size"] == 3
    # centralized x3: dev-01 waits 2.0 s for its first token (> 1.5) -> only 2 devices
    assert report["capacity"]["centralized"]["fleet_size"] == 2
    strict = copy.deepcopy(document())
    strict["scenario"]["slo"] = {"tokens_per_s": 100.0, "ttft_s": 1.5}
    assert summarise(strict)["capacity"]["sled"]["fleet_size"] is None


def test_lossless_true_false_and_null():
    doc = document()
    report = summarise(doc)
    assert report["lossless"] is True
    assert report["lossless_detail"]["checked"] == 11 and report["lossless_detail"]["mismatched"] == 0

    bad = copy.deepcopy(doc)
    late = bad["phases"][1]["requests"][-1]
    late.update(lossless=False, lost_tokens=2, duplicated_tokens=1)
    report = summarise(bad)
    assert report["lossless"] is False
    assert report["lossless_detail"]["mismatched"] == 1
    assert report["lossless_detail"]["lost_tokens"] == 2
    fault = report["faults"][0]
    assert (fault["requests_overlapping"], fault["lost_tokens"], fault["duplicated_tokens"]) == (1, 2, 1)

    sampled = copy.deepcopy(doc)
    for p in sampled["phases"]:
        for r in p["requests"]:
            r["lossless"] = None
    assert summarise(sampled)["lossless"] is None

    mixed = copy.deepcopy(doc)     # one phase sampled, the rest greedy: still judged on the greedy ones
    for r in mixed["phases"][0]["requests"]:
        r["lossless"] = None
    report = summarise(mixed)
    assert report["lossless"] is True and report["lossless_detail"]["not_checked"] == 2


def test_acceptance_and_server_summaries():
    report = summarise(document())
    ngram = report["acceptance"]["ngram"]
    # sled phases: dev-00 in both (2 x 30 drafted), the third device in x3 -> 90 drafted, 45 accepted
    assert (ngram["drafted"], ngram["accepted"], ngram["rate"]) == (90, 45, 0.5)
    assert ngram["per_position"] == pytest.approx([0.8, 0.5, 0.2])
    server = report["server"][0]
    assert server["utilisation"] == pytest.approx(0.25)             # 2.5 forward s / 10 s
    assert server["batch_size_mean"] == pytest.approx((4 * 1 + 6 * 2) / 10)


def test_costs_count_server_only_for_centralized_and_drafting_for_sled():
    report = summarise(document())
    pi4 = report["costs"]["per_profile"]["pi4"]
    # centralized x3: 200 W x 10 s / 63 tokens, no device energy
    assert pi4["centralized"]["energy_j_per_token"] == pytest.approx(2000 / 63, rel=1e-4)
    assert pi4["centralized"]["device_j_per_token"] == 0
    # sled x3 (84 tokens): server 2000/84 J; pi4 drafting 30 tokens x 45 ms x 6.4 W over its 21 tokens
    assert pi4["sled"]["device_j_per_token"] == pytest.approx(30 * 0.045 * 6.4 / 21, rel=1e-4)
    assert pi4["sled"]["energy_j_per_token"] == pytest.approx(2000 / 84 + 30 * 0.045 * 6.4 / 21, rel=1e-4)
    names = {a["name"] for a in report["costs"]["assumptions"]}
    assert {"pi5.busy_watts", "gpu_server_watts", "electricity_per_kwh"} <= names


def test_cost_overrides_and_a_bad_key():
    table = lab_costs.assumptions({"electricity_per_kwh": 0.3, "devices": {"pi5": {"busy_watts": 9}}})
    assert table.electricity_per_kwh == 0.3
    assert table.device("pi5:draft_ms_per_token=10").busy_watts == 9.0
    assert table.device("pi4").busy_watts == lab_costs.CostAssumptions().device("pi4").busy_watts
    with pytest.raises(ValueError, match="electricity_per_kwhh"):
        lab_costs.assumptions({"electricity_per_kwhh": 0.3})
    with pytest.raises(ValueError, match="devices.pi5.watts"):
        lab_costs.assumptions({"devices": {"pi5": {"watts": 9}}})
    doc = document()
    doc["scenario"]["costs"] = {"nope": 1}
    with pytest.raises(ValueError, match="nope"):
        summarise(doc)


def test_server_power_reads_nvidia_smi_or_assumes(monkeypatch):
    monkeypatch.setattr(lab_costs.shutil, "which", lambda name: None)
    assert lab_costs.server_power() == {"source": "assumed", "watts": 200.0}
    assert lab_costs.server_power({"cpu_server_watts": 150})["watts"] == 150.0
    monkeypatch.setattr(lab_costs.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(lab_costs.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout="312.5\n", stderr=""))
    assert lab_costs.server_power() == {"source": "nvidia-smi", "watts": 312.5}
    monkeypatch.setattr(lab_costs.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout="[N/A]\n", stderr=""))
    assert lab_costs.server_power() == {"source": "assumed", "watts": 700.0}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    page = build_report(document(), out)
    return out, page, json.loads((out / "report.json").read_text())


def test_every_listed_png_exists_and_is_a_png(built):
    out, page, report = built
    assert page == out / "report.html"
    files = {p["file"] for p in report["plots"]}
    assert {"throughput.png", "faults.png", "costs.png", "kv_blocks.png", "acceptance.png",
            "placement.png"} <= files
    for name in files:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert report["lossless"] is True and report["link_emulation"]["kinds"] == ["netem", "user-space"]


def test_html_is_self_contained_and_embeds_the_images(built):
    out, page, report = built
    html = page.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html)
    assert "<script" not in html and "<link" not in html
    assert html.count('src="data:image/png;base64,') == len(report["plots"])
    assert "Lossless: every one of 11 greedy outputs matched the target's own greedy output" in html


def test_hostile_strings_are_escaped(built):
    out, page, report = built
    html = page.read_text()
    assert HOSTILE not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<b>test</b>" not in html and "lab-&lt;b&gt;test&lt;/b&gt;" in html
    assert "restarted &lt;quickly&gt;" in html


def test_absent_data_skips_its_plot_and_says_so(tmp_path):
    doc = document()
    doc["faults"] = []
    doc["phases"] = [p for p in doc["phases"] if p["system"] == "sled"]
    build_report(doc, tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    skipped = {p["file"] for p in report["skipped_plots"]}
    assert {"faults.png", "sled_vs_centralized.png"} <= skipped
    assert not (tmp_path / "faults.png").exists()
    assert "Not plotted" in (tmp_path / "report.html").read_text()


def test_importing_the_report_needs_no_plotting_library():
    code = "import sys, lab.report; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_errored_requests_are_not_mismatches_and_are_listed_apart(tmp_path):
    doc = document()
    requests = doc["phases"][0]["requests"]
    # new-style record: failed after a prefix of the reference, not judged
    requests[0].update(error="stream lost", complete=False, lossless=None, differing_tokens=0)
    # old-style record: errored and marked False, but nothing differed
    requests[1].update(error="timed out", lossless=False, differing_tokens=0)
    build_report(doc, tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    detail = report["lossless_detail"]
    assert report["lossless"] is True and detail["mismatched"] == 0 and detail["errored"] == 2
    assert report["errors"]["count"] == 2 and report["errors"]["first"] == ["stream lost", "timed out"]
    html = (tmp_path / "report.html").read_text()
    assert "Errored or incomplete requests (not judged): 2" in html and "stream lost" in html
    assert "token ids compared" in html and "2 errored or incomplete, 0 sampled" in html
    doc["phases"][1]["requests"][0]["lossless"] = False     # a token really differed
    assert summarise(doc)["lossless"] is False


def test_lossless_line_names_decoded_text_for_openai_and_null_when_nothing_checked(tmp_path):
    doc = document()
    doc["scenario"]["via"] = "openai"
    build_report(doc, tmp_path)
    assert "decoded text compared" in (tmp_path / "report.html").read_text()
    doc["scenario"]["sampling"] = {"temperature": 0.7}
    for p in doc["phases"]:
        for r in p["requests"]:
            r["lossless"] = None
    report = summarise(doc)
    assert report["lossless"] is None and report["lossless_detail"]["sampled"] == 11


def test_capacity_needs_no_errors_and_every_smaller_size_meeting_the_slo():
    rows = summarise(document())["headline"]
    ok = {"device_tokens_per_s": {"p5": 9.0}, "ttft_s": {"p95": 0.1}, "errors": 0}
    fake = [{"system": "sled", "fleet_size": n, **ok} for n in (1, 2, 3)]
    fake[1] = {**fake[1], "errors": 1}
    from lab.report import summary
    assert summary.capacity(fake, SLO)["sled"]["fleet_size"] == 1
    assert rows  # the real rows still compute


def test_server_is_gpu_only_by_its_device_flag_and_power_prefers_samples():
    from lab.report.energy import costs
    doc = document()
    doc["machine"]["gpu"] = "NVIDIA H100"
    doc["server_power"] = {"source": "nvidia-smi", "watts": 900.0, "samples": [100.0, 300.0]}
    server = costs(doc)["server"]
    assert server["gpu"] is False and server["watts"] == 200.0      # CPU server: GPU draw irrelevant
    doc["scenario"]["server"] = {"args": ["--device", "cuda:0"]}
    server = costs(doc)["server"]
    assert server["gpu"] is True and server["watts"] == 200.0 and server["price_per_hour"] == 3.0
    del doc["server_power"]["samples"]
    assert costs(doc)["server"]["watts"] == 900.0
    doc["server_device"] = "cpu"
    assert costs(doc)["server"]["gpu"] is False


def test_rented_server_cost_adds_no_electricity():
    from lab.report.energy import costs
    doc = document()
    doc["phases"] = [p for p in doc["phases"] if p["system"] == "centralized"]
    cell = costs(doc)["per_profile"]["pi5"]["centralized"]
    # 0.20 USD/h x 10 s / 63 tokens, nothing for the server's power
    assert cell["usd_per_million_tokens"] == pytest.approx(0.20 * 10 / 3600 / 63 * 1e6, rel=1e-4)


def test_nvidia_smi_reads_only_the_servers_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(lab_costs.shutil, "which", lambda name: "/usr/bin/nvidia-smi")

    def run(args, **k):
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, stdout="100.0\n", stderr="")
    monkeypatch.setattr(lab_costs.subprocess, "run", run)
    assert lab_costs.server_power()["watts"] == 100.0 and "--id=0" in calls[0]


def test_a_failing_plot_and_dollar_labels_do_not_stop_the_report(tmp_path, monkeypatch):
    from lab.report import plots
    doc = document()
    doc["phases"][0]["system"] = "sled $x^{$"          # mathtext would choke on this label
    doc["phases"].append({"system": "sled", "fleet_size": 5, "wall_s": 0.0, "requests": [], "server": {},
                          "devices": {}})
    broken = ("broken.png", "a broken plot", lambda plt, report, results: 1 / 0)
    monkeypatch.setattr(plots, "PLOTS", plots.PLOTS + (broken,))
    build_report(doc, tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    skipped = {p["file"]: p["reason"] for p in report["skipped_plots"]}
    assert "division by zero" in skipped["broken.png"] and "throughput.png" not in skipped
    assert "device_tokens_per_s.png" not in skipped and "latency.png" not in skipped
    assert b"matplotlib.org" not in (tmp_path / "throughput.png").read_bytes()
    assert "a broken plot" in (tmp_path / "report.html").read_text()


def emulated_document() -> dict:
    """document() as a run against a server emulating the shipped H100 profile, its devices
    drafting like the cross-family pair: 1 of every 50 steps of each phase overran."""
    doc = document()
    doc["scenario"]["server"] = {"emulate": "h100-llama8b-hf-graph", "args": []}
    doc["scenario"]["fleet"] = [{"count": 3, "device": "pi5", "link": "wifi",
                                 "drafter": "calibrated:smollm2-xtok"}]
    for p in doc["phases"]:
        p["server"].update(emulated_steps=50, emulated_overruns=1)
    return doc


def test_capacity_and_its_ratio_open_the_page(built):
    out, page, report = built
    # sled kept the SLO at 3 devices (the largest run: a lower bound), centralized at 2
    assert report["capacity_ratio"] == {"ratio": 1.5, "sled_lower_bound": True,
                                        "centralized_lower_bound": False}
    html = page.read_text()
    assert "<b>1.50x or more</b>" in html
    assert html.index("Capacity at the SLO") < html.index("<h2>Headline")
    assert report["server_emulation"] is None and "EMULATED" not in html


def test_an_emulated_run_names_its_profile_and_overruns_first(tmp_path):
    report = summarise(emulated_document())
    emulated = report["server_emulation"]
    assert (emulated["profile"], emulated["steps"], emulated["overruns"]) == \
        ("h100-llama8b-hf-graph", 200, 4)
    assert emulated["valid"] is False                   # 2% of steps overran: past the 1%
    assert emulated["provenance"]["device"].startswith("NVIDIA H100")
    assert len(emulated["pairs"]) == 1 and emulated["pairs"][0].startswith("smollm2-xtok: ")
    html = build_report(emulated_document(), tmp_path).read_text()
    first = html[:html.index("<h2>Headline")]
    assert "EMULATED SERVER" in first and "h100-llama8b-hf-graph" in first
    assert "4 of 200 steps" in first and "(2.0%)" in first and "past the 1%" in first
    assert "transformers" in first                       # the provenance is on the page
    assert "<td>1</td><td>2.0%</td>" in first           # each phase: 1 of 50 steps
    doc = emulated_document()
    for p in doc["phases"]:
        p["server"].update(emulated_steps=500)
    assert "within the 1%" in build_report(doc, tmp_path).read_text()


def test_devices_behind_their_boards_are_said_on_the_first_screen(tmp_path):
    doc = document()
    for p in doc["phases"]:
        for device in p["devices"].values():
            device.update(paced_drafts=50, late_drafts=5 if p["fleet_size"] == 3 else 0)
    report = summarise(doc)
    assert [(p["system"], p["fleet_size"], p["late_share"]) for p in report["board_pace"]] == \
        [("sled", 2, 0.0), ("sled", 3, 0.1), ("centralized", 2, 0.0), ("centralized", 3, 0.1)]
    html = build_report(doc, tmp_path).read_text()
    first = html[:html.index("<h2>Headline")]
    assert "fell behind their emulated boards" in first and "sled &times;3: 15 of 150 (10.0%)" in first
    assert "fell behind" not in build_report(document(), tmp_path).read_text()


def test_another_run_is_drawn_beside_this_one(tmp_path):
    cpu = summarise(document())
    page = build_report(emulated_document(), tmp_path, beside=cpu)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["beside"]["run"] == cpu["run"] and report["beside"]["server_emulation"] is None
    png = (tmp_path / "sled_vs_centralized.png").read_bytes()
    assert int.from_bytes(png[16:20], "big") == 1200     # two 6-inch panels, not the bar chart
    assert "sled_vs_centralized.png" in page.read_text()


def test_the_headline_says_what_the_server_spent_per_token():
    """Busy share, busy seconds per 1k tokens and, for an emulated server, their energy at the
    profile's GPU's board power: the buyer's columns of `sled lab simulate`."""
    from lab.report.summary import headline_row

    phase = {"system": "sled", "fleet_size": 2, "wall_s": 10.0,
             "server": {"forward_passes": 50, "forward_seconds": 4.0},
             "requests": [{"device": "dev-00", "token_ids": [1] * 400, "sent_at": 0.0,
                           "first_token_at": 0.5, "done_at": 8.0}]}
    row = headline_row(phase, watts=700.0)
    assert row["busy_share"] == 0.4 and row["busy_s_per_1k"] == 10.0
    assert row["energy_j_per_1k"] == 7000.0
    assert headline_row(phase)["energy_j_per_1k"] is None      # a server at its own pace


def test_each_replicas_load_has_its_share_and_its_own_section(tmp_path):
    """Servers behind a proxy: each replica's sessions and tokens with their shares of the
    phase's; a single server's run has no such section."""
    doc = document()
    doc["phases"][0]["replicas"] = [
        {"replica": 0, "sessions": 6, "tokens": 300, "forward_passes": 90},
        {"replica": 1, "sessions": 2, "tokens": 100, "forward_passes": None}]
    doc["faults"][0]["replica"] = 1
    build_report(doc, tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(r["replica"], r["sessions"], r["session_share"], r["tokens"], r["token_share"])
            for r in report["replicas"]] == [(0, 6, 0.75, 300, 0.75), (1, 2, 0.25, 100, 0.25)]
    html = (tmp_path / "report.html").read_text()
    assert "Load per replica" in html and "replica 1" in html
    assert summarise(document())["replicas"] == []
    assert "Load per replica" not in (build_report(document(), tmp_path / "one")).read_text()
