"""Step-cost profiles for targets nobody measured: a roofline of the model's shape on a GPU's
published bandwidth and FLOPs, scaled cell by cell by how far a measured profile on the same
GPU stands from its own roofline. Such a profile is DERIVED, and says so wherever it shows
(StepProfile.describe).

The roofline of a step of `new` tokens reading `read` tokens of KV is the larger of

    bytes / bandwidth:  the streamed weights (all but the input embedding table) + read x KV a token
    FLOPs / peak:       2 x streamed parameters x new

so at few rows a step is bound by streaming the weights and at many by its GEMMs. A measured
profile's cell c stands at ratio(c) = c.ms / roofline(c) on its GPU; the derived cell of the same
rows, tokens and context is the target's roofline there times ratio(c): an engine as far from
the floor for the bigger model as it was for the measured one.

    derive_profile("llama-70b", "H200", measured=load_profile("h200-llama8b-flex-graph"),
                   weight_dtype="float8", kv_dtype="bfloat16")

The same roofline is the floor block of a profile (`step_floor`; `floor_of` for a profile measured
on a GPU and a shape sled knows): no step it charges costs less.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import date

from verify_server.gpu_memory import DTYPE_BYTES, KNOWN_GPUS
from verify_server.shapes import SHAPES, kv_bytes_per_token, parameters, shape_of, streamed_parameters
from verify_server.step_costs import StepCell, StepFloor, StepProfile, make_profile


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """What a GPU's data sheet says: HBM bandwidth, dense tensor FLOPs by dtype."""
    name: str                        # as the device reports itself (matches KNOWN_GPUS)
    bandwidth: float                 # bytes/s
    flops: dict[str, float]          # dtype -> dense FLOP/s
    source: str


GPUS = {
    "H100": GpuSpec("NVIDIA H100 80GB HBM3", 3.35e12,
                    {"bfloat16": 989.4e12, "float16": 989.4e12, "float8": 1978.9e12},
                    "NVIDIA H100 SXM5 data sheet: 3.35 TB/s HBM3, 989 TFLOPS bf16 and 1,979 "
                    "TFLOPS fp8 dense"),
    "H200": GpuSpec("NVIDIA H200", 4.8e12,
                    {"bfloat16": 989.4e12, "float16": 989.4e12, "float8": 1978.9e12},
                    "NVIDIA H200 SXM data sheet: 4.8 TB/s HBM3e, 989 TFLOPS bf16 and 1,979 "
                    "TFLOPS fp8 dense"),
}


def gpu_spec(name: str) -> GpuSpec:
    """The published spec of "H100" or "H200" (or a device name that contains one)."""
    for key, spec in GPUS.items():
        if key in name:
            return spec
    raise ValueError(f"no published spec for GPU {name!r}: sled knows {', '.join(GPUS)}")


def step_floor(shape: str, gpu: GpuSpec, weight_dtype: str, kv_dtype: str) -> StepFloor:
    """The floor of every step of `shape` on `gpu` (see the module's docstring): what a
    profile's floor block holds."""
    streamed = streamed_parameters(shape)
    return StepFloor(bandwidth=gpu.bandwidth,
                     weight_bytes=streamed * DTYPE_BYTES[weight_dtype],
                     kv_bytes_per_token=kv_bytes_per_token(shape, DTYPE_BYTES[kv_dtype]),
                     flops_per_token=2.0 * streamed,
                     peak_flops=gpu.flops[weight_dtype],
                     source=f"{gpu.name} data sheet ({gpu.bandwidth / 1e12:g} TB/s, "
                            f"{gpu.flops[weight_dtype] / 1e12:g} TFLOP/s {weight_dtype}); "
                            f"{shape}, {kv_dtype} KV")


