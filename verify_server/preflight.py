"""What a server needs of its device, checked the way it would start (`sled doctor --server`):
room for the target's weights and a KV cache, a compiled flex attention that agrees with eager
flex, and one step of the target through the engine it would serve with.

Each check returns a phrase for a person, or raises PreflightFailed with one line that says what
to do. The weights are counted before any is loaded: the checkpoint's config made into a model on
torch's meta device (no memory) gives its parameters, times the bytes of the dtype served.

    >>> fit = footprint("/models/llama-3.1-8b", "bfloat16")
    >>> fit.weight_bytes, fit.kv_bytes_per_token      # 8.03e9 parameters x 2 bytes; 32 layers
    (16060522496, 131072)
"""
from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from verify_server.accelerator import size_text
from verify_server.engines import auto_kind, free_memory_bytes, make_engine
from verify_server.engines.blocks import KVShape
from verify_server.engines.flex import CPU_COMPILED_DTYPES, compiled_flex, probe_error
from verify_server.engines.flex_check import AttentionShape, CompiledFlexRefused, refuse_if_unsound
from verify_server.engines.rows import Row
from verify_server.synthetic import is_synthetic, synthetic_config
from verify_server.target import DTYPES, Target

PROMPT = "The verify server checks each draft"
STEP_BLOCKS = 8       # the one-step check's KV pool: the prompt's blocks and room to spare


class PreflightFailed(Exception):
    """A check the server would fail on this machine; the message is one line: what to do."""


@dataclass(frozen=True, slots=True)
class Footprint:
    """What a target takes of its device's memory, from its config alone."""
    parameters: int
    dtype: torch.dtype
    kv_bytes_per_token: int
    context_length: int

    @property
    def weight_bytes(self) -> int:
        return self.parameters * self.dtype.itemsize

    def describe_weights(self) -> str:
        return (f"weights {size_text(self.weight_bytes)} ({self.parameters:,} parameters x "
                f"{self.dtype.itemsize} bytes, {str(self.dtype).removeprefix('torch.')})")


def footprint(located: str, dtype: str, trust_remote_code: bool = False) -> Footprint:
    """The footprint of the target `located` names (sled.models / locate_target) in DTYPE."""
    config = synthetic_config(located) if is_synthetic(located) else AutoConfig.from_pretrained(
        located, trust_remote_code=trust_remote_code)
    with torch.device("meta"):     # the parameters' shapes, no memory
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype],
                                                 trust_remote_code=trust_remote_code)
    text = model.config.get_text_config(decoder=True)
    return Footprint(sum(p.numel() for p in model.parameters()), DTYPES[dtype],
                     KVShape.of(model).bytes_per_token,
                     getattr(text, "max_position_embeddings", None) or 2048)


def memory_check(fit: Footprint, device: torch.device, kv_fraction: float, block_tokens: int,
                 kv_budget: int | None = None) -> str:
    """Free memory on DEVICE against the weights, and the KV cache the server would take of
    what is left: --kv-budget, else --kv-fraction of it (verify_server.engines.make_engine)."""
    free = free_memory_bytes(device)
    if fit.weight_bytes >= free:
        raise PreflightFailed(
            f"the {fit.describe_weights()} do not fit in the {size_text(free)} free on {device}: "
            "a smaller --dtype (bfloat16), a device with more memory, or --tp N over several GPUs")
    kv, source = _kv_cache(free - fit.weight_bytes, kv_fraction, kv_budget)
    tokens = kv // fit.kv_bytes_per_token
    if tokens < 2 * block_tokens:     # make_engine's least pool: the zero block and one more
        raise PreflightFailed(f"a KV cache of {source} holds {tokens} tokens, less than one "
                              f"{block_tokens}-token block: a larger --kv-fraction or "
                              "--kv-budget, or free memory on the device")
    return (f"{size_text(free)} free on {device}; {fit.describe_weights()}; KV at {source}: "
            f"{size_text(kv)}, {tokens:,} tokens ({_contexts(tokens, fit.context_length)})")


