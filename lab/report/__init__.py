"""The lab's report from a results document (lab/results.py): report.json, the PNGs and a
self-contained report.html in one folder.

    build_report(results, out_dir) -> out_dir / "report.html"
"""
from __future__ import annotations

import json
from pathlib import Path

from lab.report import html, plots, summary
from lab.report.energy import costs


def summarise(results: dict) -> dict:
    """report.json's content, without the plots."""
    detail = summary.lossless_detail(results)
    rows = summary.headline(results)
    slo = (results.get("scenario") or {}).get("slo") or {}
    links = results.get("link_emulation") or {}
    capacity = summary.capacity(rows, slo)
    return {"lossless": summary.lossless(detail), "run": results["run"], "mode": results["mode"],
            "started_at": results.get("started_at"), "machine": results.get("machine"),
            "link_emulation": {"kinds": sorted(set(links.values())), "per_device": links},
            "server_emulation": summary.emulation(results),
            "board_pace": summary.board_pace(results),
            "slo": slo, "headline": rows, "capacity": capacity,
            "capacity_ratio": summary.capacity_ratio(capacity, rows) if rows else None,
            "acceptance": summary.acceptance(results), "server": summary.server(results),
            "replicas": summary.replica_load(results),
            "costs": costs(results), "faults": summary.faults(results), "lossless_detail": detail,
            "errors": {"count": detail["errored"], "first": [e["error"] for e in detail["errors"][:5]]}}


def build_report(results: dict, out_dir: Path, beside: dict | None = None) -> Path:
    """Write report.json, the PNGs and report.html into out_dir; the page's path. BESIDE:
    another run's report.json (a run on this machine's own server, for an emulated one), drawn
    next to this run in the sled-vs-centralized plot."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = summarise(results)
    report["beside"] = _beside(beside)
    report["plots"], report["skipped_plots"] = [], []
    # report.json first: a failing plot must not cost the numbers
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    report["plots"], report["skipped_plots"] = plots.render(report, results, out_dir)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    page = out_dir / "report.html"
    page.write_text(html.page(report, out_dir), encoding="utf-8")
    return page


def _beside(report: dict | None) -> dict | None:
    """What this report keeps of another run's report: its name, server and headline."""
    if report is None:
        return None
    return {"run": report["run"], "server_emulation": report.get("server_emulation"),
            "headline": report["headline"], "capacity": report.get("capacity")}


def load_report(folder: Path) -> dict:
    """A finished run's report.json (ValueError naming the folder when it has none)."""
    path = Path(folder) / "report.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder} holds no lab report ({path}: {exc})") from None
