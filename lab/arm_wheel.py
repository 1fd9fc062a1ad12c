"""llama-cpp-python cross-compiled for aarch64 on an x86-64 host, with the flags sled.llama_build
gives a board, as a wheel that installs on the board (or in `sled lab arm-root`'s root).

    sled lab arm-wheel                  # the Raspberry Pi 5's build (minutes, once)
    sled lab arm-wheel --board pi4      # pi5, pi4, orin: the /proc/cpuinfo files in lab/cpuinfo/
    sled lab arm-wheel --cpuinfo FILE   # any board's /proc/cpuinfo

The steps: the sdist of sled's gguf requirement downloaded once (pip download), compiled by
pip wheel with Debian's cross compiler (gcc-aarch64-linux-gnu, g++-aarch64-linux-gnu) and the
board's flags, then retagged: pip names the wheel for the platform of the Python that ran it
(linux_x86_64), though its libraries are aarch64. The package is ctypes over shared libraries,
no extension module, so the tag is all that is wrong: retag() rewrites it. The wheel is cached
under <cache>/arm-root/wheels/BOARD/, keyed by the sdist's version and the flags, with its
build.json and build.log beside it; a second call returns at once. On the board (or in the
root's venv), sled.llama_build.install(wheel, flags) installs it and records the flags.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from rich.console import Console
from rich.text import Text

from lab.arm_root import StepFailed, Unavailable, _run, _text, check_tools
from sled import progress
from sled.cache import cache_dir
from sled.llama_build import PACKAGE, build_flags, cpu_features, cpu_name, describe, spec

CPUINFO_DIR = Path(__file__).resolve().parent / "cpuinfo"
BOARDS = {"pi5": "raspberry-pi-5.txt", "pi4": "raspberry-pi-4.txt",
          "orin": "jetson-orin-nano.txt"}
DEFAULT_BOARD = "pi5"
TOOLS = ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++")
INSTALL = "apt-get install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu"
# What makes CMake cross-compile: the target system and Debian's cross compilers.
CROSS = ("-DCMAKE_SYSTEM_NAME=Linux", "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
         "-DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc", "-DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++")
PLATFORM = "linux_aarch64"
EM_AARCH64 = 183               # the ELF header's e_machine of an aarch64 library
STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]")     # ninja's "[12/193] ..." lines in pip's -v output


def board_cpuinfo(board: str) -> str:
    """The /proc/cpuinfo of a board by its short name (pi5, pi4, orin)."""
    return (CPUINFO_DIR / BOARDS[board]).read_text()


def board_flags(cpuinfo: str) -> list[str]:
    """llama.cpp's flags for the board whose /proc/cpuinfo is CPUINFO, as it would pick them."""
    return build_flags(cpu_features(cpuinfo), arch="aarch64")


def wheels_dir() -> Path:
    return cache_dir() / "arm-root" / "wheels"


def sdist_dir(requirement: str) -> Path:
    """Where the sdist of REQUIREMENT is kept: a new requirement downloads its own."""
    return cache_dir() / "arm-root" / "sdists" / _digest([requirement])


def _digest(facts: list[str]) -> str:
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:16]


def ensure_sdist(requirement: str, say=print) -> Path:
    """The sdist of REQUIREMENT: the one downloaded before, else pip download now (its log
    beside the folder)."""
    folder = sdist_dir(requirement)
    found = sorted(folder.glob("*.tar.gz"))
    if found:
        return found[-1]
    say(f"downloading the sdist of {requirement}")
    partial = folder.with_name(folder.name + ".partial")
    log = folder.with_name(folder.name + ".log")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    log.write_text("")
    _run("pip download", [sys.executable, "-m", "pip", "--disable-pip-version-check", "download",
                          "--no-deps", "--no-binary", ":all:", "--dest", str(partial),
                          requirement], log)
    if not list(partial.glob("*.tar.gz")):
        raise StepFailed(f"pip download gave no sdist for {requirement}; log: {log}")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return next(folder.glob("*.tar.gz"))


def sdist_version(sdist: Path) -> str:
    """0.3.36 of llama_cpp_python-0.3.36.tar.gz."""
    return sdist.name[:-len(".tar.gz")].rsplit("-", 1)[1]


def wheel_folder(label: str, version: str, flags: list[str]) -> Path:
    return wheels_dir() / label / f"{version}-{_digest([version, *flags, *CROSS])}"


def cached(folder: Path) -> tuple[Path, dict] | None:
    """The wheel in FOLDER and its build.json, where a build finished there."""
    try:
        record = json.loads((folder / "build.json").read_text())
    except (OSError, ValueError):
        return None
    wheel = folder / record.get("wheel", "")
    return (wheel, record) if wheel.is_file() else None


