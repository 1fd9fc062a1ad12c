"""The numbers of a lab report, computed from the results document (lab/results.py).

Definitions (the page states them too):
- system tokens/s: every token the phase's requests received / the phase's wall time;
- per-device tokens/s: a device's tokens / the seconds its requests were open (sent -> done);
- TTFT: first token - sent; TPOT: (done - first token) / (tokens - 1), requests with 2+ tokens;
- forward passes per token: the server's forward passes / the phase's tokens;
- busy: the server's seconds in steps / the phase's wall time; busy s per 1k tokens, and for an
  emulated server that time at its GPU's board power (J per 1k tokens).
"""
from __future__ import annotations

from collections import defaultdict

from lab.bench.report import percentile
from lab.bench.serve import emulation_summary
from lab.traces.calibrated import is_calibrated, load_calibration
from verify_server.gpu_memory import gpu_memory
from verify_server.step_costs import load_profile

QUANTILES = (50, 95, 99)


def _pcts(values: list[float], qs=QUANTILES) -> dict:
    return {f"p{q}": (round(percentile(values, q), 6) if values else None) for q in qs}


def _tokens(record: dict) -> int:
    return len(record.get("token_ids") or [])


def device_rates(phase: dict) -> dict[str, float]:
    """Per device: its tokens / the seconds its requests were open."""
    tokens, busy = defaultdict(int), defaultdict(float)
    for r in phase["requests"]:
        if r.get("done_at") is None or r.get("sent_at") is None:
            continue
        tokens[r["device"]] += _tokens(r)
        busy[r["device"]] += max(0.0, r["done_at"] - r["sent_at"])
    return {d: tokens[d] / busy[d] for d in tokens if busy[d] > 0}


def ttfts(phase: dict) -> list[float]:
    return [r["first_token_at"] - r["sent_at"] for r in phase["requests"]
            if not r.get("error") and r.get("first_token_at") is not None]


def tpots(phase: dict) -> list[float]:
    return [(r["done_at"] - r["first_token_at"]) / (_tokens(r) - 1) for r in phase["requests"]
            if not r.get("error") and r.get("first_token_at") is not None
            and r.get("done_at") is not None and _tokens(r) > 1]


def headline_row(phase: dict, watts: float | None = None) -> dict:
    """One system at one fleet size: the headline table's row. The server's busy share, its
    busy seconds per 1k tokens and, given the board power of an emulated server's GPU (watts),
    the energy of those seconds."""
    tokens = sum(_tokens(r) for r in phase["requests"])
    wall = phase.get("wall_s") or 0.0
    passes = (phase.get("server") or {}).get("forward_passes")
    busy = (phase.get("server") or {}).get("forward_seconds")
    per_1k = busy * 1e3 / tokens if busy is not None and tokens else None
    return {"system": phase["system"], "fleet_size": phase["fleet_size"],
            "requests": len(phase["requests"]), "tokens": tokens,
            "system_tokens_per_s": round(tokens / wall, 6) if wall > 0 else None,
            "device_tokens_per_s": _pcts(list(device_rates(phase).values()), (5, 50, 95)),
            "ttft_s": _pcts(ttfts(phase)), "tpot_s": _pcts(tpots(phase)),
            "forward_passes_per_token": round(passes / tokens, 6) if passes is not None and tokens else None,
            "busy_share": utilisation(phase),
            "busy_s_per_1k": round(per_1k, 6) if per_1k is not None else None,
            "energy_j_per_1k": round(per_1k * watts, 3) if per_1k is not None and watts else None,
            "errors": sum(1 for r in phase["requests"] if _errored(r))}


def headline(results: dict) -> list[dict]:
    watts = emulated_watts(results)
    return [headline_row(p, watts) for p in sorted(results["phases"],
                                                   key=lambda p: (p["system"], p["fleet_size"]))]


def emulated_watts(results: dict) -> float | None:
    """The board power of the GPU an emulated server's profile stands for (None otherwise)."""
    name = ((results.get("scenario") or {}).get("server") or {}).get("emulate")
    return gpu_memory(load_profile(name)).tdp_watts if name else None


def capacity(rows: list[dict], slo: dict) -> dict:
    """Per system: the largest n such that every measured fleet size <= n meets the SLO (p5
    per-device tokens/s, TTFT p95) with no errored request."""
    out = {}
    for system in sorted({row["system"] for row in rows}):
        best = None
        for row in sorted((r for r in rows if r["system"] == system), key=lambda r: r["fleet_size"]):
            if not _meets(row, slo):
                break
            best = row["fleet_size"]
        out[system] = {"fleet_size": best, "tokens_per_s": slo.get("tokens_per_s"), "ttft_s": slo.get("ttft_s")}
    return out


