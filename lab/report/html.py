"""report.html: one self-contained page (inline CSS, PNGs as base64 data URIs, no external link
or script). Every string from the results is escaped."""
from __future__ import annotations

import base64
from html import escape
from pathlib import Path

CSS = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}.ok{color:#176f2c}.bad{color:#b00020}
figure{margin:1.5em 0}img{max-width:100%}figcaption{color:#555}
.emulated{border:2px solid #b36b00;background:#fff8ec;padding:0 1em;margin:1em 0}"""


DEFINITIONS = ("<p>System tok/s: every token received / the phase's wall time. Device tok/s: a device's "
               "tokens / the seconds its requests were open. TTFT: first token - sent. TPOT: (done - first "
               "token) / (tokens - 1). Passes/token: the server's forward passes / tokens. Busy: the "
               "server's seconds in steps / the wall time; busy s/1k tok: those seconds per 1k tokens "
               "(GPU-seconds for an emulated server); J/1k tok: those seconds at the emulated GPU's "
               "board power.</p>")


def _e(value) -> str:
    """A cell: numbers rounded, None as a dash, everything escaped."""
    if value is None:
        return "&ndash;"
    if isinstance(value, float):
        return escape(f"{value:.4g}")
    return escape(str(value))


def lossless_line(report: dict) -> str:
    """The losslessness verdict in words: what was compared, and what was not checked and why."""
    d = report["lossless_detail"]
    what = escape(d.get("compared", "token ids"))
    skipped = (f" Not checked: {d.get('errored', 0)} errored or incomplete, {d.get('sampled', 0)} sampled "
               "(no single reference).")
    if report["lossless"] is None:
        return f'<p class="l">Lossless: not checked (no completed greedy output).{skipped}</p>'
    if report["lossless"]:
        return (f'<p class="ok"><b>Lossless: every one of {d["checked"]} greedy outputs matched the '
                f"target's own greedy output ({what} compared).</b>{skipped}</p>")
    items = "".join(f"<li>{_e(m['system'])} x{_e(m['fleet_size'])}, device {_e(m['device'])}, "
                    f"prompt {_e(m['prompt_index'])}: {_e(m['lost_tokens'])} lost, "
                    f"{_e(m['duplicated_tokens'])} duplicated tokens{_error(m)}</li>" for m in d["mismatches"])
    return (f'<p class="bad"><b>Not lossless: {d["mismatched"]} of {d["checked"]} greedy outputs '
            f"differed from the target's own greedy output ({what} compared).</b>{skipped}</p><ul>{items}</ul>")


def errors_line(report: dict) -> str:
    """Errored or incomplete requests: not judged for losslessness, listed on their own."""
    d = report["lossless_detail"]
    if not d.get("errored"):
        return "<p>Errored or incomplete requests: 0.</p>"
    items = "".join(f"<li>{_e(m['system'])} x{_e(m['fleet_size'])}, device {_e(m['device'])}, "
                    f"prompt {_e(m['prompt_index'])}: {_e(m['error'] or 'incomplete')}</li>" for m in d["errors"])
    return f'<p class="bad">Errored or incomplete requests (not judged): {d["errored"]}.</p><ul>{items}</ul>'


def _error(m: dict) -> str:
    return f" (error: {_e(m['error'])})" if m.get("error") else ""


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f'<th class="l">{escape(h)}</th>' if i == 0 else f"<th>{escape(h)}</th>"
                   for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td class="l">{_e(c)}</td>' if i == 0 else f"<td>{_e(c)}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def headline_table(report: dict) -> str:
    headers = ["system", "devices", "requests", "tokens", "system tok/s", "device tok/s p5", "p50", "p95",
               "TTFT p50 s", "p95", "p99", "TPOT p50 s", "p95", "p99", "passes/token", "busy",
               "busy s/1k tok", "J/1k tok", "errors"]
    rows = [[r["system"], r["fleet_size"], r["requests"], r["tokens"], r["system_tokens_per_s"],
             *r["device_tokens_per_s"].values(), *r["ttft_s"].values(), *r["tpot_s"].values(),
             r["forward_passes_per_token"], r.get("busy_share"), r.get("busy_s_per_1k"),
             r.get("energy_j_per_1k"), r["errors"]] for r in report["headline"]]
    return _table(headers, rows)


def capacity_line(report: dict) -> str:
    """Capacity at the SLO per system, and sled's over centralized's ("2.0x or more" when
    sled kept the SLO at the largest fleet run)."""
    slo, ratio = report["slo"], report.get("capacity_ratio")
    parts = [f"{escape(system)}: {_e(c['fleet_size'])} devices" for system, c in report["capacity"].items()]
    said = ""
    if ratio:
        bound = ratio["sled_lower_bound"] and not ratio["centralized_lower_bound"]
        said = (f" sled carries <b>{ratio['ratio']:.2f}x{' or more' if bound else ''}</b> the "
                f"devices centralized serving does{' (sled kept it at the largest fleet run)' if bound else ''}.")
    return (f"<p>Capacity at the SLO ({_e(slo.get('tokens_per_s'))} tokens/s per device at p5, "
            f"TTFT p95 &le; {_e(slo.get('ttft_s'))} s): {'; '.join(parts) or 'no phase ran'}.{said}</p>")


def board_line(report: dict) -> str:
    """Whether the devices kept their emulated boards' pace: said when a phase's drafts came
    late more than 1% of the time (this machine, not the fleet, set those devices' speed)."""
    behind = [p for p in report.get("board_pace") or [] if (p["late_share"] or 0) > 0.01]
    if not behind:
        return ""
    phases = "; ".join(f"{escape(p['system'])} &times;{p['fleet_size']}: {p['late_drafts']} of "
                       f"{p['paced_drafts']} ({p['late_share']:.1%})" for p in behind)
    return (f'<p class="bad">The devices fell behind their emulated boards: drafts came more '
            f"than 10% past the board's time in {phases}. This machine's cores, not the boards, "
            f"set those devices' pace there.</p>")


def emulation_block(report: dict) -> str:
    """The first thing an emulated run says: the server is emulated, from which measurement,
    the pairs its devices draft like, and whether the run stands for that GPU."""
    emulated = report.get("server_emulation")
    if not emulated:
        return ""
    verdict = ('<span class="ok">within the 1% the emulation stands for</span>'
               if emulated["valid"] else
               '<span class="bad">past the 1% the emulation stands for: this machine could '
               "not keep the profile's pace, so these figures fall short of that GPU's</span>")
    provenance = "; ".join(f"{escape(k)}: {escape(str(v))}" for k, v in emulated["provenance"].items())
    pairs = "".join(f"<li>{escape(line)}</li>" for line in emulated["pairs"])
    return (f'<div class="emulated"><p><b>EMULATED SERVER.</b> Every step was held to the time the '
            f"step-cost profile <b>{escape(emulated['profile'])}</b> gives for its shape; a tiny "
            f"target on this machine computed every token, so every output is still checked "
            f"against its own. Profile: {escape(emulated['description'])}.</p>"
            f"<p>Provenance: {provenance}.</p>"
            + (f"<p>Devices draft like these pairs, recorded for real:</p><ul>{pairs}</ul>" if pairs else "")
            + f"<p>Overruns: {emulated['overruns']} of {emulated['steps']} steps ran past the "
            f"profile's time ({emulated['overrun_share']:.1%}): {verdict}.</p>"
            + _table(["system", "devices", "steps", "overruns", "share"],
                     [[p["system"], p["fleet_size"], p["forward_passes"], p["overruns"],
                       f"{p['overruns'] / p['forward_passes']:.1%}" if p["forward_passes"] else None]
                      for p in emulated["phases"]]) + "</div>")


def figures(report: dict, out_dir: Path) -> str:
    parts = []
    for plot in report["plots"]:
        data = base64.b64encode((out_dir / plot["file"]).read_bytes()).decode("ascii")
        parts.append(f'<figure><img alt="{escape(plot["file"])}" src="data:image/png;base64,{data}">'
                     f"<figcaption>{escape(plot['caption'])}</figcaption></figure>")
    for plot in report["skipped_plots"]:
        parts.append(f"<p>Not plotted: {escape(plot['caption'])} ({escape(plot['reason'])}).</p>")
    return "".join(parts)


def cost_tables(report: dict) -> str:
    costs = report["costs"]
    server = costs["server"]
    rows = [[name, system, c and c["energy_j_per_token"], c and c["device_j_per_token"],
             c and c["usd_per_million_tokens"]]
            for name, systems in costs["per_profile"].items() for system, c in systems.items()]
    return (f"<p>Server power: {_e(server['watts'])} W ({_e(server['source'])}); server price "
            f"{_e(server['price_per_hour'])} USD/h.</p>"
            + _table(["device profile", "system", "J/token", "of it drafting J/token", "USD / M tokens"], rows)
            + "<h3>Assumptions</h3>"
            + _table(["assumption", "value", "unit", "source"],
                     [[a["name"], a["value"], a["unit"], a["source"]] for a in costs["assumptions"]]))


def links_table(report: dict) -> str:
    rows = sorted(report["link_emulation"]["per_device"].items())
    return _table(["device", "link emulation"], [list(r) for r in rows]) if rows else "<p>No device ran.</p>"


def replicas_section(report: dict) -> str:
    """Each replica's load per phase, when the server ran as replicas behind a proxy."""
    rows = report.get("replicas") or []
    if not rows:
        return ""
    table = _table(["system", "devices", "replica", "sessions opened", "share", "tokens", "share",
                    "forward passes"],
                   [[r["system"], r["fleet_size"], r["replica"], r["sessions"], r["session_share"],
                     r["tokens"], r["token_share"], r["forward_passes"]] for r in rows])
    return ("<h2>Load per replica</h2><p>The server ran as replicas behind HAProxy; sessions "
            "opened include those a replica took over from a lost one (each resumed session is "
            "opened again, and its prompt prefilled again, on the replica that takes it). A killed "
            "replica's counts since its last scrape (at most a second) are lost with it.</p>"
            + table)


def faults_table(report: dict) -> str:
    if not report["faults"]:
        return "<p>No fault steps.</p>"
    rows = [[f["kind"], f["at_s"], _target(f), f.get("down_s"), f["ok"], f["requests_overlapping"],
             f["lost_tokens"], f["duplicated_tokens"], f.get("note")] for f in report["faults"]]
    return _table(["fault", "at s", "device / replica", "down s", "ok", "requests open",
                   "lost tokens", "duplicated tokens", "note"], rows)


def _target(fault: dict):
    """What a fault step hit: its device, or its replica behind the proxy."""
    if fault.get("replica") is not None:
        return f"replica {fault['replica']}"
    return fault.get("device")


def page(report: dict, out_dir: Path) -> str:
    machine = report.get("machine") or {}
    title = f"sled lab: {report['run']}"
    sections = [
        f"<h1>{escape(title)}</h1>",
        f"<p>Mode {_e(report['mode'])}, started {_e(report.get('started_at'))}; machine: "
        f"{_e(machine.get('cpus'))} CPUs, {_e(machine.get('memory_gb'))} GB, "
        f"{_e(machine.get('platform'))}, GPU {_e(machine.get('gpu'))}.</p>",
        emulation_block(report), board_line(report), capacity_line(report),
        lossless_line(report), errors_line(report), "<h2>Headline</h2>", headline_table(report), DEFINITIONS,
        replicas_section(report),
        "<h2>Plots</h2>", figures(report, out_dir), "<h2>Fault steps</h2>", faults_table(report), "<h2>Cost and energy</h2>", cost_tables(report),
        "<h2>Link emulation</h2>", links_table(report)]
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{CSS}</style></head><body>{''.join(sections)}</body></html>\n")
