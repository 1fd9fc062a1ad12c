"""llama.cpp (llama-cpp-python) built for the processor it runs on, and checked by a decode.

llama-cpp-python compiles llama.cpp from source with GGML_NATIVE=ON by default: -march=native
lets the compiler take every path the processor reports, AMX included, and llama.cpp's AMX
matmul dies of SIGILL on machines that report AMX (a Sapphire Rapids VM). sled builds with
GGML_NATIVE=OFF and names every instruction-set option itself, from the processor's own feature
list: the vector extensions it reports stay (AVX2, AVX-512, VNNI; NEON dotprod and fp16), AMX
and SVE stay out. This module is the one place that names them.

    flags = build_flags(cpu_features())   # ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", ...]
    wheel = ensure_wheel(flags)           # built once per flag set into sled's cache
    install(wheel)                        # into this Python's environment, recorded there
    verify(gguf)                          # a child decodes a few tokens; a crash -> portable build

pip's own wheel cache is never used for it (--no-cache-dir): a wheel built for one processor is
found again only under the key of its flags, which another machine reaches only when it reports
the same extensions. `python -m sled.llama_build install|verify|flags` runs each step
(`make install` does); `sled doctor` reports and repairs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from sled.cache import cache_dir
from sled.models import gguf_path

PACKAGE = "llama-cpp-python"
DEFAULT_SPEC = "llama-cpp-python>=0.3.36,<0.4"    # pyproject's gguf extra, where sled is not installed
EXTRA_ARGS_ENV = "SLED_LLAMA_CMAKE_ARGS"          # appended as given: "-DGGML_CUDA=ON ..." on a Jetson
BUILD_MINUTES = 8                                 # llama.cpp on 2 cores

# x86-64: llama.cpp's option for each extension, and the /proc/cpuinfo flags it needs (all of them).
X86_OPTIONS = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    # llama.cpp compiles its AVX512 path with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
# The portable baseline (x86-64-v3 at most): what a rebuild after a crash keeps.
X86_PORTABLE = ("GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2")
# Never on: the AMX path is what crashed, and no check here proves it works on a machine.
X86_NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
# aarch64: -march extensions by the cpuinfo Features that report them (SVE is left out).
ARM_EXTENSIONS = {"dotprod": ("asimddp",), "fp16": ("fphp", "asimdhp"), "i8mm": ("i8mm",)}
# Arm Ltd. cores (CPU implementer 0x41) by cpuinfo's "CPU part", for boards that print no name.
ARM_CORES = {"0xd03": "Cortex-A53", "0xd08": "Cortex-A72", "0xd0b": "Cortex-A76",
             "0xd42": "Cortex-A78AE"}


class LlamaBuildError(RuntimeError):
    """A build, install or check that failed: the message is one line for the person."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a decode of a few tokens in a child process gave."""
    ok: bool
    detail: str                 # the tokens, or how it died ("SIGILL", "exit 1: ...")
    signal: int | None = None   # the signal that killed the child, if one did
    system_info: str = ""       # llama_print_system_info() of the build that ran


def machine() -> str:
    return platform.machine().lower()


def cpuinfo_field(names: tuple[str, ...], cpuinfo: str | None = None) -> str | None:
    """The first /proc/cpuinfo field (of CPUINFO where given) named exactly one of NAMES (x86
    has both "model" and "model name"; a Pi's board is "Model")."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in names:
            return value.strip()
    return None


def cpu_features(cpuinfo: str | None = None) -> frozenset[str]:
    """The extensions the processor reports: x86 "flags", ARM "Features" of /proc/cpuinfo."""
    return frozenset((cpuinfo_field(("flags", "Features"), cpuinfo) or "").split())


def cpu_name(cpuinfo: str | None = None) -> str:
    """The processor's name as /proc/cpuinfo gives it (x86 "model name", a Pi's "Model"), else
    an Arm core's by its part number (a Jetson prints no board name there)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    arm_core = (ARM_CORES.get(cpuinfo_field(("CPU part",), cpuinfo) or "")
                if cpuinfo_field(("CPU implementer",), cpuinfo) == "0x41" else None)
    return cpuinfo_field(("model name", "Model"), cpuinfo) or arm_core or "unknown processor"


def build_flags(features: frozenset[str], arch: str | None = None,
                portable: bool = False) -> list[str]:
    """The CMake options for llama.cpp on a processor with FEATURES. portable: the baseline
    (x86-64-v3 extensions at most; plain armv8-a) a crashed build is rebuilt with."""
    arch = arch or machine()
    flags = ["-DGGML_NATIVE=OFF"]
    if arch in ("x86_64", "amd64"):
        for option, needs in X86_OPTIONS.items():
            wanted = not portable or option in X86_PORTABLE
            on = wanted and all(flag in features for flag in needs)
            flags.append(f"-D{option}={'ON' if on else 'OFF'}")
        flags += [f"-D{option}=OFF" for option in X86_NEVER]
    elif arch in ("aarch64", "arm64"):
        flags.append(f"-DGGML_CPU_ARM_ARCH={arm_march(features, portable)}")
    return flags + os.environ.get(EXTRA_ARGS_ENV, "").split()


