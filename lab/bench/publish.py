"""`sled bench publish-profile`: a step-cost profile of an engine a buyer would run (vLLM, SGLang),
its cells taken from that engine's published cost model or published steps, never measured here.
The profile is PUBLISHED and says so everywhere it shows; one for a GPU the figures were not
published on is moved there at the distance from the roofline they stood at on theirs (as
`sled bench derive-profile` moves a measured profile) and is PUBLISHED, DERIVED for that GPU.

    sled bench publish-profile --engine vllm --gpu H100 \\
        --out verify_server/step_profiles/h100-llama8b-vllm-published.json

Every cell is the published rule at the step's new tokens and KV tokens (rows x tokens, and
rows x (context + tokens)), raised to its GPU's roofline (verify_server.roofline) where it would
fall under it; the provenance names the cells so raised.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import date

from rich.table import Table

from lab.bench.harness import bench_console
from sled.flags import one_line
from verify_server.gpu_memory import DTYPE_BYTES, KNOWN_GPUS, describe, gpu_memory
from verify_server.roofline import GPUS, GpuSpec, step_floor
from verify_server.shapes import kv_bytes_per_token, parameters
from verify_server.step_costs import StepCell, StepFloor, StepProfile, make_profile

SHAPE, DTYPE = "llama-8b", "bfloat16"
# The grid of sled's measured profiles (`sled bench engine --kinds prefill,verify,decode`):
# prefill chunks at no context, then verify (draft length 4) and decode at each rows x context
PREFILL = ((1, 512), (1, 2048), (4, 512))
ROWS, CONTEXTS, VERIFY_TOKENS = (1, 16, 64), (512, 2048), 5


@dataclass(frozen=True, slots=True)
class CostModel:
    """An engine's published step time on the GPU it was published for, in seconds:
    fixed + per_token x batched new tokens + per_kv_token x KV tokens in the batch."""
    engine: str             # what the engine was, as the profile names it
    gpu: str                # the GPU (a key of verify_server.roofline.GPUS) it was published on
    fixed_s: float
    per_token_s: float
    per_kv_token_s: float
    source: str             # the publications, their setup and how the rule comes from them
    rule: str               # the rule in words, as its cells apply it

    def ms(self, new: int, read: int) -> float:
        return 1e3 * (self.fixed_s + self.per_token_s * new + self.per_kv_token_s * read)


# The SpecDecode-Bench simulator's fit of vLLM on an H100 (predictor.py, class Llama8BH100)
VLLM_KV, VLLM_TOKEN, VLLM_FIXED, VLLM_STEP = 3.92645679e-08, 2.10103129e-05, 5.88590713e-03, \
    1.20683946e-03

VLLM = CostModel(
    engine="vLLM v0.10.1 (V1 engine, CUDA graphs), as the SpecDecode-Bench simulator's cost model "
           "fits it on an H100",
    gpu="H100",
    fixed_s=VLLM_FIXED + VLLM_STEP, per_token_s=VLLM_TOKEN, per_kv_token_s=VLLM_KV,
    source="SpecDecode-Bench simulator (github.com/SpecDecode-Bench/simulator, predictor.py, "
           "class Llama8BH100; the cost model of 'Speculative Decoding: Performance or "
           "Illusion?', arXiv 2601.11580): vLLM v0.10.1 on one H100, Llama-3.1-8B-Instruct in "
           "bf16, fitted to InstructCoder decode and verify steps at batch sizes 1, 8, 16, 32 "
           "and 64: a forward of 39.26 ns x KV tokens in the batch + 21.01 us x batched new "
           "tokens + 5.886 ms, and 1.207 ms of step overhead beside it. Cross-check: "
           "vllm-project/vllm#11081 measured a one-row forward of 6.50 ms with CUDA graphs "
           "(5.93 ms with torch.compile) on an H100; the fit's at 1k context is 5.95 ms",
    rule="forward + step overhead at new = rows x tokens and KV = rows x (context + tokens); "
         "the fit is of decode and verify batches, so its prefill cells are the same sum (as the "
         "simulator charges a prefill) and never less than the roofline's FLOPs")

# SGLang's two published decode steps (sgl-project/sglang#1008): `bench_latency` on
# Meta-Llama-3-8B, 128 prompt tokens and 8 out, the median decode step
SGLANG_POINTS = ((1, 7.37e-3), (128, 11.84e-3))      # (rows, seconds a decode step)
SGLANG_KV_PER_ROW = 132       # KV a row reads at the median decode step: 128 prompt + 4 decoded


def _two_point_rule() -> tuple[float, float]:
    """(fixed, per token) in seconds through SGLang's two points, the KV term vLLM's: the two
    share one context, so they cannot tell a KV term apart."""
    (rows_a, time_a), (rows_b, time_b) = SGLANG_POINTS
    left_a = time_a - VLLM_KV * rows_a * SGLANG_KV_PER_ROW
    left_b = time_b - VLLM_KV * rows_b * SGLANG_KV_PER_ROW
    per_token = (left_b - left_a) / (rows_b - rows_a)
    return left_a - per_token * rows_a, per_token


SGLANG_FIXED, SGLANG_TOKEN = _two_point_rule()

SGLANG = CostModel(
    engine="SGLang of 2024-08-09 (v0.2 series; CUDA graphs, FlashInfer attention), from its two "
           "published decode steps",
    gpu="H100",
    fixed_s=SGLANG_FIXED, per_token_s=SGLANG_TOKEN, per_kv_token_s=VLLM_KV,
    source="sgl-project/sglang#1008 ('Torch.compile Performance Tracking', 2024-08-09): "
           "`python3 -m sglang.bench_latency --model meta-llama/Meta-Llama-3-8B --input 128 "
           "--output 8`, TP 1, bf16, CUDA graphs: median decode step 7.37 ms at batch 1 and "
           "11.84 ms at batch 128 (10,815 tok/s), on a Hopper GPU the post does not name (both "
           "are under an A100's floor), taken as an H100 SXM. Llama 3 8B has Llama 3.1 8B's "
           f"shape. Two points allow two terms: {SGLANG_FIXED * 1e3:.3f} ms + "
           f"{SGLANG_TOKEN * 1e6:.2f} us x batched new tokens, solved from them with each row "
           f"reading {SGLANG_KV_PER_ROW} KV tokens, and the KV term (39.26 ns x KV tokens) taken "
           "from the SpecDecode-Bench fit of vLLM on an H100 (github.com/SpecDecode-Bench/"
           "simulator, predictor.py, class Llama8BH100), as both points share one context",
    rule="that rule at new = rows x tokens and KV = rows x (context + tokens); its per-token "
         "term comes from decode at 1-128 rows, so its prefill cells extrapolate it, never less "
         "than the roofline's FLOPs")

MODELS = {"vllm": VLLM, "sglang": SGLANG}


def grid() -> list[tuple[int, int, int, str]]:
    """(rows, tokens, context, kind) of every cell, in the order `sled bench engine` writes them."""
    cells = [(rows, tokens, 0, "prefill") for rows, tokens in PREFILL]
    for rows in ROWS:
        for context in CONTEXTS:
            cells += [(rows, VERIFY_TOKENS, context, "verify"), (rows, 1, context, "decode")]
    return cells


def floor_on(gpu: GpuSpec) -> StepFloor:
    return step_floor(SHAPE, gpu, DTYPE, DTYPE)


def published_profile(engine: str, gpu_name: str) -> StepProfile:
    """The PUBLISHED profile of `engine` on `gpu_name` (a key of GPUS): its cells from the
    engine's published rule, each at least the roofline of the GPU it was published on, and on
    another GPU moved to that GPU's roofline at the same distance. ValueError (one line) for an
    engine or GPU sled has no published figures or data sheet for."""
    if engine not in MODELS:
        raise ValueError(f"no published figures for engine {engine!r}: sled has "
                         f"{', '.join(MODELS)}")
    if gpu_name not in GPUS:
        raise ValueError(f"no data sheet for GPU {gpu_name!r}: sled has {', '.join(GPUS)} "
                         "(verify_server.roofline)")
    model, gpu = MODELS[engine], GPUS[gpu_name]
    home = GPUS[model.gpu]
    home_floor, floor = floor_on(home), floor_on(gpu)
    moved = home != gpu
    cells, raised = [], []
    for rows, tokens, context, kind in grid():
        new, read = rows * tokens, rows * (context + tokens)
        ms = model.ms(new, read)
        if ms < home_floor.ms(new, read):
            raised.append(f"{rows} rows x {tokens} tokens at {context} ({kind}) on the "
                          f"{model.gpu}: {ms:.3f} ms")
            ms = home_floor.ms(new, read)
        if moved:
            ms = max(ms / home_floor.ms(new, read) * floor.ms(new, read), floor.ms(new, read))
        cells.append(StepCell(rows, tokens, context, round(ms, 3), kind))
    name = f"{gpu_name.lower()}-llama8b-{engine}-published"
    floored = ("cells raised to the roofline: " + "; ".join(raised) if raised else
               "no cell fell under the roofline")
    source = (f"{model.source}. Each cell: {model.rule}. Every cell at least the roofline of "
              f"{SHAPE} on the {model.gpu} ({home.source}); {floored}")
    if moved:
        source += (f". No figure of this engine on an {gpu_name} is published: each cell is the "
                   f"{model.gpu} cell times the {gpu_name}'s roofline over the {model.gpu}'s for "
                   "that step (max(bytes / bandwidth, FLOPs / peak), verify_server.roofline), the "
                   f"engine kept at its {model.gpu} distance from the floor ({gpu.source}): "
                   f"PUBLISHED for the {model.gpu}, DERIVED for the {gpu_name}")
    provenance = {
        "device": gpu.name, "published": True, **({"derived": True} if moved else {}),
        "model": f"{SHAPE} (the shape of Llama 3.1 8B, bf16 weights and KV)",
        "dtype": DTYPE,
        "engine": model.engine + (f", moved to the {gpu_name}'s roofline" if moved else ""),
        "torch": "-", "transformers": "-", "date": date.today().isoformat(),
        "command": f"sled bench publish-profile --engine {engine} --gpu {gpu_name} --out "
                   f"verify_server/step_profiles/{name}.json",
        "source": source,
        "raised_to_floor": raised,
    }
    memory, tdp = next(v for k, v in KNOWN_GPUS.items() if k in gpu.name)
    gpu_block = {"memory_bytes": memory, "tdp_watts": tdp,
                 "weight_bytes": parameters(SHAPE) * DTYPE_BYTES[DTYPE],
                 "kv_bytes_per_token": kv_bytes_per_token(SHAPE, DTYPE_BYTES[DTYPE])}
    return make_profile(name, provenance, cells, gpu_block, floor)


def add_arguments(parser) -> None:
    parser.add_argument("--engine", required=True, choices=sorted(MODELS),
                        help="whose published figures")
    parser.add_argument("--gpu", required=True, choices=sorted(GPUS),
                        help="the GPU to write the profile for (one the figures were not "
                             "published on gets them moved there by its roofline)")
    parser.add_argument("--out", required=True, help="the profile file to write (.json)")


def run(args) -> int:
    try:
        profile = published_profile(args.engine, args.gpu)
        memory = describe(profile, gpu_memory(profile))
    except ValueError as exc:
        print(f"sled bench publish-profile: {one_line(exc)}", file=sys.stderr)
        return 2
    console = bench_console()
    table = Table(title=f"{profile.name} ({profile.label})")
    for column in ("rows", "tokens", "context", "kind", "ms", "floor ms"):
        table.add_column(column, justify="right")
    for cell in profile.cells:
        table.add_row(str(cell.rows), str(cell.tokens), str(cell.context), cell.kind,
                      f"{cell.ms:.2f}", f"{profile.floor.ms(cell.new, cell.read):.2f}")
    console.print(table)
    console.print(profile.describe(), highlight=False)
    console.print(memory, highlight=False)
    console.print(f"wrote {profile.save(args.out)}")
    return 0
