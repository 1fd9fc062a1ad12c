"""`sled export-onnx`: an HF checkpoint or built-in model to an int4/int8/fp32 ONNX drafter."""
from __future__ import annotations

import logging
import sys

from drafters.onnx_export import alias_dir, export
from sled.flags import builtin_aliases
from sled.models import BUILTIN

log = logging.getLogger("sled.export_onnx")


def add_arguments(parser) -> None:
    parser.add_argument("source", help="HF checkpoint folder, or a built-in model alias "
                        f"({builtin_aliases()})")
    parser.add_argument("out", nargs="?", default=None,
                        help="output folder (default for an alias: the cache onnx:ALIAS loads)")
    parser.add_argument("--precision", default="int4", choices=["int4", "int8", "fp32"],
                        help="weight precision")
    parser.add_argument("--execution-provider", default="cpu", help="onnxruntime-genai EP (cpu)")


def run(args) -> int:
    if args.out is None and args.source not in BUILTIN:
        print("sled export-onnx: OUT_DIR is required unless SOURCE is a built-in model "
              f"({builtin_aliases()})", file=sys.stderr)
        return 2
    out = args.out or alias_dir(args.source, args.precision)
    try:
        print(export(args.source, out, args.precision, args.execution_provider))
    except (OSError, ValueError) as exc:   # no checkpoint at SOURCE, OUT not an empty folder
        log.debug("export-onnx refused", exc_info=True)
        print(f"sled export-onnx: {exc}", file=sys.stderr)
        return 2
    return 0