def capacity_ratio(capacity: dict, rows: list[dict]) -> dict | None:
    """sled's capacity over centralized's, when both kept the SLO at some fleet size; a capacity
    at the largest fleet size run is only a lower bound (the run stopped there)."""
    sled, central = (capacity.get(s, {}).get("fleet_size") for s in ("sled", "centralized"))
    if not sled or not central:
        return None
    largest = max(r["fleet_size"] for r in rows)
    return {"ratio": round(sled / central, 6), "sled_lower_bound": sled == largest,
            "centralized_lower_bound": central == largest}


def board_pace(results: dict) -> list[dict]:
    """Per phase: the drafts the devices paced to their emulated boards, and those that came late
    because this machine could not give the boards their pace (the devices' own overruns)."""
    rows = []
    for phase in results["phases"]:
        devices = (phase.get("devices") or {}).values()
        paced = sum(d.get("paced_drafts") or 0 for d in devices)
        late = sum(d.get("late_drafts") or 0 for d in devices)
        rows.append({"system": phase["system"], "fleet_size": phase["fleet_size"],
                     "paced_drafts": paced, "late_drafts": late,
                     "late_share": round(late / paced, 6) if paced else None})
    return rows


def emulation(results: dict) -> dict | None:
    """An emulated server's step-cost profile with its provenance, the calibrated pairs the
    devices drafted like, and whether the run stands for that GPU (overruns of every phase,
    lab.bench.serve.emulation_summary); None for a server that ran at its own pace."""
    name = ((results.get("scenario") or {}).get("server") or {}).get("emulate")
    if not name:
        return None
    profile = load_profile(name)
    phases = [{"system": p["system"], "fleet_size": p["fleet_size"],
               "forward_passes": (p.get("server") or {}).get("emulated_steps") or 0,
               "overruns": (p.get("server") or {}).get("emulated_overruns") or 0}
              for p in results["phases"]]
    drafters = {g["drafter"] for g in (results.get("scenario") or {}).get("fleet") or []}
    return {**emulation_summary(profile, phases), "description": profile.describe(),
            "phases": phases, "pairs": [load_calibration(d).line() for d in sorted(drafters)
                                        if is_calibrated(d)]}


def _meets(row: dict, slo: dict) -> bool:
    p5, ttft = row["device_tokens_per_s"]["p5"], row["ttft_s"]["p95"]
    return (not row.get("errors") and p5 is not None and ttft is not None
            and p5 >= slo.get("tokens_per_s", 0.0) and ttft <= slo.get("ttft_s", float("inf")))


def acceptance(results: dict) -> dict:
    """Per drafter over every sled phase: overall accepted/drafted and per draft position."""
    sums: dict = defaultdict(lambda: {"drafted": 0, "accepted": 0, "pos_d": [], "pos_a": []})
    for phase in results["phases"]:
        if phase["system"] != "sled":
            continue
        for dev in (phase.get("devices") or {}).values():
            s = sums[dev.get("drafter", "?")]
            s["drafted"] += dev.get("drafted") or 0
            s["accepted"] += dev.get("accepted") or 0
            _add(s["pos_d"], dev.get("position_drafted") or [])
            _add(s["pos_a"], dev.get("position_accepted") or [])
    return {name: {"drafted": s["drafted"], "accepted": s["accepted"],
                   "rate": round(s["accepted"] / s["drafted"], 6) if s["drafted"] else None,
                   "per_position": [round(a / d, 6) if d else None
                                    for d, a in zip(s["pos_d"], s["pos_a"] + [0] * len(s["pos_d"]))]}
            for name, s in sorted(sums.items())}


def _add(total: list, values: list) -> None:
    total.extend([0] * (len(values) - len(total)))
    for i, v in enumerate(values):
        total[i] += v


def server(results: dict) -> list[dict]:
    """Per phase: batch sizes (per bucket, and a mean from the buckets' upper bounds), utilisation."""
    rows = []
    for phase in results["phases"]:
        srv = phase.get("server") or {}
        buckets = {str(k): int(v) for k, v in (srv.get("batch_sizes") or {}).items()}
        rows.append({"system": phase["system"], "fleet_size": phase["fleet_size"],
                     "batch_sizes": buckets, "batch_size_mean": _bucket_mean(buckets),
                     "forward_passes": srv.get("forward_passes"),
                     "forward_seconds": srv.get("forward_seconds"),
                     "utilisation": utilisation(phase)})
    return rows


def replica_load(results: dict) -> list[dict]:
    """Per phase and replica (several servers behind a proxy): the sessions it opened, resumed
    ones included, and the tokens it committed, each with its share of the phase's; empty when
    one server ran."""
    rows = []
    for phase in results["phases"]:
        replicas = phase.get("replicas") or []
        sessions = sum(r.get("sessions") or 0 for r in replicas)
        tokens = sum(r.get("tokens") or 0 for r in replicas)
        for r in replicas:
            rows.append({"system": phase["system"], "fleet_size": phase["fleet_size"],
                         "replica": r["replica"], "sessions": r.get("sessions"),
                         "session_share": _share(r.get("sessions"), sessions),
                         "tokens": r.get("tokens"), "token_share": _share(r.get("tokens"), tokens),
                         "forward_passes": r.get("forward_passes")})
    return rows


