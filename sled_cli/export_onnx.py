"""`sled export-onnx`: an HF checkpoint or built-in model to an int4/int8/fp32 ONNX drafter."""
from __future__ import annotations

from drafters.onnx_export import alias_dir, export
from sled.models import BUILTIN


def run_export_onnx(args) -> int:
    if args.out is None and args.source not in BUILTIN:
        raise SystemExit("sled export-onnx: OUT_DIR is required unless SOURCE is a built-in model")
    out = args.out or alias_dir(args.source, args.precision)
    print(export(args.source, out, args.precision, args.execution_provider))
    return 0
