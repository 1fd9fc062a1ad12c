"""Step-cost profiles: how long one server step takes on a GPU and model that are not here, so a
server on any machine can be held to that GPU's pace (`sled serve --emulate PROFILE`).

A profile is a small JSON file: the steps measured on one GPU with one model shape, the rules
fitted through them, the floor that GPU puts under every step, and where the measurements come
from.

    {"sled_step_profile": 1, "name": "h100-llama8b-hf-graph",
     "provenance": {"device": "NVIDIA H100 80GB HBM3", "model": "llama-8b", "dtype": "bfloat16",
                    "engine": "...", "torch": "2.11.0+cu130", "transformers": "5.17.0",
                    "date": "2026-11-23", "command": "..."},
     "cells": [{"rows": 16, "tokens": 5, "context": 512, "ms": 17.3, "kind": "verify"}, ...],
     "rule": {"base_ms": 9.54, "per_token_ms": 0.0254, "per_kv_token_ms": 0.00072},
     "rules": {"prefill": {...}, "sat": {...}},
     "floor": {"bandwidth": 3.35e12, "peak_flops": 9.894e14, "weight_bytes": ...,
               "kv_bytes_per_token": 131072, "flops_per_token": ...}}

A cell is a step of `rows` sessions, each feeding `tokens` new entries after `context` tokens of
KV, and its kind: `prefill` (prompt chunks, no logits), `verify` (a draft and the token before
it), `decode` (one token) or `sat` (a verify row with SAT slots appended; `tokens` counts the
slots). A rule gives any step's time from two sums over its rows: the new entries (the weights'
work per token) and the KV tokens read (every row's context and new entries):

    ms = base_ms + per_token_ms * new + per_kv_token_ms * read

16 rows x 5 tokens at 512: new = 80, read = 16 x 517 = 8272, so 9.54 + 2.03 + 5.96 = 17.5 ms.
A rule is fitted by least squares with no negative term, so a larger step never costs less.

`rule` is fitted over the verify and decode cells (one row of 1 token and one of 5 fill the same
bucket; on a GPU both are replayed from a CUDA graph). A prefill chunk or SAT slots make a step
of another kind (on a GPU: run eagerly), and a profile that measured that kind keeps its own rule
for it in `rules`, fitted over those cells with the KV term of `rule` (the KV a step reads costs
the same whatever its kind). A step is charged the largest of `rule` and the rules of the kinds
its rows are, and never less than the floor: max(bytes / bandwidth, FLOPs / peak) on the
profile's GPU (verify_server.roofline), where the bytes are the streamed weights and the KV read,
and the FLOPs 2 x the streamed parameters a new entry. Where the fitted rules alone would charge
under the floor (the profile's cells, a prefill chunk of any length up to PROBED_CHUNK tokens),
the profile says so in `floored`. A file without a kind on its cells reads a 1-token cell as
decode and any other as verify; one without a floor block has no floor.

A profile may also say what its GPU holds (`"gpu": {"memory_bytes": ..., "weight_bytes": ...,
"kv_bytes_per_token": ..., "tdp_watts": ...}`), so that a server held to it admits only the
sessions whose KV that GPU would hold (verify_server.gpu_memory derives what the block leaves out).

A profile whose provenance says `"published": true` holds what an engine's publications say of
its steps, not a measurement (`sled bench publish-profile`, lab.bench.publish): it loads only
with a `source` naming them, and shows as PUBLISHED wherever it is described (as DERIVED marks
a roofline scaled by a measured profile; both for figures published on another GPU).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
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
# The kinds of step a cell measures; verify and decode share the profile's `rule`, the others
# may have their own
KINDS = ("prefill", "verify", "decode", "sat")
SHARED = ("verify", "decode")
# The longest prefill chunk the floor check probes: four times the server's default step budget
PROBED_CHUNK = 8192


def default_kind(tokens: int) -> str:
    """The kind of a cell or row that names none: one token decodes, more verify."""
    return "decode" if tokens == 1 else "verify"


def row_kind(row) -> str:
    """The kind of an engine row (verify_server.engines.rows.Row): a prefill chunk wants no
    logits, SAT slots make a sat row, one token decodes, more verify."""
    if not row.want_logits:
        return "prefill"
    return "sat" if row.sat_slots else default_kind(row.width)


@dataclass(frozen=True, slots=True)
class StepCell:
    """One measured step: `rows` sessions of `tokens` new entries after `context` each."""
    rows: int
    tokens: int
    context: int
    ms: float
    kind: str = ""      # one of KINDS; "" reads as default_kind(tokens)

    def __post_init__(self) -> None:
        if not self.kind:
            object.__setattr__(self, "kind", default_kind(self.tokens))

    @property
    def new(self) -> int:
        return self.rows * self.tokens

    @property
    def read(self) -> int:
        return self.rows * (self.context + self.tokens)

    def dominated_by(self, other: "StepCell") -> bool:
        """Whether `other` is a step of the same kind at least as large in every respect, and
        larger in one (steps of two kinds can fill one bucket: they are not compared)."""
        mine = (self.rows, self.tokens, self.context)
        theirs = (other.rows, other.tokens, other.context)
        return self.kind == other.kind and mine != theirs and \
            all(a <= b for a, b in zip(mine, theirs))

    def __str__(self) -> str:
        return (f"{self.rows} rows x {self.tokens} tokens at {self.context} ({self.kind}, "
                f"{self.ms:g} ms)")


@dataclass(frozen=True, slots=True)
class StepRule:
    base_ms: float
    per_token_ms: float
    per_kv_token_ms: float

    def ms(self, new: int, read: int) -> float:
        return self.base_ms + self.per_token_ms * new + self.per_kv_token_ms * read

    @classmethod
    def fit(cls, cells: Sequence[StepCell], per_kv_token_ms: float | None = None) -> "StepRule":
        """Least squares over the cells, a term that would come out negative left at 0;
        `per_kv_token_ms` given: that KV term, the other two fitted to what it leaves."""
        features = np.array([[1.0, c.new, c.read] for c in cells])
        times = np.array([c.ms for c in cells])
        if per_kv_token_ms is None:
            return cls(*_rounded(_nonnegative_fit(features, times)))
        left = times - per_kv_token_ms * features[:, 2]
        base, per_token = _nonnegative_fit(features[:, :2], left)
        return cls(*_rounded([base, per_token]), per_kv_token_ms)


def _nonnegative_fit(features: np.ndarray, times: np.ndarray) -> list[float]:
    """Least squares with every term at least 0: the most negative term is dropped and the
    rest fitted again, until none is negative."""
    kept = list(range(features.shape[1]))
    while True:
        solved, *_ = np.linalg.lstsq(features[:, kept], times, rcond=None)
        if (solved >= 0).all() or len(kept) == 1:
            break
        kept.pop(int(np.argmin(solved)))
    terms = [0.0] * features.shape[1]
    for index, value in zip(kept, solved):
        terms[index] = max(0.0, float(value))
    return terms


def _rounded(terms: Iterable[float]) -> list[float]:
    return [round(t, 9) for t in terms]


def fit_rules(cells: Sequence[StepCell]) -> tuple[StepRule, dict[str, StepRule]]:
    """The profile's rule (over its verify and decode cells, or every cell where it has none)
    and a rule of each other kind it measured, with the rule's KV term."""
    shared = [c for c in cells if c.kind in SHARED] or list(cells)
    rule = StepRule.fit(shared)
    own = {}
    for kind in KINDS:
        mine = [c for c in cells if c.kind == kind]
        if kind not in SHARED and mine and len(mine) < len(cells):
            own[kind] = StepRule.fit(mine, per_kv_token_ms=rule.per_kv_token_ms)
    return rule, own


