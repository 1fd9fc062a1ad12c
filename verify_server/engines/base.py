"""What every engine is: the owner of the block pool that runs one forward per scheduler step.

Sessions' keys/values live in the block pool (`blocks`). A forward writes each row's new tokens
into the slots after its session's committed length and leaves that length alone: what a round
keeps is committed afterwards (`SessionKV.commit`), the rest is overwritten by the next forward.
A forward returns the step's logits (`StepLogits`): those of every row that wants them, packed,
for `acceptance.decide` to decide the whole step from.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from verify_server.engines import decoder
from verify_server.engines.blocks import BlockPool
from verify_server.engines.kv import SessionKV
from verify_server.engines.rows import Row
from verify_server.sdsat import SatSpec

# The engines --engine names ("auto" picks one of the others for the model and device).
ENGINES = ("auto", "paged", "flex", "padded")


@dataclass(slots=True)
class StepLogits:
    """A step's logits: every position of the rows that want them, packed in the model's
    dtype on the engine's device, each row's slice of them, and their argmax when the step
    already computed it (a captured step does). Indexing gives one row's logits as a float32
    copy [row.width, vocab] (None for a row without logits), as a list of them would."""
    packed: torch.Tensor               # [K, vocab]
    spans: list[slice | None]          # row b's positions in `packed`
    argmax: torch.Tensor | None = None  # [K], or None: computed on demand
    host_argmax: torch.Tensor | None = None   # the argmax's copy on its way to the host
    copied: torch.cuda.Event | None = None    # when that copy is done (CUDA)

    def row(self, b: int) -> torch.Tensor | None:
        """Row b's logits [width, vocab], a view (valid until the engine's next step)."""
        span = self.spans[b]
        return None if span is None else self.packed[span]

    def targets(self) -> list[int]:
        """The argmax of every packed position: one reduction, one copy to the host (started
        at launch, `send_argmax`, where the step was launched ahead of its decision)."""
        if self.host_argmax is not None:
            if self.copied is not None:
                self.copied.synchronize()
            return self.host_argmax.tolist()
        argmax = self.packed.argmax(-1) if self.argmax is None else self.argmax
        return argmax.tolist()

    def send_argmax(self) -> None:
        """Start the argmax's copy to the host now, behind the step's kernels and ahead of
        whatever the device runs next (pinned memory, no wait on CUDA)."""
        argmax = self.packed.argmax(-1) if self.argmax is None else self.argmax
        if argmax.device.type != "cuda":
            self.host_argmax = argmax.clone()
            return
        self.host_argmax = torch.empty(argmax.shape, dtype=argmax.dtype, pin_memory=True)
        self.host_argmax.copy_(argmax, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, b: int) -> torch.Tensor | None:
        logits = self.row(b)
        return None if logits is None else logits.to(torch.float32, copy=True)

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        return (self[b] for b in range(len(self)))


def logit_spans(rows: Sequence[Row]) -> tuple[list[int], list[slice | None]]:
    """Packed positions whose logits are needed, and each row's slice of them."""
    index, spans, offset, kept = [], [], 0, 0
    for row in rows:
        n = row.width
        if row.want_logits:
            index.extend(range(offset, offset + n))
            spans.append(slice(kept, kept + n))
            kept += n
        else:
            spans.append(None)
        offset += n
    return index or [offset - 1], spans


FORWARDS = ("sled", "transformers")


