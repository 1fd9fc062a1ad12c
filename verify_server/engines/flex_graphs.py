"""How many step graphs the flex engine holds, and about how much device memory they take.

A captured bucket (`verify_server.engines.flex.CapturedStep`) keeps its outputs for itself: the
logits of every packed position [T, vocab] and their argmax [T], beside its plan's device buffer
(`flex_plan.StepLayout`). What a forward frees again goes back to the one memory pool the graphs
share, so that pool holds about one layer's activations of the largest bucket. The estimate is
the sum of those; the bound is the same over every bucket a server's steps can fall in
(`flex_plan.graphable_shapes`), reached only if every one of them is met.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from verify_server.engines.blocks import KVShape
from verify_server.engines.flex_plan import StepLayout, StepShape, graphable_shapes

MIB = 1 << 20
ARGMAX_BYTES = 8        # an int64 token id a packed position


@dataclass(frozen=True, slots=True)
class GraphMemory:
    graphs: int
    bytes: int

    def to_json(self) -> dict:
        return {"graphs": self.graphs, "graph_mib": round(self.bytes / MIB, 1)}

    def __str__(self) -> str:
        return f"{self.graphs} step graphs (about {self.bytes / MIB:,.0f} MiB)"


def estimate(model: torch.nn.Module, shapes: Iterable[StepShape], kv_width: int,
             num_blocks: int, kv_groups: int = 1) -> GraphMemory:
    """The memory the step graphs of these buckets hold: each one's outputs and plan buffer
    (a table per layer group of the pool), and one layer's activations of the largest (the
    shared pool)."""
    shapes = list(shapes)
    if not shapes:
        return GraphMemory(0, 0)
    kept, layer = _per_token(model)
    plans = sum(StepLayout(shape, kv_width, num_blocks, kv_groups).size * 4 for shape in shapes)
    tokens = [shape.tokens for shape in shapes]
    return GraphMemory(len(shapes), sum(tokens) * kept + plans + max(tokens) * layer)


def bound(model: torch.nn.Module, max_rows: int, max_step_tokens: int, kv_width: int,
          num_blocks: int, kv_groups: int = 1) -> GraphMemory:
    """The most graphs steps of up to `max_rows` rows and `max_step_tokens` tokens capture, and
    their memory (`estimate`)."""
    return estimate(model, graphable_shapes(max_rows, max_step_tokens), kv_width, num_blocks,
                    kv_groups)


def _per_token(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes a graph keeps a packed position: its logits and argmax, bytes of one layer's
    activations a position: norms, residual, q/k/v, attention out, gate, up, activation)."""
    config = model.config.get_text_config(decoder=True)
    item = model.get_output_embeddings().weight.element_size()
    kv = KVShape.of(model)
    per_layer = (4 * config.hidden_size
                 + (2 * config.num_attention_heads + 2 * kv.kv_heads) * kv.head_dim
                 + 3 * config.intermediate_size)
    return config.vocab_size * item + ARGMAX_BYTES, per_layer * item
