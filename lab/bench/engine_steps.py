"""The steps `sled bench engine` times, one kind at a time (verify_server.step_costs.KINDS), as
the server's scheduler builds their rows:

    verify   every session its last token and a k-token draft        Row(kv, [t, d1..dk], True)
    decode   every session one token                                 Row(kv, [t], True)
    sat      a verify row with m SAT slots appended (sdsat, and     Row(kv, [t, d1..dk], True,
             lookahead m)                                                sat_slots=m)
    prefill  a prompt chunk of N tokens at no context, no logits     Row(kv, chunk, False)

A group is the sessions one pool holds: the verify, decode and sat steps of (sessions, context)
run over the same KV, filled once; each prefill step (`--prefill 4x512`: four rows of 512 new
tokens) is a group of its own, at no context. Nothing a step writes is committed, so every
repetition runs the very same step.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from sled.wire.sampling import Sampling
from verify_server.acceptance import Proposal
from verify_server.engines.rows import Row
from verify_server.sdsat import SatSpec
from verify_server.step_costs import KINDS

GREEDY = Sampling()          # the sessions verify greedily
DRAFT_FROM = 5               # a draft's first token id (any: nothing is committed)


@dataclass(frozen=True, slots=True)
class StepSpec:
    """One timed step: `rows` sessions of `tokens` new tokens after `context` each, and the SAT
    slots a sat row appends."""
    kind: str
    rows: int
    tokens: int
    context: int
    sat_slots: int = 0

    @property
    def width(self) -> int:
        """Entries a row puts into the step (its tokens and its SAT slots)."""
        return self.tokens + self.sat_slots

    def step_rows(self, kvs) -> list[Row]:
        """The step's rows over the group's sessions (their first `rows`)."""
        tokens = list(range(DRAFT_FROM, DRAFT_FROM + self.tokens))
        return [Row(kv, tokens, self.kind != "prefill", sat_slots=self.sat_slots)
                for kv in kvs[:self.rows]]

    def proposals(self, rows: list[Row]) -> list[Proposal | None]:
        """What deciding each row takes: its draft (none for a prefill chunk)."""
        if self.kind == "prefill":
            return [None] * len(rows)
        return [Proposal(row.tokens[1:], GREEDY, lookahead=self.sat_slots) for row in rows]


@dataclass(frozen=True, slots=True)
class Group:
    """Sessions of `context` tokens in one pool, and the steps timed over them."""
    sessions: int
    context: int
    steps: tuple[StepSpec, ...]

    @property
    def width(self) -> int:
        """Room a session needs past its context: the widest step's row."""
        return max(step.width for step in self.steps)


def chunks(text: str) -> str:
    """A type= for --prefill: comma-separated ROWSxTOKENS, each at least 1 (the text is kept)."""
    for item in text.split(","):
        rows, sep, tokens = item.strip().partition("x")
        if not (sep and rows.isdigit() and tokens.isdigit() and int(rows) and int(tokens)):
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not ROWSxTOKENS, e.g. 4x512 "
                                             f"(in {text!r})")
    return text


def groups(kinds: list[str], sessions: list[int], contexts: list[int], draft_len: int,
           sat_slots: int, prefill: str) -> list[Group]:
    """The groups of a run, prefill chunks first, then every (sessions, context) with its
    verify, decode and sat steps, in the order of KINDS."""
    made = []
    if "prefill" in kinds:
        for item in prefill.split(","):
            rows, tokens = (int(n) for n in item.strip().split("x"))
            made.append(Group(rows, 0, (StepSpec("prefill", rows, tokens, 0),)))
    tokens = {"verify": draft_len + 1, "decode": 1, "sat": draft_len + 1}
    for n in sessions:
        for context in contexts:
            steps = tuple(StepSpec(kind, n, tokens[kind], context,
                                   sat_slots if kind == "sat" else 0)
                          for kind in KINDS if kind in kinds and kind != "prefill")
            if steps:
                made.append(Group(n, context, steps))
    return made


@torch.no_grad()
def sat_spec(model, slots: int) -> SatSpec:
    """SAT slots for a model that has none: the input embeddings of ids 1..slots (after the
    model's embedding scale), as an embeddings-only adapter holds them. Their guesses mean
    nothing; a step with them costs what a trained adapter's costs (no LoRA deltas)."""
    embed = model.get_input_embeddings()
    ids = torch.arange(1, slots + 1, device=embed.weight.device)
    return SatSpec(slots=slots, embeddings=embed(ids).detach().clone(),
                   source=f"ids 1..{slots} of the target's input embeddings")