@dataclass(frozen=True, slots=True)
class StepFloor:
    """The least a step can cost on the profile's GPU (verify_server.roofline): the streamed
    weights and the KV read over the bandwidth, or 2 x streamed parameters a new entry over the
    peak FLOP/s, the larger."""
    bandwidth: float                # bytes/s
    weight_bytes: int               # weights every step streams (all but the input embeddings)
    kv_bytes_per_token: int
    flops_per_token: float          # 2 x the streamed parameters
    peak_flops: float | None = None    # dense FLOP/s in the weights' dtype (None: bytes alone)
    source: str = ""

    def terms(self, new: int, read: int) -> tuple[float, float]:
        """(ms of its bytes, ms of its FLOPs; 0 without a peak)."""
        bytes_ms = (self.weight_bytes + read * self.kv_bytes_per_token) / self.bandwidth * 1e3
        flops_ms = self.flops_per_token * new / self.peak_flops * 1e3 if self.peak_flops else 0.0
        return bytes_ms, flops_ms

    def ms(self, new: int, read: int) -> float:
        return max(self.terms(new, read))

    def to_json(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value not in (None, "")}

    @classmethod
    def from_json(cls, data: dict, where: str) -> "StepFloor":
        """A floor block; ValueError naming what is wrong with it."""
        numbers = ("bandwidth", "weight_bytes", "kv_bytes_per_token", "flops_per_token",
                   "peak_flops")
        unknown = sorted(set(data) - {*numbers, "source"})
        if unknown:
            raise ValueError(f"step profile {where}: floor has no field {', '.join(unknown)}")
        for key in numbers:
            value = data.get(key)
            if value is None and key == "peak_flops":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not (math.isfinite(value) and value > 0):
                raise ValueError(f"step profile {where}: floor {key} must be a positive number, "
                                 f"not {value!r}")
        return cls(float(data["bandwidth"]), int(data["weight_bytes"]),
                   int(data["kv_bytes_per_token"]), float(data["flops_per_token"]),
                   None if data.get("peak_flops") is None else float(data["peak_flops"]),
                   str(data.get("source", "")))


