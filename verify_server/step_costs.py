"""Step-cost profiles: how long one server step takes on a GPU and model that are not here, so a
server on any machine can be held to that GPU's pace (`sled serve --emulate PROFILE`).

A profile is a small JSON file: the steps measured on one GPU with one model shape, the rule
fitted through them, and where the measurements come from.

    {"sled_step_profile": 1, "name": "h100-llama8b-hf-graph",
     "provenance": {"device": "NVIDIA H100 80GB HBM3", "model": "llama-8b", "dtype": "bfloat16",
                    "engine": "...", "torch": "2.11.0+cu130", "transformers": "5.17.0",
                    "date": "2026-11-23", "command": "..."},
     "cells": [{"rows": 16, "tokens": 5, "context": 512, "ms": 17.3}, ...],
     "rule": {"base_ms": 9.54, "per_token_ms": 0.0254, "per_kv_token_ms": 0.00072}}

A cell is a step of `rows` sessions, each feeding `tokens` new tokens after `context` tokens of
KV. The rule gives any step's time from two sums over its rows: the new tokens (the weights'
work per token) and the KV tokens read (every row's context and new tokens):

    ms = base_ms + per_token_ms * new + per_kv_token_ms * read

16 rows x 5 tokens at 512: new = 80, read = 16 x 517 = 8272, so 9.54 + 2.03 + 5.96 = 17.5 ms.
The rule is fitted by least squares with no negative term, so a larger step never costs less.

A profile may also say what its GPU holds (`"gpu": {"memory_bytes": ..., "weight_bytes": ...,
"kv_bytes_per_token": ..., "tdp_watts": ...}`), so that a server held to it admits only the
sessions whose KV that GPU would hold (verify_server.gpu_memory derives what the block leaves out).
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

# Past this share of overrun steps an emulated run is not valid for its profile.
MAX_OVERRUN_SHARE = 0.01

FORMAT_VERSION = 1
SHIPPED = Path(__file__).with_name("step_profiles")
PROVENANCE = ("device", "model", "engine", "torch", "transformers", "date", "command")
# What a profile may say of its GPU's memory (all optional: verify_server.gpu_memory derives what
# it can from the device's name and the model's shape)
GPU_FIELDS = ("memory_bytes", "weight_bytes", "kv_bytes_per_token", "tdp_watts")
# A larger step measured faster than a smaller one by up to this share is noise, not a profile
# that cannot stand for a device.
NOISE = 0.03


@dataclass(frozen=True, slots=True)
class StepCell:
    """One measured step: `rows` sessions of `tokens` new tokens after `context` each."""
    rows: int
    tokens: int
    context: int
    ms: float

    @property
    def new(self) -> int:
        return self.rows * self.tokens

    @property
    def read(self) -> int:
        return self.rows * (self.context + self.tokens)

    def dominated_by(self, other: "StepCell") -> bool:
        """Whether `other` is at least as large a step in every respect, and larger in one."""
        mine = (self.rows, self.tokens, self.context)
        theirs = (other.rows, other.tokens, other.context)
        return mine != theirs and all(a <= b for a, b in zip(mine, theirs))

    def __str__(self) -> str:
        return f"{self.rows} rows x {self.tokens} tokens at {self.context} ({self.ms:g} ms)"


@dataclass(frozen=True, slots=True)
class StepRule:
    base_ms: float
    per_token_ms: float
    per_kv_token_ms: float

    def ms(self, new: int, read: int) -> float:
        return self.base_ms + self.per_token_ms * new + self.per_kv_token_ms * read

    @classmethod
    def fit(cls, cells: Sequence[StepCell]) -> "StepRule":
        """Least squares over the cells, a term that would come out negative left at 0."""
        features = np.array([[1.0, c.new, c.read] for c in cells])
        times = np.array([c.ms for c in cells])
        kept = [0, 1, 2]
        while True:
            solved, *_ = np.linalg.lstsq(features[:, kept], times, rcond=None)
            if (solved >= 0).all() or len(kept) == 1:
                break
            kept.pop(int(np.argmin(solved)))
        terms = [0.0, 0.0, 0.0]
        for index, value in zip(kept, solved):
            terms[index] = max(0.0, float(value))
        return cls(*(round(t, 9) for t in terms))


@dataclass(frozen=True, slots=True)
class StepProfile:
    name: str
    provenance: dict
    cells: tuple[StepCell, ...]
    rule: StepRule
    # what the file says of its GPU (verify_server.gpu_memory: the rest is derived from the
    # device's name and the model's shape)
    gpu: dict = field(default_factory=dict)

    def step_seconds(self, shape: Sequence[tuple[int, int]]) -> float:
        """The profile's time for a step of rows given as (context tokens, new tokens) each."""
        new = sum(tokens for _, tokens in shape)
        read = sum(context + tokens for context, tokens in shape)
        return self.rule.ms(new, read) / 1e3

    def worst_fit(self) -> float:
        """The largest relative gap between a cell and the rule (0.03: 3%)."""
        return max(abs(self.rule.ms(c.new, c.read) - c.ms) / c.ms for c in self.cells)

    def describe(self) -> str:
        """One line: what was measured, where and when."""
        p = self.provenance
        derived = "DERIVED, never measured: " if p.get("derived") else ""
        return (f"{self.name}: {derived}{p['model']} on {p['device']}, {p['engine']} "
                f"(torch {p['torch']}, transformers {p['transformers']}, {p['date']})")

    def to_json(self) -> dict:
        return {"sled_step_profile": FORMAT_VERSION, "name": self.name,
                "provenance": self.provenance, "cells": [asdict(c) for c in self.cells],
                "rule": asdict(self.rule), **({"gpu": self.gpu} if self.gpu else {})}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def make_profile(name: str, provenance: dict, cells: Sequence[StepCell],
                 gpu: dict | None = None) -> StepProfile:
    """A checked profile whose rule is fitted through `cells` (ValueError if they cannot be);
    `gpu`: what is known of the GPU's memory (GPU_FIELDS)."""
    cells = tuple(cells)
    _check_cells(name, cells)
    profile = StepProfile(name, dict(provenance), cells, StepRule.fit(cells),
                          _checked_gpu(name, gpu or {}))
    _check_provenance(profile)
    return profile