class Engine:
    """Owns the block pool and runs one forward per scheduler step.

    `forward`: "sled" runs sled's own decoder forward (`decoder.Decoder`: fused weights, compiled
    layer functions on CUDA) where it covers the model, transformers' forward elsewhere and for
    passes with SAT LoRA deltas; "transformers" always runs transformers' forward."""

    kind = "base"
    launches_ahead = False   # whether `launch` returns before the step's kernels end (CUDA)
    branches = False     # whether rows may branch: SAT blocks (Row.sat_anchors), trees (Row.parents)
    own_forward = False  # whether the engine can run sled's decoder forward (its attention does)

    def __init__(self, model: torch.nn.Module, pool: BlockPool, sat: SatSpec | None = None,
                 forward: str = "sled") -> None:
        if forward not in FORWARDS:
            raise ValueError(f"unknown forward {forward!r}: use {' or '.join(FORWARDS)}")
        self.model = model
        self.pool = pool
        self.sat = sat          # the target's semantic adaptive tokens, if it has them
        self.device = next(model.parameters()).device
        self.bytes_copied = 0   # KV bytes written or copied outside attention, ever
        self.sled_forward = forward == "sled" and self.own_forward and decoder.supports(model)
        if sat is not None and sat.lora is not None:
            sat.lora.attach(model)   # its deltas act only inside `_sat_deltas`
        self.compile_layers = self.device.type == "cuda"   # the decoder's layer functions
        self.decoder = decoder.decoder_for(model) if self.sled_forward else None  # fused now

    def warm_up(self, max_rows: int, max_step_tokens: int) -> None:
        """Before serving: compile or capture what the first steps of up to `max_rows` rows and
        `max_step_tokens` tokens would otherwise pay for inside a request (nothing, here)."""

    def close(self) -> None:
        """After the last step: let go of what the engine holds beyond its pool (a split
        server's other ranks, engines.sharded; nothing, here)."""

    def _fresh_decoder(self) -> None:
        """Before a step: fuse again if the model's weights were replaced since (moved, cast)."""
        if self.decoder is not None and not self.decoder.fresh():
            self.decoder = decoder.decoder_for(self.model)

    def _logits(self, sat_deltas: bool = False, **inputs) -> torch.Tensor:
        """The model's logits [1, kept, vocab] for one step's inputs: sled's decoder forward, or
        transformers' (asked for, not covered, or a pass that applies SAT LoRA deltas, which
        hook transformers' modules)."""
        if self.decoder is not None and not (sat_deltas and self.sat is not None
                                             and self.sat.lora is not None):
            return self.decoder(compiled=self.compile_layers, **inputs)
        return self.model(**inputs).logits

    def _sat_deltas(self, flat_positions: list[int]):
        """The pass inside applies the SAT LoRA deltas at these positions of the flattened input
        (a no-op context when the target's SATs have no deltas)."""
        if self.sat is None or self.sat.lora is None:
            return nullcontext()
        return self.sat.lora.at(torch.tensor(flat_positions, dtype=torch.long, device=self.device))

    def _inputs(self, input_ids: torch.Tensor, sat_at: list[tuple[tuple[int, ...], int]]) -> dict:
        """Model inputs: plain ids, or embeddings with SAT slots written in at `sat_at`
        (index into input_ids, slot number) when a row asked for SATs."""
        input_ids = input_ids.to(self.device)
        if not sat_at:
            return {"input_ids": input_ids}
        if self.sat is None:
            raise RuntimeError("SAT slots requested but the target has no SATs")
        embeds = self.model.get_input_embeddings()(input_ids)
        slots = self.sat.slot_embeddings(self.model, max(slot for _, slot in sat_at) + 1)
        for index, slot in sat_at:
            embeds[index] = slots[slot].to(embeds.dtype)
        return {"inputs_embeds": embeds}

    def new_kv(self) -> SessionKV:
        return SessionKV(self.pool)

    def activate(self) -> None:
        """Route the model's attention to this engine (engines that share one model object, as
        a benchmark's do, take turns)."""

    def forward(self, rows: Sequence[Row]) -> StepLogits:
        """One pass over all rows: the logits of the rows that want them. Each row's KV is
        written after kv.length; no row's length changes."""
        raise NotImplementedError

    def launch(self, rows: Sequence[Row], send_argmax: bool = False) -> StepLogits:
        """The forward of a step whose decision may come after the next step is launched (the
        scheduler's overlap: only a step decided from its argmax alone); `send_argmax`: its
        argmax starts on its way to the host right behind the step's kernels, before the next
        step's, so that the decision waits for this step alone."""
        logits = self.forward(rows)
        if send_argmax:
            logits.send_argmax()
        return logits


# Passed as the attention mask inside a step: transformers returns a 4D mask as-is, so no
# [tokens, tokens] mask is built; the engine's attention function builds what it needs.
NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)
