"""What a profiled GPU holds: its memory, the target's weights and KV per token, its board power.

A server held to a step-cost profile (`sled serve --emulate PROFILE`) sizes its KV cache as that
GPU would: what is left of the memory a serving engine uses (UTILIZATION) after the weights, in
tokens of the profile's model. The same admission, per-device shares and refusals then apply as
at any KV budget, so a fleet meets the GPU's memory wall where the GPU would.

What the profile's gpu block leaves out is derived, and said in one line: the memory and the
board power from the device's name (KNOWN_GPUS), the weights and KV per token from the model's
shape (verify_server.shapes) in the profile's dtype. When neither is possible, the GPU's memory
is unknown and the server keeps its own KV budget.

    llama-8b in bfloat16 on an H100 80GB: 0.9 x 85.5 GB - 16.1 GB of weights = 60.9 GB,
    at 128 KiB a token: 464,700 tokens of KV (about 226 sessions of 2k context)
"""
from __future__ import annotations

from dataclasses import dataclass

from verify_server.shapes import kv_bytes_per_token, parameters, shape_of
from verify_server.step_costs import StepProfile

MIB = 1 << 20
# The share of a GPU's memory a serving engine takes for weights, KV and activations (vLLM's
# gpu_memory_utilization default); the rest stays with the CUDA context and the allocator.
UTILIZATION = 0.9
# device-name fragment -> (memory bytes as nvidia-smi reports it, board power in W): the SXM
# boards' data sheets
KNOWN_GPUS = {
    "H200": (143771 * MIB, 700.0),
    "H100 80GB": (81559 * MIB, 700.0),
    "A100-SXM4-80GB": (81920 * MIB, 400.0),
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1}


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """What a profile's GPU holds; None where neither the profile nor a derivation says."""
    memory_bytes: int | None = None
    weight_bytes: int | None = None
    kv_bytes_per_token: int | None = None
    tdp_watts: float | None = None
    derived: tuple[str, ...] = ()     # fields that came from the device's name or the shape

    @property
    def known(self) -> bool:
        """Whether the GPU's KV capacity is known (memory, weights and KV per token)."""
        return None not in (self.memory_bytes, self.weight_bytes, self.kv_bytes_per_token)

    def kv_tokens(self) -> int | None:
        """Tokens of KV the GPU holds after the weights (None when unknown); ValueError when
        the weights alone take the usable memory."""
        if not self.known:
            return None
        free = self.memory_bytes * UTILIZATION - self.weight_bytes
        if free < self.kv_bytes_per_token:
            raise ValueError(f"the weights ({self.weight_bytes / 1e9:.1f} GB) leave no room for "
                             f"KV in {UTILIZATION:.0%} of the GPU's "
                             f"{self.memory_bytes / 1e9:.1f} GB")
        return int(free // self.kv_bytes_per_token)


def gpu_memory(profile: StepProfile) -> GpuMemory:
    """The profile's gpu block, with what it leaves out derived where possible."""
    given = dict(profile.gpu)
    derived = {}
    device = next((v for k, v in KNOWN_GPUS.items() if k in profile.provenance.get("device", "")),
                  None)
    if device is not None:
        derived.update(memory_bytes=device[0], tdp_watts=device[1])
    shape = shape_of(str(profile.provenance.get("model", "")))
    dtype = DTYPE_BYTES.get(str(profile.provenance.get("dtype", "")))
    if shape is not None and dtype is not None:
        derived.update(weight_bytes=parameters(shape) * dtype,
                       kv_bytes_per_token=kv_bytes_per_token(shape, dtype))
    fields = {key: given.get(key, derived.get(key)) for key in
              ("memory_bytes", "weight_bytes", "kv_bytes_per_token", "tdp_watts")}
    used = tuple(key for key in fields if key not in given and fields[key] is not None)
    return GpuMemory(**fields, derived=used)


def describe(profile: StepProfile, gpu: GpuMemory) -> str:
    """One line: what the GPU holds and where each figure comes from."""
    if not gpu.known:
        return (f"{profile.name}: the GPU's memory is unknown (no gpu block, and device "
                f"{profile.provenance.get('device', '?')!r} or model "
                f"{profile.provenance.get('model', '?')!r} not known): the server keeps its own "
                "KV budget")
    text = (f"{profile.name}: {gpu.memory_bytes / 1e9:.1f} GB, {gpu.weight_bytes / 1e9:.2f} GB "
            f"of weights, {gpu.kv_bytes_per_token / 1024:g} KiB of KV a token: "
            f"{gpu.kv_tokens():,} tokens of KV at {UTILIZATION:.0%}")
    if gpu.derived:
        text += (f" ({', '.join(gpu.derived)} derived from the device's name and the model's "
                 "shape)")
    return text