def _kv_cache(left: int, kv_fraction: float, kv_budget: int | None) -> tuple[int, str]:
    """The KV cache's bytes out of the LEFT the weights leave, and where the figure comes from."""
    if kv_budget is None:
        return int(left * kv_fraction), f"--kv-fraction {kv_fraction} of the {size_text(left)} left"
    if kv_budget > left:
        raise PreflightFailed(f"--kv-budget {size_text(kv_budget)} does not fit in the "
                              f"{size_text(left)} the weights leave: a smaller --kv-budget, or "
                              "none (--kv-fraction of what is left)")
    return kv_budget, f"--kv-budget, of the {size_text(left)} left"


def _contexts(tokens: int, context_length: int) -> str:
    """How many of the target's full contexts a KV cache of TOKENS holds, in words."""
    if tokens < context_length:
        return f"{tokens / context_length:.2f} of one full {context_length:,}-token context"
    count = tokens // context_length
    return f"{count:,} full context{'s' if count > 1 else ''} of {context_length:,} tokens"


def engine_kind(target: Target, kind: str) -> str:
    """The engine the server would serve TARGET with (--engine, auto resolved)."""
    return auto_kind(target.model, torch.device(target.device)) if kind == "auto" else kind


def flex_check(target: Target, block_tokens: int) -> str:
    """Compiled flex attention against eager flex at the target's attention shapes, on its
    device: the server's start-up probe (verify_server.engines.flex_check)."""
    device = torch.device(target.device)
    dtype = next(target.model.parameters()).dtype
    if device.type == "cpu" and dtype not in CPU_COMPILED_DTYPES:
        return (f"flex runs eagerly for a {str(dtype).removeprefix('torch.')} target on a CPU: "
                "nothing compiled to check")
    flex = compiled_flex(dynamic=device.type == "cpu")   # as the server compiles it there
    shapes = AttentionShape.all_of(target.model, block_tokens)
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():   # eager flex is the probe's reference, on purpose
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
            refuse_if_unsound(functools.partial(probe_error, flex, device=device), shapes, device)
    except CompiledFlexRefused as exc:
        raise PreflightFailed(str(exc)) from None
    return (f"compiled flex attention agrees with eager flex on {device.type} at "
            f"{'; '.join(shape.describe() for shape in shapes)} (compiled and checked in "
            f"{time.perf_counter() - started:.1f} s)")


def step_check(target: Target, kind: str, block_tokens: int) -> str:
    """One step of a short prompt through the engine the server would use, against the
    target's own forward (transformers'): the next token must be the same."""
    prompt = list(target.tokenizer(PROMPT).input_ids)
    reference = _next_token(target, prompt)
    shape = KVShape.of(target.model)
    engine = make_engine(target.model, kv_budget_bytes=STEP_BLOCKS * block_tokens
                         * shape.bytes_per_token, block_tokens=block_tokens, kind=kind,
                         sat=target.sat)
    kv = engine.new_kv()
    kv.admit([], len(prompt) + 1, b"")
    seconds = []
    for _ in range(2):     # the first may compile (flex, the layers on CUDA): the second is a step
        started = time.perf_counter()
        token = engine.forward([Row(kv, prompt, True)]).targets()[-1]
        seconds.append(time.perf_counter() - started)
    kv.free()
    said = f"{target.tokenizer.decode([token])!r} ({token})"
    if token != reference:
        raise PreflightFailed(
            f"the {engine.kind} engine's next token after {PROMPT!r} is {said}, transformers' "
            f"own forward gives {reference}: this engine is wrong here; serve with another "
            "--engine (paged, padded)")
    return (f"one step of {len(prompt)} tokens through the {engine.kind} engine in "
            f"{seconds[1]:.3f} s (the first step, with any compiling, {seconds[0]:.2f} s): next "
            f"token {said}, the same as the plain transformers forward")


@torch.inference_mode()
def _next_token(target: Target, prompt: list[int]) -> int:
    """The target's own greedy next token after PROMPT (transformers' forward); PreflightFailed
    when its logits are not finite (Gemma 3 overflows float16: every argmax is then id 0)."""
    ids = torch.tensor([prompt], device=target.device)
    logits = target.model(input_ids=ids).logits[0, -1]
    if not bool(torch.isfinite(logits).all()):
        raise PreflightFailed(f"the target's own logits after {PROMPT!r} are not finite in "
                              f"{target.dtype} (NaN or inf: its activations overflow it): serve "
                              "it with --dtype bfloat16 or float32")
    return int(logits.argmax())