def cached_wheel(board: str = DEFAULT_BOARD) -> tuple[Path, list[str]] | None:
    """The newest wheel built for BOARD with its flags of now and sled's requirement, and those
    flags; None where there is none (nothing is downloaded or built)."""
    flags = board_flags(board_cpuinfo(board))
    found = [hit for folder in (wheels_dir() / board).glob("*-*")
             if not folder.name.endswith(".partial") and (hit := cached(folder)) is not None
             and hit[1].get("flags") == flags and hit[1].get("requirement") == spec()]
    if not found:
        return None
    wheel, _ = max(found, key=lambda hit: hit[0].stat().st_mtime)
    return wheel, flags


def cross_compile(sdist: Path, flags: list[str], out: Path, log: Path, jobs: int,
                  show=lambda step, total: None) -> Path:
    """pip wheel of SDIST with the cross compiler and FLAGS into OUT (its output in LOG, each
    ninja step to show(step, total)): the wheel as pip tagged it (linux_x86_64)."""
    env = dict(os.environ, CMAKE_ARGS=" ".join([*flags, *CROSS]), FORCE_CMAKE="1",
               CMAKE_BUILD_PARALLEL_LEVEL=str(jobs))
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "-v",
            "--no-deps", "--no-cache-dir", "--no-binary", PACKAGE, "--wheel-dir", str(out),
            str(sdist)]
    with log.open("a") as sink:
        sink.write(f"$ CMAKE_ARGS='{env['CMAKE_ARGS']}' FORCE_CMAKE=1 "
                   f"CMAKE_BUILD_PARALLEL_LEVEL={jobs} {' '.join(argv)}\n")
        sink.flush()
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=env)
        try:
            for line in child.stdout:
                sink.write(line)
                if match := STEP.match(line):
                    show(int(match[1]), int(match[2]))
        except BaseException:       # Ctrl-C: the compile stops with this command
            child.kill()
            child.wait()
            raise
        code = child.wait()
    built = sorted(out.glob("*.whl"))
    if code != 0 or not built:
        lines = [line for line in _text(log).splitlines() if line.strip()]
        raise StepFailed(f"pip wheel failed (exit {code}): "
                         f"{lines[-1].strip() if lines else 'no output'}; log: {log}")
    return built[0]


def retag(wheel: Path, platform: str = PLATFORM, out_dir: Path | None = None) -> Path:
    """WHEEL with its platform tag replaced by PLATFORM, written to OUT_DIR (its own folder by
    default): the Tag lines of .dist-info/WHEEL, that file's RECORD line (sha256, size) and the
    file name. Every other entry is copied as it was."""
    stem = wheel.name[:-len(".whl")].split("-")
    target = (out_dir or wheel.parent) / ("-".join([*stem[:-1], platform]) + ".whl")
    partial = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(wheel) as source:
        infos = source.infolist()
        info_dir = next(info.filename[:-len("/WHEEL")] for info in infos
                        if re.fullmatch(r"[^/]+\.dist-info/WHEEL", info.filename))
        wheel_name, record_name = f"{info_dir}/WHEEL", f"{info_dir}/RECORD"
        tagged = _retagged(source.read(wheel_name).decode(), platform).encode()
        record = _recorded(source.read(record_name).decode(), wheel_name, tagged).encode()
        replaced = {wheel_name: tagged, record_name: record}
        with zipfile.ZipFile(partial, "w") as out:
            for info in infos:
                out.writestr(info, replaced.get(info.filename) or source.read(info))
    partial.replace(target)
    return target


def _retagged(wheel_file: str, platform: str) -> str:
    """The WHEEL metadata with each Tag's platform replaced (python-abi kept), once each."""
    lines, seen = [], set()
    for line in wheel_file.splitlines():
        if line.startswith("Tag:"):
            python, abi, _ = line.split(":", 1)[1].strip().split("-")
            line = f"Tag: {python}-{abi}-{platform}"
            if line in seen:
                continue
            seen.add(line)
        lines.append(line)
    return "\n".join(lines) + "\n"


