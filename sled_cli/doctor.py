"""`sled doctor`: can this machine run its GGUF drafter? The processor's vector extensions, the
flags llama.cpp was built with, what the built runtime says it uses, and a decode of a few tokens
of a GGUF in a child process (a build that selects an instruction the CPU cannot run dies there,
not in the daemon). --repair rebuilds a crashing build once with the portable baseline.

    $ sled doctor
    cpu: AMD EPYC (x86_64): avx avx2 avx512bw ... (llama.cpp: no AMX, whatever the CPU reports)
    llama.cpp build: SSE42 AVX AVX2 FMA F16C BMI2 AVX512 ... (flags by sled.llama_build)
    runtime: CPU : SSE3 = 1 | ... | AVX512 = 1 | ...
    check: decoded 4 tokens of SmolLM2-135M-Instruct.Q4_1.gguf

Exit 0 when the check decodes, 1 when it does not (the last line says how it died and what to run).
"""
from __future__ import annotations

from pathlib import Path

from sled import llama_build
from sled.extras import installed

# The processor flags worth a person's eye: what llama.cpp's options are about, and AMX/SVE.
SHOWN = {flag for needs in llama_build.X86_OPTIONS.values() for flag in needs} | {
    "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve"} | {
    flag for needs in llama_build.ARM_EXTENSIONS.values() for flag in needs}


def add_arguments(parser) -> None:
    parser.add_argument("--gguf", metavar="FILE",
                        help="the GGUF the check decodes (default: the built-in smollm2-135m)")
    parser.add_argument("--repair", action="store_true",
                        help="a build that crashes is rebuilt once with the portable baseline "
                             "(minutes) and checked again")


def run(args) -> int:
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
        print('check: llama-cpp-python is not installed: pip install "sled[gguf]"')
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

