"""`sled doctor`: can this machine run its GGUF drafter? The processor's vector extensions, the
flags llama.cpp was built with, what the built runtime says it uses, and a decode of a few tokens
of a GGUF in a child process (a build that selects an instruction the CPU cannot run dies there,
not in the daemon). --repair rebuilds a crashing build once with the portable baseline. A device
with the [onnx] extra and no llama.cpp has the ONNX drafter's runtime loaded in a child instead.

    $ sled doctor
    cpu: AMD EPYC (x86_64): avx avx2 avx512bw ... (llama.cpp: no AMX, whatever the CPU reports)
    llama.cpp build: SSE42 AVX AVX2 FMA F16C BMI2 AVX512 ... (flags by sled.llama_build)
    runtime: CPU : SSE3 = 1 | ... | AVX512 = 1 | ...
    check: decoded 4 tokens of SmolLM2-135M-Instruct.Q4_1.gguf

Exit 0 when the check decodes, 1 when it does not (the last line says how it died and what to run).

`sled doctor --server` checks this machine as a verify server instead (sled_cli.doctor_server).
"""
from __future__ import annotations

import sys
import typing
from pathlib import Path

from sled import llama_build
from sled.extras import installed, require_extra
from verify_server.settings import ServerSettings   # pydantic only: no torch on a device

# The processor flags worth a person's eye: what llama.cpp's options are about, and AMX/SVE.
SHOWN = {flag for needs in llama_build.X86_OPTIONS.values() for flag in needs} | {
    "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve"} | {
    flag for needs in llama_build.ARM_EXTENSIONS.values() for flag in needs}
SERVER_ONLY = ("config", "model", "device", "dtype", "engine")    # the flags of --server alone


def add_arguments(parser) -> None:
    fields = ServerSettings.model_fields
    parser.add_argument("--gguf", metavar="FILE",
                        help="the GGUF the check decodes (default: the built-in smollm2-135m)")
    parser.add_argument("--repair", action="store_true",
                        help="a build that crashes is rebuilt once with the portable baseline "
                             "(minutes) and checked again")
    server = parser.add_argument_group(
        "server", "--server checks this machine as a verify server instead: torch's CUDA and the\n"
        "GPUs it sees, memory for the weights and KV, compiled flex, one step of the target")
    server.add_argument("--server", action="store_true",
                        help="check this machine as a verify server (default: as a device)")
    server.add_argument("--config", metavar="FILE", help="the server's settings file, as sled "
                        "serve reads it (default: none; SLED_SERVE_* variables apply too)")
    server.add_argument("--model", help="the target (default: the built-in gemma3-270m)")
    server.add_argument("--device", help="torch device (default: cuda when torch sees a GPU, "
                        "else cpu)")
    server.add_argument("--dtype", choices=typing.get_args(fields["dtype"].annotation),
                        help=f"the target's dtype (default: sled serve's, "
                             f"{fields['dtype'].default})")
    server.add_argument("--engine", choices=typing.get_args(fields["engine"].annotation),
                        help=f"the engine (default: {fields['engine'].default}, as sled serve "
                             "picks it)")


def run(args) -> int:
    mixed = [flag for flag, given in (("--gguf", args.gguf), ("--repair", args.repair)) if given]
    if args.server and mixed:
        print(f"sled doctor: {mixed[0]} checks a device's drafter, not a server: leave it out of "
              "--server", file=sys.stderr)
        return 2
    if not args.server and any(getattr(args, name) for name in SERVER_ONLY):
        print("sled doctor: --config, --model, --device, --dtype and --engine are the server's: "
              "give --server too", file=sys.stderr)
        return 2
    if args.server:
        require_extra("server", "sled doctor --server")
        from sled_cli.doctor_server import run_server   # torch loads for the server's checks only
        return run_server(args)
    return run_device(args)


def run_device(args) -> int:
    features = llama_build.cpu_features()
    print(f"cpu: {llama_build.cpu_name()} ({llama_build.machine()}): "
          f"{' '.join(sorted(features & SHOWN)) or 'no vector extensions reported'} "
          f"(llama.cpp: no AMX, whatever the CPU reports)")
    record = llama_build.installed_record()
    print("llama.cpp build: " + (f"{llama_build.describe(record['flags'])} (flags by "
                                 f"sled.llama_build)" if record
          else "not built by sled (pip's own build: -march=native may select instructions this "
               "CPU cannot run); python -m sled.llama_build install builds it for this CPU"))
    if not installed("llama_cpp"):
        if installed("onnxruntime_genai"):
            return check_onnx()
        print('check: neither llama-cpp-python nor onnxruntime-genai is installed: pip install '
              '"sled[gguf]" or "sled[onnx]"')
        return 1
    try:
        gguf = Path(args.gguf) if args.gguf else llama_build.builtin_gguf()
        verdict = (llama_build.verify(gguf, say=lambda line: print(f"repair: {line}", flush=True))
                   if args.repair else llama_build.check_decode(gguf))
    except llama_build.LlamaBuildError as exc:
        print(f"check: {exc}")
        return 1
    if verdict.system_info:
        print(f"runtime: {verdict.system_info.strip()}")
    if not verdict.ok:
        print(f"check: llama.cpp {verdict.detail} decoding {gguf.name}"
              + ("; sled doctor --repair rebuilds it with the portable baseline"
                 if verdict.signal else ""))
        return 1
    print(f"check: {verdict.detail} of {gguf.name}")
    return 0


# What the ONNX drafter's runtime says of itself, loaded in a child (a wheel built for another
# CPU dies there, not in the daemon)
ONNX_CHECK = ("import onnxruntime as ort, onnxruntime_genai as og; "
              "print(f'onnxruntime-genai {og.__version__}, onnxruntime {ort.__version__} "
              "({\", \".join(ort.get_available_providers())})')")


def check_onnx() -> int:
    """A device with the [onnx] extra and no llama.cpp: its runtime loaded in a child."""
    failed, said = llama_build.run_child(ONNX_CHECK)
    if failed is not None:
        print(f"check: onnxruntime-genai {failed.detail} loading")
        return 1
    print(f"check: {said} loads on this CPU (the onnx: drafter); llama-cpp-python, the gguf: "
          "drafter's, is not installed")
    return 0