def _recorded(record: str, name: str, content: bytes) -> str:
    """RECORD with NAME's line giving CONTENT's sha256 (urlsafe base64, no padding) and size."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
    rows = [[name, f"sha256={digest}", str(len(content))] if row and row[0] == name else row
            for row in csv.reader(io.StringIO(record))]
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(rows)
    return buffer.getvalue()


def elf_machines(wheel: Path) -> dict[str, int]:
    """Each ELF file in WHEEL by its e_machine (183: aarch64, 62: x86-64)."""
    found = {}
    with zipfile.ZipFile(wheel) as source:
        for info in source.infolist():
            with source.open(info) as entry:
                head = entry.read(20)
            if len(head) == 20 and head[:4] == b"\x7fELF":
                found[info.filename] = int.from_bytes(
                    head[18:20], "little" if head[5] == 1 else "big")
    return found


def check_aarch64(wheel: Path) -> int:
    """The number of ELF files in WHEEL, all aarch64; StepFailed where one is not or none is."""
    machines = elf_machines(wheel)
    other = sorted(name for name, machine in machines.items() if machine != EM_AARCH64)
    if not machines:
        raise StepFailed(f"{wheel.name} holds no library")
    if other:
        raise StepFailed(f"{wheel.name}: {other[0]} is not aarch64 (ELF machine "
                         f"{machines[other[0]]}): the cross compiler was not used")
    return len(machines)


def build(label: str, flags: list[str], jobs: int, say=print) -> tuple[Path, dict, bool]:
    """The board's wheel and its build.json, and whether it was built now: from the cache, else
    the sdist cross-compiled, its libraries checked to be aarch64, the wheel retagged."""
    start = time.monotonic()
    requirement = spec()
    sdist = ensure_sdist(requirement, say=say)
    folder = wheel_folder(label, sdist_version(sdist), flags)
    hit = cached(folder)
    if hit is not None:
        return *hit, False
    download_s = time.monotonic() - start
    say(f"cross-compiling {sdist.name} for {label} ({describe(flags)}; {jobs} job(s), about "
        f"7 min on one core)")
    scratch = folder.with_name(folder.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    with _steps(f"compiling llama.cpp for {label}") as show:
        built = cross_compile(sdist, flags, scratch / "out", scratch / "build.log", jobs, show)
    libraries = check_aarch64(built)
    wheel = retag(built, out_dir=scratch)
    shutil.rmtree(scratch / "out")
    record = {"board": label, "flags": flags, "cross": list(CROSS), "requirement": requirement,
              "version": sdist_version(sdist), "wheel": wheel.name, "libraries": libraries,
              "compiler": _compiler_version(), "jobs": jobs, "download_s": round(download_s, 1),
              "build_s": round(time.monotonic() - start - download_s, 1),
              "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (scratch / "build.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    scratch.rename(folder)
    return folder / wheel.name, record, True


def _compiler_version() -> str:
    done = subprocess.run([TOOLS[0], "-dumpfullversion"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


@contextlib.contextmanager
def _steps(message: str):
    """show(step, total) for the build's steps: a spinner with the count and the time on a
    terminal, elsewhere (a pipe, a log) a line at each tenth of the steps."""
    start, shown = time.monotonic(), [0]
    line = lambda step, total: (f"{message}: step {step}/{total}, "       # noqa: E731
                                f"{_minutes(time.monotonic() - start)}")
    if not progress.on_terminal():
        def show(step: int, total: int) -> None:
            if step * 10 // total > shown[0]:
                shown[0] = step * 10 // total
                print(f"{progress.prefix()}: {line(step, total)}", file=sys.stderr, flush=True)
        yield show
        return
    status = Console(stderr=True, highlight=False).status(Text(f"{message} (configuring)"))
    status.start()
    try:
        yield lambda step, total: status.update(Text(line(step, total)))
    finally:
        status.stop()


def _minutes(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60} s" if whole >= 60 else f"{seconds:.1f} s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n", 1)[0]
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--board", choices=sorted(BOARDS), default=DEFAULT_BOARD,
                       help="the board whose flags the build takes, by its /proc/cpuinfo in "
                            "lab/cpuinfo/ (pi5: Cortex-A76, pi4: Cortex-A72, orin: Jetson Orin "
                            "Nano's Cortex-A78AE)")
    which.add_argument("--cpuinfo", type=Path, metavar="FILE",
                       help="another board's /proc/cpuinfo instead (cached as 'cpuinfo')")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="also copy the wheel into DIR")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="compile jobs (default: the cores this process may run on)")


def run(args: argparse.Namespace) -> int:
    say = lambda line: print(f"arm-wheel: {line}", flush=True)     # noqa: E731
    try:
        check_tools(TOOLS, INSTALL)
        cpuinfo = args.cpuinfo.read_text() if args.cpuinfo else board_cpuinfo(args.board)
        label = "cpuinfo" if args.cpuinfo else args.board
        flags = board_flags(cpuinfo)
        wheel, record, fresh = build(label, flags, max(1, args.jobs), say=say)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            wheel = Path(shutil.copy2(wheel, args.out / wheel.name))
    except Unavailable as exc:
        print(f"sled lab arm-wheel: {exc}", file=sys.stderr, flush=True)
        return 2
    except (StepFailed, OSError) as exc:
        print(f"sled lab arm-wheel: {exc}", file=sys.stderr, flush=True)
        return 1
    say(f"{wheel} ({wheel.stat().st_size / 1e6:.1f} MB; {record['libraries']} ELF files, all "
        f"aarch64)")
    say(f"flags: {' '.join(flags)} ({cpu_name(cpuinfo)})")
    say(f"{'built' if fresh else 'cached, built'} in {_minutes(record['build_s'])} with "
        f"aarch64-linux-gnu-gcc {record['compiler']}, {record['jobs']} job(s); log: "
        f"{wheel_folder(label, record['version'], flags) / 'build.log'}")
    return 0