def shipped_profiles() -> list[str]:
    return sorted(path.stem for path in SHIPPED.glob("*.json"))


def load_profile(spec: str) -> StepProfile:
    """A shipped profile by name, or a profile file; ValueError (one line) if it is neither, or
    if it is not a usable profile."""
    path = SHIPPED / f"{spec}.json" if spec in shipped_profiles() else Path(spec)
    if not path.is_file():
        raise ValueError(f"unknown step profile {spec!r}: give a profile file or one of "
                         f"{', '.join(shipped_profiles())}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"step profile {path}: not readable JSON ({exc})") from None
    return parse_profile(data, str(path))


def parse_profile(data, where: str) -> StepProfile:
    if not isinstance(data, dict) or data.get("sled_step_profile") != FORMAT_VERSION:
        raise ValueError(f"step profile {where}: not a sled step profile (version "
                         f"{FORMAT_VERSION}: a \"sled_step_profile\": 1 key)")
    try:
        cells = tuple(StepCell(int(c["rows"]), int(c["tokens"]), int(c["context"]), float(c["ms"]))
                      for c in data["cells"])
        rule = StepRule(**{k: float(v) for k, v in data["rule"].items()})
        provenance = data.get("provenance") or {}
        if not isinstance(provenance, dict):
            raise TypeError("provenance must be a mapping of device, model, engine, ...")
        gpu = data.get("gpu") or {}
        if not isinstance(gpu, dict):
            raise TypeError(f"gpu must be a mapping of {', '.join(GPU_FIELDS)}")
        name = str(data["name"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"step profile {where}: needs name, cells (rows, tokens, context, ms) "
                         f"and rule (base_ms, per_token_ms, per_kv_token_ms): {exc}") from None
    profile = StepProfile(name, provenance, cells, rule, _checked_gpu(where, gpu))
    _check_cells(where, cells)
    _check_provenance(profile)
    if not all(math.isfinite(term) and term >= 0 for term in asdict(rule).values()):
        raise ValueError(f"step profile {where}: its rule has a negative term ({rule}): a larger "
                         "step would cost less")
    return profile


def _checked_gpu(where: str, gpu: dict) -> dict:
    """The gpu block's known fields, each a positive number; ValueError naming a bad one."""
    unknown = sorted(set(gpu) - set(GPU_FIELDS))
    if unknown:
        raise ValueError(f"step profile {where}: gpu has no field {', '.join(unknown)} (it takes "
                         f"{', '.join(GPU_FIELDS)})")
    for key, value in gpu.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not (math.isfinite(value) and value > 0):
            raise ValueError(f"step profile {where}: gpu {key} must be a positive number, "
                             f"not {value!r}")
    return dict(gpu)


def _check_cells(where: str, cells: tuple[StepCell, ...]) -> None:
    if not cells:
        raise ValueError(f"step profile {where}: no measured cells")
    for cell in cells:
        if not (math.isfinite(cell.ms) and cell.ms > 0) or min(cell.rows, cell.tokens) < 1 \
                or cell.context < 0:
            raise ValueError(f"step profile {where}: a cell of {cell} is not a step: times must "
                             "be positive, rows and tokens at least 1, context at least 0")
    for small in cells:
        for large in cells:
            if small.dominated_by(large) and large.ms < small.ms * (1 - NOISE):
                raise ValueError(f"step profile {where}: times are not monotonic: {large} is "
                                 f"faster than the smaller {small}")


def _check_provenance(profile: StepProfile) -> None:
    missing = [key for key in PROVENANCE if not str(profile.provenance.get(key, "")).strip()]
    if missing:
        raise ValueError(f"step profile {profile.name}: its provenance lacks {', '.join(missing)}: "
                         "a profile says which device, model, engine, versions, date and command "
                         "measured it")