@dataclass(frozen=True, slots=True)
class StepProfile:
    name: str
    provenance: dict
    cells: tuple[StepCell, ...]
    rule: StepRule
    # what the file says of its GPU (verify_server.gpu_memory: the rest is derived from the
    # device's name and the model's shape)
    gpu: dict = field(default_factory=dict)
    rules: dict = field(default_factory=dict)     # kind -> StepRule, for kinds beside `rule`'s
    floor: StepFloor | None = None
    floored: tuple[str, ...] = ()                 # where the rules alone fall under the floor

    def step_seconds(self, shape: Sequence[tuple]) -> float:
        """The profile's time for a step of rows given as (context tokens, new entries) or
        (context tokens, new entries, kind) each."""
        new = sum(row[1] for row in shape)
        read = sum(row[0] + row[1] for row in shape)
        kinds = {row[2] if len(row) > 2 else default_kind(row[1]) for row in shape}
        return self.step_ms(new, read, kinds) / 1e3

    def step_ms(self, new: int, read: int, kinds: Iterable[str] = ("verify",)) -> float:
        """A step's ms: the largest of the rule and its kinds' own rules, at least the floor."""
        return max(self.fitted_ms(new, read, kinds),
                   self.floor.ms(new, read) if self.floor is not None else 0.0)

    def fitted_ms(self, new: int, read: int, kinds: Iterable[str] = ("verify",)) -> float:
        """What the rules alone charge (no floor)."""
        return max([self.rule.ms(new, read)] +
                   [self.rules[kind].ms(new, read) for kind in kinds if kind in self.rules])

    def with_prefill_of(self, other: "StepProfile") -> "StepProfile":
        """This profile with its prefill chunks charged by `other`'s prefill rule (its rule
        where it has none), never under this one's own rule or floor: prefill is the same work
        whichever mode serves a session, so two profiles compared may charge it alike (say, a
        published engine's where this one measured no prefill). Its name and provenance say
        so; itself where `other` is this profile."""
        if other.name == self.name:
            return self
        return replace(self, name=f"{self.name}+prefill-of-{other.name}",
                       provenance={**self.provenance, "prefill": f"prefill chunks charged as "
                                   f"{other.title} charges them"},
                       rules={**self.rules, "prefill": other.rules.get("prefill", other.rule)})

    def worst_fit(self) -> float:
        """The largest relative gap between a cell and what the profile charges (0.03: 3%)."""
        return max(abs(self.step_ms(c.new, c.read, (c.kind,)) - c.ms) / c.ms for c in self.cells)

    @property
    def label(self) -> str:
        """What the profile is when it is not a measurement of sled's: "PUBLISHED" (its cells
        from an engine's published figures), "PUBLISHED, DERIVED for this GPU" (published on
        another GPU, moved to this one), "DERIVED, never measured" (a roofline scaled by a
        measured profile); "" for a measured one."""
        published, derived = self.provenance.get("published"), self.provenance.get("derived")
        if published:
            return "PUBLISHED, DERIVED for this GPU" if derived else "PUBLISHED"
        return "DERIVED, never measured" if derived else ""

    @property
    def title(self) -> str:
        """Its name, with its label where it has one: "NAME (PUBLISHED)"."""
        return f"{self.name} ({self.label})" if self.label else self.name

    def describe(self) -> str:
        """One line: what was measured (or published, or derived), where and when."""
        p = self.provenance
        label = f"{self.label}: " if self.label else ""
        return (f"{self.name}: {label}{p['model']} on {p['device']}, {p['engine']} "
                f"(torch {p['torch']}, transformers {p['transformers']}, {p['date']})")

    def to_json(self) -> dict:
        return {"sled_step_profile": FORMAT_VERSION, "name": self.name,
                "provenance": self.provenance, "cells": [asdict(c) for c in self.cells],
                "rule": asdict(self.rule),
                **({"rules": {k: asdict(r) for k, r in self.rules.items()}} if self.rules else {}),
                **({"gpu": self.gpu} if self.gpu else {}),
                **({"floor": self.floor.to_json()} if self.floor is not None else {}),
                **({"floored": list(self.floored)} if self.floored else {})}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def make_profile(name: str, provenance: dict, cells: Sequence[StepCell],
                 gpu: dict | None = None, floor: StepFloor | None = None) -> StepProfile:
    """A checked profile whose rules are fitted through `cells` (ValueError if they cannot be);
    `gpu`: what is known of the GPU's memory (GPU_FIELDS); `floor`: the least a step costs
    there. Where the rules fall under the floor it says so (`floored`)."""
    cells = tuple(cells)
    _check_cells(name, cells)
    rule, rules = fit_rules(cells)
    profile = StepProfile(name, dict(provenance), cells, rule, _checked_gpu(name, gpu or {}),
                          rules, floor)
    _check_provenance(profile)
    return replace(profile, floored=tuple(under_floor(profile)))


