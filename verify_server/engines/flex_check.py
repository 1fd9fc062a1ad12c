"""A compiled flex attention is checked before it serves: on the engine's own attention shape,
against eager flex over the same plan (eager flex is checked against the paged engine by the
tests). A compiled kernel that disagrees is refused, never loosened.

Why: torch's CPU flex template (torch 2.13.0 and earlier) is wrong under AVX2 code. Its QK^T
micro-GEMM (`CppMicroGemmFP32Vec`, transposed B) takes a fast path whenever K and N are multiples
of the vector width and K < 24, and that path computes BLOCK_N = 16 columns even when the tail N
is shorter: with 8-float vectors (AVX2), 8-token KV blocks and head_dim 8 or 16 it reads keys
past the block and writes scores past the row (seen as errors of 0.03-2, NaN at times). With
16-float vectors (AVX-512) a tail N is never a multiple of the width, so that path is never
taken. The smallest case, with AVX2 code forced on any x86 CPU:

    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    torch._inductor.config.cpp.simdlen = 256
    q, k, v = torch.randn(1, 1, 8, 16), torch.randn(1, 1, 64, 16), torch.randn(1, 1, 64, 16)
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, 1, 1, 8, 64,
                             device="cpu", BLOCK_SIZE=(128, 8))
    got = torch.compile(flex_attention)(q, k, v, block_mask=mask)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    print((got - want).abs().max())    # about 1 with simdlen 256, 1e-7 with 512

The check is general, not a list of known bugs: whatever a compiled kernel gets wrong at the
shapes it will serve shows here, once per process and attention shape.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._inductor.cpu_vec_isa import pick_vec_isa

from verify_server.engines.blocks import KVShape

# How far the compiled output may be from the eager one: the engines' equality tests' bound in
# fp32; low precision rounds each partial sum.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}
LOW_PRECISION_TOLERANCE = 2e-2


class CompiledFlexRefused(ValueError):
    """A compiled flex attention disagrees with eager flex on this machine."""


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """What a compiled flex kernel is specialised on, besides the step's bucket."""
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_tokens: int
    window: int | None = None
    softcap: float | None = None

    @classmethod
    def all_of(cls, model: torch.nn.Module, block_tokens: int) -> list["AttentionShape"]:
        """The model's attention shapes: full layers, and windowed ones where it has them."""
        config = model.config.get_text_config(decoder=True)
        kv = KVShape.of(model)
        softcap = getattr(config, "attn_logit_softcapping", None)
        window = getattr(config, "sliding_window", None)
        return [cls(config.num_attention_heads, kv.kv_heads, kv.head_dim, kv.dtype, block_tokens,
                    w, softcap) for w in dict.fromkeys((None, window))]

    def describe(self) -> str:
        return (f"head_dim {self.head_dim}, {self.heads}/{self.kv_heads} heads, "
                f"{self.block_tokens}-token KV blocks, {str(self.dtype).removeprefix('torch.')}"
                + (f", window {self.window}" if self.window else "")
                + (f", softcap {self.softcap:g}" if self.softcap else ""))


def vector_code() -> str:
    """The vector instruction set inductor compiles CPU kernels for now (e.g. "avx2")."""
    isa = pick_vec_isa()
    return str(isa) if isa else "no vectors"


def refuse_if_unsound(probe: Callable[[AttentionShape], float], shapes: list[AttentionShape],
                      device: torch.device) -> None:
    """Raise CompiledFlexRefused (one line, naming what to do instead) if a compiled flex
    attention disagrees with eager flex at any of `shapes`: `probe(shape)` is the largest
    difference between the two on one probe step (`verify_server.engines.flex.probe_error`)."""
    where = f"{device.type} {vector_code()}" if device.type == "cpu" else device.type
    for shape in shapes:
        error = probe(shape)
        if not error <= TOLERANCE.get(shape.dtype, LOW_PRECISION_TOLERANCE):   # NaN refuses too
            raise CompiledFlexRefused(
                f"compiled flex attention is wrong on this machine (torch {torch.__version__}, "
                f"{where}; {shape.describe()}: off by {error:.3g}): serve with --engine paged"
                + (", or with --kv-block-tokens 16" if shape.block_tokens < 16 else ""))