def floor_of(provenance: dict) -> StepFloor | None:
    """The data sheet's floor under a profile measured on a GPU and a model shape sled knows, in
    its dtype (None when it is not one of those, or DERIVED: such a profile carries its own)."""
    if provenance.get("derived"):
        return None
    shape, dtype = shape_of(str(provenance.get("model", ""))), str(provenance.get("dtype", ""))
    try:
        gpu = gpu_spec(str(provenance.get("device", "")))
    except ValueError:
        return None
    if shape is None or dtype not in gpu.flops:
        return None
    return step_floor(shape, gpu, dtype, dtype)


def roofline_ms(shape: str, gpu: GpuSpec, weight_dtype: str, kv_dtype: str, new: int,
                read: int) -> float:
    """The floor of one step in ms (see the module's docstring)."""
    return step_floor(shape, gpu, weight_dtype, kv_dtype).ms(new, read)


def derive_profile(shape: str, gpu_name: str, measured: StepProfile, weight_dtype: str = "bfloat16",
                   kv_dtype: str = "bfloat16") -> StepProfile:
    """A DERIVED profile of `shape` on `gpu_name`, each of `measured`'s cells moved to the new
    shape at the distance from the roofline that cell measured. ValueError (one line) when the
    measured profile's GPU or model is not one sled can put a roofline under, or differs."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: sled knows {', '.join(SHAPES)}")
    for dtype in (weight_dtype, kv_dtype):
        if dtype not in DTYPE_BYTES or dtype == "float32":
            raise ValueError(f"dtype {dtype!r}: use bfloat16, float16 or float8")
    gpu = gpu_spec(gpu_name)
    source = measured.provenance
    if gpu_spec(str(source.get("device", ""))) != gpu:
        raise ValueError(f"{measured.name} was measured on {source.get('device')}, not an "
                         f"{gpu_name}: a derived profile scales by a measurement on its own GPU")
    measured_shape = shape_of(str(source.get("model", "")))
    measured_dtype = str(source.get("dtype", ""))
    if measured_shape is None or measured_dtype not in DTYPE_BYTES:
        raise ValueError(f"{measured.name}: its model or dtype is not one sled knows the shape of")
    measured_floor = step_floor(measured_shape, gpu, measured_dtype, measured_dtype)
    floor = step_floor(shape, gpu, weight_dtype, kv_dtype)
    cells = []
    for cell in measured.cells:
        ratio = cell.ms / measured_floor.ms(cell.new, cell.read)
        ms = ratio * floor.ms(cell.new, cell.read)
        cells.append(StepCell(cell.rows, cell.tokens, cell.context, round(ms, 3), cell.kind))
    name = f"derived-{gpu_name.lower()}-{shape.replace('-', '')}-{_short(weight_dtype)}"
    memory, tdp = next(v for k, v in KNOWN_GPUS.items() if k in gpu.name)
    provenance = {
        "device": gpu.name, "derived": True,
        "model": f"{shape} ({weight_dtype} weights, {kv_dtype} KV)",
        "dtype": weight_dtype,
        "engine": f"each cell the roofline of {shape} on the {gpu_name}'s published bandwidth "
                  f"and FLOPs, times how far {measured.name} measured that cell from its own "
                  "roofline",
        "torch": "-", "transformers": "-", "date": date.today().isoformat(),
        "command": f"sled bench derive-profile --shape {shape} --gpu {gpu_name} --measured "
                   f"{measured.name} --weight-dtype {weight_dtype} --kv-dtype {kv_dtype}",
        "source": f"{gpu.source}; {measured.name}: {source.get('source', source.get('command'))}",
    }
    gpu_block = {"memory_bytes": memory, "tdp_watts": tdp,
                 "weight_bytes": parameters(shape) * DTYPE_BYTES[weight_dtype],
                 "kv_bytes_per_token": kv_bytes_per_token(shape, DTYPE_BYTES[kv_dtype])}
    return make_profile(name, provenance, cells, gpu_block, floor)


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float8": "fp8"}[dtype]