def under_floor(profile: StepProfile) -> list[str]:
    """Where the profile's rules alone charge less than its floor: its cells' steps, and a
    prefill chunk at no context of each length up to PROBED_CHUNK (one phrase for the run of
    lengths)."""
    if profile.floor is None:
        return []
    below = [str(c) for c in profile.cells
             if profile.fitted_ms(c.new, c.read, (c.kind,)) < profile.floor.ms(c.new, c.read)]
    chunks = [n for n in range(1, PROBED_CHUNK + 1)
              if profile.fitted_ms(n, n, ("prefill",)) < profile.floor.ms(n, n)]
    if chunks:
        below.append(f"prefill chunks of {chunks[0]}-{chunks[-1]} tokens at no context" if
                     len(chunks) > 1 else f"a prefill chunk of {chunks[0]} tokens at no context")
    return below


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
        cells = tuple(StepCell(int(c["rows"]), int(c["tokens"]), int(c["context"]), float(c["ms"]),
                               str(c.get("kind", ""))) for c in data["cells"])
        rule = _rule(data["rule"])
        rules = {str(kind): _rule(r) for kind, r in (data.get("rules") or {}).items()}
        provenance = data.get("provenance") or {}
        if not isinstance(provenance, dict):
            raise TypeError("provenance must be a mapping of device, model, engine, ...")
        gpu = data.get("gpu") or {}
        if not isinstance(gpu, dict):
            raise TypeError(f"gpu must be a mapping of {', '.join(GPU_FIELDS)}")
        floor = data.get("floor")
        if floor is not None and not isinstance(floor, dict):
            raise TypeError("floor must be a mapping of bandwidth, weight_bytes, ...")
        floored = tuple(str(note) for note in data.get("floored") or ())
        name = str(data["name"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"step profile {where}: needs name, cells (rows, tokens, context, ms) "
                         f"and rule (base_ms, per_token_ms, per_kv_token_ms): {exc}") from None
    profile = StepProfile(name, provenance, cells, rule, _checked_gpu(where, gpu), rules,
                          None if floor is None else StepFloor.from_json(floor, where), floored)
    _check_cells(where, cells)
    _check_provenance(profile)
    for kind, checked in {"": rule, **rules}.items():
        if kind and kind not in KINDS:
            raise ValueError(f"step profile {where}: a rule for {kind!r}, which is no kind of "
                             f"step ({', '.join(KINDS)})")
        if not all(math.isfinite(term) and term >= 0 for term in asdict(checked).values()):
            raise ValueError(f"step profile {where}: its rule has a negative term ({checked}): a "
                             "larger step would cost less")
    return profile


def _rule(data) -> StepRule:
    return StepRule(**{k: float(v) for k, v in data.items()})


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
        if cell.kind not in KINDS:
            raise ValueError(f"step profile {where}: a cell of {cell}: its kind is one of "
                             f"{', '.join(KINDS)}")
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
    if profile.provenance.get("published") and \
            not str(profile.provenance.get("source", "")).strip():
        raise ValueError(f"step profile {profile.name}: it says it is published but names no "
                         "source: a published profile says which publication, setup and figures "
                         "its cells come from")