def arm_march(features: frozenset[str], portable: bool = False) -> str:
    """armv8-a (Pi 4), armv8.2-a+dotprod+fp16 (Pi 5, Jetson Orin), with +i8mm where reported."""
    extensions = [] if portable else [
        name for name, needs in ARM_EXTENSIONS.items() if all(flag in features for flag in needs)]
    return "armv8.2-a" + "".join(f"+{name}" for name in extensions) if extensions else "armv8-a"


def describe(flags: list[str]) -> str:
    """The extensions a flag list turns on, for a person: "AVX AVX2 ..." or "armv8.2-a+dotprod"."""
    on = [flag[len("-DGGML_"):-len("=ON")] for flag in flags
          if flag.startswith("-DGGML_") and flag.endswith("=ON")]
    arm = [flag.split("=", 1)[1] for flag in flags if flag.startswith("-DGGML_CPU_ARM_ARCH=")]
    return " ".join(on + arm) or "no vector extensions"


def spec() -> str:
    """The llama-cpp-python requirement of sled's gguf extra, as the installed sled states it."""
    try:
        for requirement in metadata.requires("sled") or ():
            if requirement.lower().startswith(PACKAGE) and 'extra == "gguf"' in requirement:
                return requirement.split(";", 1)[0].strip()
    except metadata.PackageNotFoundError:
        pass
    return DEFAULT_SPEC


def wheel_key(flags: list[str]) -> str:
    """The cache key of a build: the requirement, the flags, this Python and this machine."""
    facts = [spec(), *flags, sys.implementation.cache_tag, sysconfig.get_platform()]
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:16]


def wheel_dir(flags: list[str]) -> Path:
    return cache_dir() / "llama-cpp" / wheel_key(flags)


def cached_wheel(flags: list[str]) -> Path | None:
    """The wheel built with FLAGS, if one is cached."""
    folder = wheel_dir(flags)
    if not (folder / "build.json").is_file():
        return None
    return next(folder.glob("llama_cpp_python-*.whl"), None)


def ensure_wheel(flags: list[str], say=print) -> Path:
    """The wheel built with FLAGS: from the cache, else compiled now (minutes) into it."""
    wheel = cached_wheel(flags)
    if wheel is not None:
        return wheel
    folder = wheel_dir(flags)
    say(f"building llama.cpp for this CPU ({describe(flags)}; about {BUILD_MINUTES} min on "
        f"2 cores, once per set of flags)")
    with tempfile.TemporaryDirectory(prefix="sled-llama-") as tmp:
        _build_wheel(flags, Path(tmp))
        built = next(Path(tmp).glob("llama_cpp_python-*.whl"))
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, folder / built.name)
    record = {"flags": flags, "requirement": spec(), "machine": machine(), "wheel": built.name}
    (folder / "build.json").write_text(json.dumps(record, indent=1) + "\n")
    return folder / built.name


def _build_wheel(flags: list[str], out: Path) -> None:
    env = dict(os.environ, CMAKE_ARGS=" ".join(flags), FORCE_CMAKE="1")
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
    _pip(["wheel", "--no-deps", "--no-cache-dir", "--no-binary", PACKAGE, "--wheel-dir",
          str(out), spec()], env=env, step="building llama-cpp-python")


def _pip(args: list[str], step: str, env: dict | None = None) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet",
                           *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise LlamaBuildError(f"{step} failed: {lines[-1].strip() if lines else 'no message'}")


def record_path() -> Path:
    """Where an environment keeps the flags its llama-cpp-python was built with."""
    return Path(sys.prefix) / "share" / "sled" / "llama-build.json"


def installed_record() -> dict | None:
    """The build record of this environment's llama-cpp-python, if sled installed it."""
    try:
        return json.loads(record_path().read_text())
    except (OSError, ValueError):
        return None


def install(wheel: Path, flags: list[str]) -> None:
    """WHEEL into this Python's environment (replacing another build of it), then recorded."""
    _pip(["install", "--no-deps", "--force-reinstall", str(wheel)], step="installing llama.cpp")
    _pip(["install", str(wheel)], step="installing llama-cpp-python's requirements")
    record_path().parent.mkdir(parents=True, exist_ok=True)
    record = {"flags": flags, "wheel": wheel.name}
    record_path().write_text(json.dumps(record, indent=1) + "\n")


def current_flags() -> list[str]:
    """The flags of this environment's build where sled installed it (the portable baseline
    after a crash), else those this CPU gets."""
    record = installed_record()
    return list(record["flags"]) if record else build_flags(cpu_features())


