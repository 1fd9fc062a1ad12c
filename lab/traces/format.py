"""A recorded drafter: what a real drafter proposed at every position of the target's greedy
output, so many emulated devices can draft without running a model (lab.traces.replay).

Under greedy decoding a device's context is always prompt + a prefix of the target's output, so
one proposal per position is everything the drafter could ever be asked for. Example: target
output [5, 6, 7], max_draft_len 2 -> proposals[0] drafts after the prompt, proposals[2] after
prompt + [5, 6].

File format (JSONL): a header line {"sled_traces": 1, "target", "drafter", "max_draft_len",
"tokenizer_fingerprint"}, then one trace per line {"prompt_ids", "target_ids", "proposals",
"draft_ms_per_token"} and, when the drafter reports them, "confidences" (the drafter's
probability of each proposed token, shaped like "proposals"), which lets a replay stop a draft
early the way the drafter would have. Files without confidences load and replay as before, and
so do files whose header says "max_k" (the name of max_draft_len before).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FORMAT_VERSION = 1


@dataclass(slots=True)
class Trace:
    prompt_ids: list[int]
    target_ids: list[int]                 # the target's greedy output for the prompt
    proposals: list[list[int]]            # [len(target_ids)] of [<= max_draft_len]: drafts after each prefix
    draft_ms_per_token: float = 0.0       # measured while recording, on the recording machine
    drafter: str = ""
    tokenizer_fingerprint: str | None = None
    # [len(target_ids)] of [len(proposals[i])]: the drafter's confidence in each proposed token,
    # or None when the drafter reported none
    confidences: list[list[float]] | None = None

    def __post_init__(self) -> None:
        if len(self.proposals) != len(self.target_ids):
            raise ValueError(f"a trace needs one proposal per target token: {len(self.proposals)} "
                             f"proposals for {len(self.target_ids)} tokens")
        if self.confidences is not None and \
                list(map(len, self.confidences)) != list(map(len, self.proposals)):
            raise ValueError("a trace's confidences must match its proposals, one per token")


@dataclass(slots=True)
class TraceSet:
    """Traces recorded with one drafter against one target."""
    target: str
    drafter: str
    max_draft_len: int
    traces: list[Trace] = field(default_factory=list)
    tokenizer_fingerprint: str | None = None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {"sled_traces": FORMAT_VERSION, "target": self.target, "drafter": self.drafter,
                  "max_draft_len": self.max_draft_len, "tokenizer_fingerprint": self.tokenizer_fingerprint}
        lines = [json.dumps(header)] + [json.dumps(_row(t)) for t in self.traces]
        path.write_text("\n".join(lines) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "TraceSet":
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
        header = json.loads(lines[0]) if lines else {}
        if header.get("sled_traces") != FORMAT_VERSION:
            raise ValueError(f"{path} is not a sled trace file (version {FORMAT_VERSION} header expected)")
        fingerprint = header.get("tokenizer_fingerprint")
        traces = [Trace(prompt_ids=row["prompt_ids"], target_ids=row["target_ids"],
                        proposals=row["proposals"], draft_ms_per_token=row.get("draft_ms_per_token", 0.0),
                        drafter=header["drafter"], tokenizer_fingerprint=fingerprint,
                        confidences=row.get("confidences"))
                  for row in map(json.loads, lines[1:])]
        max_draft_len = header.get("max_draft_len", header.get("max_k"))
        if max_draft_len is None:
            raise KeyError("max_draft_len")
        return cls(target=header["target"], drafter=header["drafter"],
                   max_draft_len=max_draft_len, traces=traces, tokenizer_fingerprint=fingerprint)


def _row(trace: Trace) -> dict:
    """One trace as a JSONL row; confidences only when there are any (older readers ignore it)."""
    row = {"prompt_ids": trace.prompt_ids, "target_ids": trace.target_ids,
           "proposals": trace.proposals, "draft_ms_per_token": trace.draft_ms_per_token}
    if trace.confidences is not None:
        row["confidences"] = trace.confidences
    return row
