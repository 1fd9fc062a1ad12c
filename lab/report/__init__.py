"""The lab's report from a results document (lab/results.py): report.json, the PNGs and a
self-contained report.html in one folder.

    build_report(results, out_dir) -> out_dir / "report.html"
"""
from __future__ import annotations

import json
from pathlib import Path

from lab.report import summary
from lab.report.energy import costs


def summarise(results: dict) -> dict:
    """report.json's content, without the plots."""
    detail = summary.lossless_detail(results)
    rows = summary.headline(results)
    slo = (results.get("scenario") or {}).get("slo") or {}
    emulation = results.get("link_emulation") or {}
    return {"lossless": summary.lossless(detail), "run": results["run"], "mode": results["mode"],
            "started_at": results.get("started_at"), "machine": results.get("machine"),
            "link_emulation": {"kinds": sorted(set(emulation.values())), "per_device": emulation},
            "slo": slo, "headline": rows, "capacity": summary.capacity(rows, slo),
            "acceptance": summary.acceptance(results), "server": summary.server(results),
            "costs": costs(results), "faults": summary.faults(results), "lossless_detail": detail,
            "errors": {"count": detail["errored"], "first": [e["error"] for e in detail["errors"][:5]]}}


def build_report(results: dict, out_dir: Path) -> Path:
    """Write report.json, the PNGs and report.html into out_dir; the page's path."""
    from lab.report import html, plots

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = summarise(results)
    report["plots"], report["skipped_plots"] = [], []
    # report.json first: a failing plot must not cost the numbers
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    report["plots"], report["skipped_plots"] = plots.render(report, results, out_dir)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    page = out_dir / "report.html"
    page.write_text(html.page(report, out_dir), encoding="utf-8")
    return page