def _share(part: int | None, whole: int) -> float | None:
    return round(part / whole, 6) if part is not None and whole else None


def utilisation(phase: dict) -> float | None:
    """The server's seconds in steps over the phase's wall time (None when either is unknown)."""
    busy, wall = (phase.get("server") or {}).get("forward_seconds"), phase.get("wall_s") or 0.0
    return round(busy / wall, 6) if busy is not None and wall > 0 else None


def _bucket_mean(buckets: dict[str, int]) -> float | None:
    """The mean batch size with each count at its bucket's upper bound ("+Inf" at the last finite one)."""
    finite = sorted(float(b) for b in buckets if b != "+Inf")
    total = sum(buckets.values())
    if not total or not finite:
        return None
    size = {b: (finite[-1] if b == "+Inf" else float(b)) for b in buckets}
    return round(sum(size[b] * n for b, n in buckets.items()) / total, 6)


def _greedy(results: dict) -> bool:
    sampling = (results.get("scenario") or {}).get("sampling") or {}
    return float(sampling.get("temperature", 0.0) or 0.0) == 0.0


def _errored(record: dict) -> bool:
    """Failed or ended without a finish reason (old records have no "complete": an error says it)."""
    return bool(record.get("error")) or record.get("complete", True) is False


def _mismatched(record: dict) -> bool:
    """A received token differs from the target's (an errored prefix is not judged)."""
    if record.get("lossless") is not False:
        return False
    return not (_errored(record) and record.get("differing_tokens", 1) == 0)


def _entry(phase: dict, record: dict) -> dict:
    return {"system": phase["system"], "fleet_size": phase["fleet_size"], "device": record.get("device"),
            "prompt_index": record.get("prompt_index"), "lost_tokens": record.get("lost_tokens") or 0,
            "duplicated_tokens": record.get("duplicated_tokens") or 0,
            "differing_tokens": record.get("differing_tokens"), "error": record.get("error")}


def lossless_detail(results: dict, listed: int = 20) -> dict:
    """Greedy requests checked against the target's own greedy output: matched, mismatched (a
    token differs), errored (failed or incomplete: not judged, listed with their errors)."""
    records = [(p, r) for p in results["phases"] for r in p["requests"]]
    mismatched = [(p, r) for p, r in records if _mismatched(r)]
    errored = [(p, r) for p, r in records if not _mismatched(r) and _errored(r)]
    matched = [r for _, r in records if r.get("lossless") is True and not _errored(r)]
    sampled = 0 if _greedy(results) else len(records) - len(mismatched) - len(errored)
    via = (results.get("scenario") or {}).get("via") or "mqtt"
    return {"checked": len(matched) + len(mismatched), "matched": len(matched), "mismatched": len(mismatched),
            "errored": len(errored), "sampled": sampled,
            "not_checked": len(records) - len(matched) - len(mismatched),
            "compared": "decoded text" if via == "openai" else "token ids",
            "lost_tokens": sum(r.get("lost_tokens") or 0 for _, r in records),
            "duplicated_tokens": sum(r.get("duplicated_tokens") or 0 for _, r in records),
            "mismatches": [_entry(p, r) for p, r in mismatched],
            "errors": [_entry(p, r) for p, r in errored[:listed]]}


def lossless(detail: dict) -> bool | None:
    """False: a greedy output differed; True: at least one checked, none differed; None: none checked."""
    if detail["mismatched"]:
        return False
    return True if detail["checked"] else None


def faults(results: dict) -> list[dict]:
    """Each fault step with the tokens lost and duplicated in the requests open while it lasted
    (faults run in the sled phase of the largest fleet size)."""
    sled = [p for p in results["phases"] if p["system"] == "sled"]
    phase = max(sled, key=lambda p: p["fleet_size"]) if sled else {"requests": []}
    out = []
    for fault in results.get("faults") or []:
        start = fault["at_s"]
        end = fault.get("done_at_s") if fault.get("done_at_s") is not None else start + (fault.get("down_s") or 0)
        hit = [r for r in phase["requests"] if _overlaps(r, start, end)]
        out.append({**fault, "requests_overlapping": len(hit),
                    "lost_tokens": sum(r.get("lost_tokens") or 0 for r in hit),
                    "duplicated_tokens": sum(r.get("duplicated_tokens") or 0 for r in hit),
                    "errors": sum(1 for r in hit if r.get("error"))})
    return out


def _overlaps(record: dict, start: float, end: float) -> bool:
    sent, done = record.get("sent_at"), record.get("done_at")
    if sent is None:
        return False
    return sent <= end and (done is None or done >= start)
