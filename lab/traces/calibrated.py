"""Calibrated pairs: the acceptance a real drafter reached against a real target, measured once
from a recorded trace (`sled trace record`, lab.traces.synthetic.acceptance_profile) and shipped
with its provenance in lab/traces/calibrated/NAME.json, so an emulated fleet drafts like that
pair against any target, an emulated GPU server's included.

A scenario's fleet names one as its drafter, `calibrated:smollm2-xtok`. Before the devices
start, `sled lab run` draws one synthetic trace per prompt of the workload along the target's
own greedy output (the run's references) with the pair's acceptance, writes the set to the
fleet's traces folder (write_traces), and each such device drafts `trace:FILE` from it
(trace_spec), paced to its board's drafting speed by the daemon's board emulation.

    trace_spec("calibrated:smollm2-xtok", Path("run/traces")) -> "trace:run/traces/smollm2-xtok.jsonl"
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lab.traces.format import TraceSet
from lab.traces.synthetic import SyntheticDrafter, synthetic_trace_set

PREFIX = "calibrated:"
FOLDER = Path(__file__).with_name("calibrated")
# Tokens drafted per position of a trace: a 16-token draft (the daemon's max_draft_len) drafted
# ahead of its verdict reads up to twice that past a position; the acceptance past the measured
# positions repeats the last one.
MAX_K = 40
SEED = 0


@dataclass(frozen=True)
class Calibration:
    name: str
    description: str
    target: str                 # the real pair it was recorded on
    drafter: str
    acceptance: list[float]     # conditional acceptance of draft positions 1, 2, ...
    recorded: dict              # machine, date, workload, max_new_tokens, command

    def line(self) -> str:
        """One line for reports: the pair, what it keeps of its drafts, where it was measured."""
        where = self.recorded
        return (f"{self.name}: {self.description}; acceptance by position "
                f"{', '.join(f'{a:.2f}' for a in self.acceptance)}; recorded {where['date']} "
                f"on {where['machine']} ({where['workload']})")


def calibrations() -> dict[str, Calibration]:
    """Every shipped pair by name."""
    found = {}
    for path in sorted(FOLDER.glob("*.json")):
        data = json.loads(path.read_text())
        found[data["name"]] = Calibration(**data)
    return found


def is_calibrated(spec: str) -> bool:
    return spec.startswith(PREFIX)


def load_calibration(spec: str) -> Calibration:
    """The pair `calibrated:NAME` (or NAME) names; ValueError listing the shipped ones."""
    name = spec.removeprefix(PREFIX)
    shipped = calibrations()
    if name not in shipped:
        raise ValueError(f"unknown calibrated pair {name!r}: use calibrated:NAME with NAME one "
                         f"of {', '.join(shipped)}")
    return shipped[name]


def trace_file(traces_dir: Path, spec: str) -> Path:
    return Path(traces_dir) / f"{spec.removeprefix(PREFIX)}.jsonl"


def trace_spec(spec: str, traces_dir: Path) -> str:
    """The daemon's drafter spec for a slot's: calibrated:NAME drafts from its trace file; any
    other spec is unchanged."""
    return f"trace:{trace_file(traces_dir, spec)}" if is_calibrated(spec) else spec


def write_traces(specs: Sequence[str], prompt_ids: Sequence[Sequence[int]],
                 outputs: Sequence[Sequence[int]], vocab_size: int, traces_dir: Path,
                 target: str) -> list[Path]:
    """One trace file per calibrated pair in SPECS: a synthetic trace per prompt along the
    target's greedy output, drawn with the pair's acceptance (the same seed for every pair)."""
    written = []
    for spec in sorted({s for s in specs if is_calibrated(s)}):
        pair = load_calibration(spec)
        drafter = SyntheticDrafter(pair.acceptance, MAX_K, SEED, f"calibrated:{pair.name}")
        traces = synthetic_trace_set(prompt_ids, outputs, drafter, vocab_size, target, None)
        written.append(traces.save(trace_file(traces_dir, spec)))
    return written


def calibrated_trace_set(spec: str, model: str, texts: Sequence[str], max_new_tokens: int,
                         server_args: Sequence[str] = ()) -> TraceSet:
    """A calibrated pair's traces along `model`'s own greedy output for `texts` (the target as
    `sled serve --model MODEL SERVER_ARGS` computes it): what `sled bench serve --traces
    calibrated:NAME` replays."""
    from lab.oracle import target_references    # loads the target: torch

    pair = load_calibration(spec)
    references = target_references(model, list(texts), max_new_tokens, list(server_args))
    drafter = SyntheticDrafter(pair.acceptance, MAX_K, SEED, f"calibrated:{pair.name}")
    return synthetic_trace_set(references.prompt_ids, references.outputs, drafter,
                               references.vocab_size, model, None)
