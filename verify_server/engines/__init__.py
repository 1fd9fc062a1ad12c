"""The engines: one batched forward per scheduler step over the KV block pool.

    rows.py        Row: one session's new entries in a step
    visibility.py  what each new entry attends to (chains, trees, SAT blocks, windows)
    blocks.py      the block pool: every session's keys/values, blocks, prefix sharing
    kv.py          SessionKV: one session's block table, length and reservation
    base.py        Engine and StepLogits: what every engine is and returns
    decoder.py     sled's own forward for Llama and Gemma 3: fused weights, compiled layers
    paged.py       PagedEngine: packed rows, dense masks per group (the CPU default)
    padded.py      PaddedEngine: a left-padded transformers cache (any decoder, chains only)
    flex.py        FlexEngine: FlexAttention over the pool in static shapes, CUDA graphs
    flex_plan.py   the flex engine's step plan, made in numpy
    flex_check.py  the start-up probe of a compiled CPU flex kernel
    emulated.py    EmulatedEngine: an engine held to a step-cost profile's time
    sharded.py     a server split over ranks (--tp N): rank 0's engine telling the others each step
    step_messages.py  those steps' messages, and their wire: int64 tensors of a fixed layout
    step_checks.py    what another rank takes of them: each checked against its own limits

`make_engine` sizes the pool and picks the engine.
"""
from __future__ import annotations

import torch

from verify_server.engines.base import ENGINES, Engine
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server.engines.flex import FlexEngine, serving_flex
from verify_server.engines.padded import PaddedEngine
from verify_server.engines.paged import PagedEngine
from verify_server.sdsat import SatSpec


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("cannot read available memory from /proc/meminfo")


def make_engine(model: torch.nn.Module, *, kv_budget_bytes: int | None = None,
                kv_fraction: float = 0.25, block_tokens: int = 16, kind: str = "auto",
                sat: SatSpec | None = None, flex_splits: str = "torch", windows: bool = True,
                row_tokens: int | None = None) -> Engine:
    """An engine over a pool of `kv_budget_bytes` (default: `kv_fraction` of free memory);
    `sat`: the target's SATs, for rows that append SAT slots; `flex_splits`: how the flex
    engine's decode kernel splits a row (engines.flex_kernels). For a model split over ranks (its
    tp_size) this is one rank's engine; the budget counts the whole server (every GPU gives
    `kv_fraction` of its free memory) and each rank's pool holds its own KV heads of it.

    `windows`: a model's sliding-window layers keep only their window of KV (blocks.KVShape;
    not in the padded engine, nor split over ranks); `row_tokens`: the most entries a step gives
    one row (the scheduler's max_step_tokens), which bounds what a windowed layer group holds."""
    device = next(model.parameters()).device
    if kind not in ENGINES:
        raise ValueError(f"unknown engine kind {kind!r}: use {', '.join(ENGINES)}")
    if kind == "auto":
        kind = auto_kind(model, device)
    shape = KVShape.of(model, windowed=windows and kind != "padded")
    budget = kv_budget_bytes if kv_budget_bytes is not None else int(
        free_memory_bytes(device) * kv_fraction * (shape.shards if device.type == "cuda" else 1))
    # Block 0 is the zero block that padding reads; it is never handed to a session.
    blocks = budget // (block_tokens * shape.slot_bytes)
    if blocks < 2:
        raise ValueError(f"KV budget {budget} bytes holds less than one block of {block_tokens} tokens "
                         f"({block_tokens * shape.slot_bytes} bytes)")
    pool = BlockPool(shape, blocks, block_tokens, device, row_tokens)
    if kind == "padded" and shape.shards > 1:
        raise ValueError("the padded engine cannot serve a model split over ranks (--tp): use "
                         "--engine paged or flex, on a model with transformers' attention interface")
    if kind == "flex":
        return FlexEngine(model, pool, sat, flex=serving_flex(pool), splits=flex_splits)
    return {"paged": PagedEngine, "padded": PaddedEngine}[kind](model, pool, sat)



def auto_kind(model: torch.nn.Module, device: torch.device) -> str:
    """flex on CUDA, paged on CPU, padded for a model without transformers' attention interface."""
    if not PagedEngine.supports(model):
        return "padded"
    return "flex" if device.type == "cuda" else "paged"