def wheel_for_this_cpu(say=print) -> Path:
    """The llama-cpp-python wheel an environment made here installs (a slim device venv, the lab's
    wheelhouse): this environment's own build, from the cache or compiled once."""
    return ensure_wheel(current_flags(), say=say)


def build_and_install(portable: bool = False, say=print) -> list[str]:
    """This CPU's build (or the portable baseline) compiled or taken from the cache, installed."""
    flags = build_flags(cpu_features(), portable=portable)
    install(ensure_wheel(flags, say=say), flags)
    return flags


# The child's whole job: a prompt through the batched path, then single-token steps on the
# runtime's worker threads (where the AMX crash happened), and what the build says it runs.
CHECK_CODE = """
import json, os, sys
import llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=128, n_threads=min(4, os.cpu_count() or 1),
                      n_threads_batch=min(4, os.cpu_count() or 1), verbose=False)
tokens = llm.tokenize(b"def add(a, b):\\n    return")
got = []
for token in llm.generate(tokens, top_k=1, temp=0.0):
    got.append(int(token))
    if len(got) == 4:
        break
print(json.dumps({"tokens": got, "info": llama_cpp.llama_print_system_info().decode()}))
"""


def check_decode(gguf: Path, python: str = sys.executable, timeout: float = 180,
                 code: str = CHECK_CODE) -> Verdict:
    """A decode of a few tokens of GGUF in a child process: did the build run, or how it died."""
    failed, last = run_child(code, [str(gguf)], python, timeout)
    if failed is not None:
        return failed
    answer = json.loads(last)
    return Verdict(True, f"decoded {len(answer['tokens'])} tokens", system_info=answer["info"])


def run_child(code: str, args: list[str] = (), python: str = sys.executable,
              timeout: float = 180) -> tuple[Verdict | None, str]:
    """CODE run by a child Python: (None, the last line it printed), or (how it failed, "") -
    a signal (a build selecting an instruction this CPU lacks dies of SIGILL), an exit code
    with its last message, or no answer in `timeout` seconds."""
    try:
        done = subprocess.run([python, "-c", code, *args], capture_output=True, text=True,
                              timeout=timeout, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return Verdict(False, f"no answer in {timeout:.0f} s"), ""
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        return Verdict(False, f"died of {name}", signal=-done.returncode), ""
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return Verdict(False, f"exit {done.returncode}: {last}"), ""
    return None, lines[-1]


def verify(gguf: Path, rebuild=None, check=None, say=print) -> Verdict:
    """The install check: decode GGUF in a child; a build that dies of a signal is rebuilt once
    with the portable baseline and checked again. Raises LlamaBuildError (one line) when the
    build cannot decode. rebuild(portable, say) and check(gguf) default to the real ones."""
    rebuild, check = rebuild or build_and_install, check or check_decode
    verdict = check(gguf)
    if verdict.ok:
        return verdict
    if verdict.signal is None:
        raise LlamaBuildError(f"llama.cpp could not decode {gguf.name}: {verdict.detail}")
    portable = build_flags(cpu_features(), portable=True)
    say(f"llama.cpp {verdict.detail} decoding {gguf.name}: rebuilding with the portable "
        f"baseline ({describe(portable)})")
    rebuild(portable=True, say=say)
    second = check(gguf)
    if not second.ok:
        raise LlamaBuildError(f"llama.cpp built with the portable baseline also {second.detail} "
                              f"decoding {gguf.name}: this CPU needs a build by hand (README, "
                              f"'On a Raspberry Pi or a Jetson')")
    return second


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sled.llama_build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("flags", "install", "verify"),
                        help="flags: print the CMake options for this CPU; install: build (or "
                             "take from the cache) and install; verify: the decode check")
    parser.add_argument("--portable", action="store_true", help="the portable baseline instead")
    parser.add_argument("--gguf", help="the GGUF the check decodes (default: the built-in "
                                       "smollm2-135m)")
    args = parser.parse_args(argv)
    say = lambda line: print(f"llama.cpp: {line}", flush=True)   # noqa: E731
    try:
        if args.step == "flags":
            print(" ".join(build_flags(cpu_features(), portable=args.portable)))
        elif args.step == "install":
            build_and_install(portable=args.portable, say=say)
        else:
            gguf = Path(args.gguf) if args.gguf else builtin_gguf()
            verdict = verify(gguf, say=say)
            say(f"{verdict.detail} of {gguf.name} with this build ({describe(current_flags())})")
    except LlamaBuildError as exc:
        print(f"llama.cpp: {exc}", file=sys.stderr)
        return 1
    return 0


def builtin_gguf() -> Path:
    """The GGUF the install check decodes: SmolLM2-135M, shipped inside a package."""
    try:
        return gguf_path("smollm2-135m")
    except Exception as exc:     # the models extra is not installed: say how to point at a file
        raise LlamaBuildError(f"no built-in GGUF to check with ({exc}); pass --gguf FILE") from exc


if __name__ == "__main__":
    sys.exit(main())
