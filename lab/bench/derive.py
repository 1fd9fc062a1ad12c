"""`sled bench derive-profile`: a step-cost profile for a target nobody measured, from a shape,
a GPU's published bandwidth and FLOPs and a profile measured on that GPU
(verify_server.roofline). The profile is DERIVED and says so everywhere it shows.

    sled bench derive-profile --shape llama-70b --gpu H200 --measured h200-llama8b-flex-graph \\
        --weight-dtype float8 --out verify_server/step_profiles/derived-h200-llama70b-fp8.json
"""
from __future__ import annotations

import sys

from rich.table import Table

from lab.bench.harness import bench_console
from sled.flags import one_line
from verify_server.gpu_memory import describe, gpu_memory
from verify_server.roofline import GPUS, derive_profile
from verify_server.shapes import SHAPES
from verify_server.step_costs import load_profile


def add_arguments(parser) -> None:
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES),
                        help="the target's shape (verify_server.shapes)")
    parser.add_argument("--gpu", required=True, choices=sorted(GPUS), help="the GPU to derive for")
    parser.add_argument("--measured", required=True,
                        help="a step profile measured on that GPU: how far from the roofline its "
                             "engine stands")
    parser.add_argument("--weight-dtype", default="bfloat16",
                        choices=("bfloat16", "float16", "float8"),
                        help="the weights' dtype on the GPU (float8: a model too big for it in bf16)")
    parser.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "float16", "float8"),
                        help="the KV cache's dtype")
    parser.add_argument("--out", required=True, help="the profile file to write (.json)")


def run(args) -> int:
    try:
        profile = derive_profile(args.shape, args.gpu, load_profile(args.measured),
                                 args.weight_dtype, args.kv_dtype)
        memory = describe(profile, gpu_memory(profile))
    except ValueError as exc:
        print(f"sled bench derive-profile: {one_line(exc)}", file=sys.stderr)
        return 2
    console = bench_console()
    table = Table(title=f"{profile.name} (DERIVED)")
    for column in ("rows", "tokens", "context", "ms"):
        table.add_column(column, justify="right")
    for cell in profile.cells:
        table.add_row(str(cell.rows), str(cell.tokens), str(cell.context), f"{cell.ms:.2f}")
    console.print(table)
    console.print(profile.describe(), highlight=False)
    console.print(memory, highlight=False)
    console.print(f"wrote {profile.save(args.out)}")
    return 0
