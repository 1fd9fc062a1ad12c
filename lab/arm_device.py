"""`sled lab arm-device`: the device side in the emulated aarch64 root, drafting for a server on
this host, as a person with a Pi would install and run it (docs/devices.md).

    sled lab arm-root              # the root, once (lab.arm_root)
    sled lab arm-wheel             # llama-cpp-python for a Pi 5, cross-compiled, once
    sled lab arm-device --fresh    # minutes: every step below, timed
    sled lab arm-device --board pi4 --drafters gguf    # a Pi 4's build on a Pi 4's core

1. sled's wheel, built from this tree, installed in the root's venv /root/sled-venv with the
   [onnx] extra (--fresh: the venv made anew first), then the cross-compiled llama-cpp-python
   by sled.llama_build.install with the flags it was built with;
2. the drafters' models copied in: the GGUF and the ONNX export this host resolves gemma3-270m
   to (a Pi would fetch them; the root reaches no model hub);
3. `sled doctor --gguf FILE` in the root, before /proc is mounted there (so it reports the
   emulated CPU, not this host's);
4. `sled serve --model gemma3-270m` on this host; in the root, with /proc mounted (onnxruntime
   needs it), per drafter (ngram, onnx, gguf): `sled generate --json` held to the target's
   generate(), then `sled device` started, its /v1/chat/completions asked through the official
   openai client and held to the target's reply, and its RSS read from this host's /proc
   (VmRSS and VmHWM; the process is qemu running Python, so qemu's translator counts too)
   against the budget: the model's files plus 120 MB, 120 MB for ngram.

The root's programs run on one core (taskset), through chroot with a bare environment, on the
board's core as qemu models it (QEMU_CPU: cortex-a76 for a Pi 5 and for an Orin, whose A78AE
qemu 7.2 lacks but whose -march is the A76's; cortex-a72 for a Pi 4). For a Pi 5 the doctor
also runs on a Pi 4's core, where the build must fail: its dot-product instructions are not
there, which shows the flags are the board's own. Exit 0 when every output is the target's
(and that check fails as it must), 1 otherwise, 2 when the root or the wheel is missing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import openai
from rich.table import Table

from drafters import resolve_spec
from lab import arm_root, images
from lab.bench import harness
from lab.bench.footprint import BUDGET_NGRAM_MB, BUDGET_OVER_GGUF_MB, Daemon, Env
from lab.oracle import chat_reply, greedy_ids, load_target
from sled.flags import positive_int
from sled.models import resolve_model

VENV = "/root/sled-venv"
PYTHON, SLED = f"{VENV}/bin/python", f"{VENV}/bin/sled"
MODELS = "/root/.cache/sled"                 # the root's sled cache, where the models go
TARGET = "gemma3-270m"
DRAFTERS = {"ngram": "ngram", "onnx": f"onnx:{TARGET}", "gguf": f"gguf:{TARGET}"}
PROMPT = "def add(a, b):"
CHAT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
CORE = "1"                                   # the root's programs run on this core alone
QEMU_CPUS = {"pi5": "cortex-a76", "pi4": "cortex-a72", "orin": "cortex-a76"}   # qemu's models
VERSIONS = ("sled", "numpy", "grpcio", "protobuf", "tokenizers", "onnxruntime",
            "onnxruntime-genai", "llama_cpp_python", "openai")
MB = 1e6


def add_arguments(parser) -> None:
    parser.add_argument("--board", default="pi5", choices=tuple(QEMU_CPUS),
                        help="whose llama.cpp build (sled lab arm-wheel --board) and whose core "
                             "(qemu's model of it) the root runs")
    parser.add_argument("--fresh", action="store_true",
                        help="make the root's venv anew before installing (the install's time "
                             "as a Pi's first install takes it)")
    parser.add_argument("--drafters", default=",".join(DRAFTERS),
                        type=harness.listed(_no_drafter, *DRAFTERS),
                        help="drafters to run in the root (ngram, onnx, gguf)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32,
                        help="tokens of each generate and chat reply")
    harness.add_out_flag(parser, "arm-device")


def _no_drafter(text: str) -> None:
    raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(DRAFTERS)}")


def run(args) -> int:
    return harness.run_bench("arm-device", main, args, group="lab")


async def main(args) -> int:
    console = harness.bench_console(140)
    root = _ready_root()
    wheel, flags = _llama_wheel(args.board)
    cpu = QEMU_CPUS[args.board]
    kinds = [kind.strip() for kind in args.drafters.split(",") if kind.strip()]
    steps: dict[str, float] = {}
    log = root.with_name(root.name + "-device.log")
    log.write_text("")
    with console.status("installing sled in the root (minutes under emulation)"):
        _timed(steps, "install sled[onnx]", lambda: install_sled(root, args.fresh, log))
        _timed(steps, "install llama.cpp", lambda: install_llama(root, wheel, flags, log))
        specs = _timed(steps, "copy the models", lambda: copy_models(root, [*kinds, "gguf"]))
    with console.status(f"sled doctor in the root ({cpu})"):
        doctor = _timed(steps, "sled doctor", lambda: run_doctor(root, specs["gguf"], cpu))
        foreign = run_doctor(root, specs["gguf"], QEMU_CPUS["pi4"]) if args.board == "pi5" else None
        baseline = bare_python_mb(root)
    console.print(f"sled doctor on {cpu} (exit {doctor['exit']}):\n  "
                  + "\n  ".join(doctor["lines"]))
    if foreign is not None:
        console.print(f"the same build on a Pi 4's core ({QEMU_CPUS['pi4']}): exit "
                      f"{foreign['exit']} ({'fails, as it must' if foreign['exit'] else 'ran'})")
    versions = installed_versions(root)
    served_target = load_target(resolve_model(TARGET))
    runs = []
    async with harness.serving(resolve_model(TARGET), console=console,
                               status=f"starting the verify server ({TARGET})") as served:
        with proc_mounted(root), shared_folder(root, cpu) as shared:
            for kind in kinds:
                runs.append(await _one_drafter(root, shared, kind, specs[kind], served,
                                               served_target, args, console))
    data = {"target": TARGET, "board": args.board, "qemu_cpu": cpu, "steps_s": steps,
            "doctor": doctor, "doctor_on_a_pi4_core": foreign, "versions": versions,
            "bare_python_mb": baseline,
            "llama_flags": flags, "llama_wheel": wheel.name, "runs": runs,
            "root": str(root), "date": time.strftime("%Y-%m-%d")}
    _print(console, data)
    harness.write_results(console, args.out, data)
    same = (all(r["generate_same"] and r["chat_same"] for r in runs) and doctor["exit"] == 0
            and (foreign is None or foreign["exit"] != 0))
    return harness.DONE if same else 1


def _ready_root() -> Path:
    """The cached root, with binfmt registered; or a Stop naming the command that makes it."""
    root = arm_root.root_dir()
    try:
        arm_root.check_tools()
        arm_root.ensure_binfmt()
    except arm_root.Unavailable as exc:
        raise harness.Stop(str(exc)) from None
    if arm_root.cached_stamp(root) is None:
        raise harness.Stop(f"no aarch64 root in {root}: build it with `sled lab arm-root` "
                           "(about 5 minutes)")
    return root


def _llama_wheel(board: str) -> tuple[Path, list[str]]:
    """The cross-compiled llama-cpp-python for BOARD and its flags (lab.arm_wheel's cache)."""
    from lab import arm_wheel

    found = arm_wheel.cached_wheel(board)
    if found is None:
        raise harness.Stop(f"no cross-compiled llama-cpp-python for {board}: build it with "
                           f"`sled lab arm-wheel --board {board}` (about 7 minutes)")
    return found


def _timed(steps: dict, name: str, step):
    start = time.monotonic()
    result = step()
    steps[name] = round(time.monotonic() - start, 1)
    return result


# --- in the root --------------------------------------------------------------------------------

def root_env(cpu: str) -> list[str]:
    """The bare environment of the root's programs, with qemu's model of the board's core."""
    return [f"{key}={value}" for key, value in {**arm_root.CHROOT_ENV, "QEMU_CPU": cpu}.items()]


def in_root(root: Path, argv: list[str], cpu: str,
            timeout: float = 900) -> subprocess.CompletedProcess:
    """ARGV run in the root on one core, as qemu's CPU, with the root's bare environment;
    output captured."""
    return subprocess.run(["taskset", "-c", CORE, "chroot", str(root), "/usr/bin/env", "-i",
                           *root_env(cpu), *argv], capture_output=True, text=True,
                          timeout=timeout, env={**arm_root.CHROOT_ENV, "QEMU_CPU": cpu})


def install_sled(root: Path, fresh: bool, log: Path) -> None:
    """This tree's wheel into the root's venv, with the [onnx] extra, as docs/devices.md's Pi
    lines install it."""
    wheel = images.project_wheel(root / "opt" / "sled-wheel")
    inner = f"/opt/sled-wheel/{wheel.name}"
    venv = root / VENV.lstrip("/")
    if fresh:
        shutil.rmtree(venv, ignore_errors=True)
    if not (venv / "bin" / "python").exists():
        arm_root._chroot("the venv", root, ["/usr/bin/python3", "-m", "venv", VENV], log)
    pip = [PYTHON, "-m", "pip", "install", "--quiet"]
    arm_root._chroot("sled's wheel", root, [*pip, "--force-reinstall", "--no-deps", inner], log)
    arm_root._chroot("sled[onnx]", root, [*pip, f"{inner}[onnx]"], log)


def install_llama(root: Path, wheel: Path, flags: list[str], log: Path) -> None:
    """The cross-compiled wheel installed by sled.llama_build.install, which records its flags
    (what `sled doctor` reports)."""
    inner = f"/opt/llama-wheel/{wheel.parent.name}/{wheel.name}"    # one folder per build:
    target = root / inner.lstrip("/")                                  # every board's wheel has
    target.parent.mkdir(parents=True, exist_ok=True)                   # the same file name
    shutil.copy2(wheel, target)
    code = ("import json, sys; from pathlib import Path; from sled.llama_build import install; "
            "install(Path(sys.argv[1]), json.loads(sys.argv[2]))")
    arm_root._chroot("llama-cpp-python", root, [PYTHON, "-c", code, inner, json.dumps(flags)],
                     log)


def copy_models(root: Path, kinds: list[str]) -> dict[str, str]:
    """Each drafter's spec as the root names it, its model copied into the root's cache."""
    specs = {}
    for kind in kinds:
        if kind == "ngram":
            specs[kind] = "ngram"
            continue
        source = Path(resolve_spec(DRAFTERS[kind]).partition(":")[2])
        inner = f"{MODELS}/{kind}/{source.name}"
        target = root / inner.lstrip("/")
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            copy = shutil.copytree if source.is_dir() else shutil.copy2
            copy(source, target)
        specs[kind] = f"{kind}:{inner}"
    return specs


def run_doctor(root: Path, gguf_spec: str, cpu: str) -> dict:
    """`sled doctor --gguf FILE` in the root (a Pi without the models extra names its GGUF) on
    qemu's CPU: exit and lines."""
    done = in_root(root, [SLED, "doctor", "--gguf", gguf_spec.partition(":")[2]], cpu)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return {"exit": done.returncode, "lines": lines}


def installed_versions(root: Path) -> dict[str, str]:
    """The root's Python and the versions of the packages that matter, as its pip lists them."""
    done = in_root(root, [PYTHON, "-m", "pip", "list", "--format", "json"], "max")
    listed = {item["name"].lower().replace("-", "_"): item["version"]
              for item in json.loads(done.stdout or "[]")}
    python = in_root(root, [PYTHON, "-c", "import platform; print(platform.python_version(), "
                                          "platform.machine())"], "max").stdout.strip()
    qemu = subprocess.run(["qemu-aarch64-static", "--version"], capture_output=True,
                          text=True).stdout.split()        # qemu-aarch64 version 7.2.22 (...)
    return {"python": python, "qemu (this host)": qemu[2] if len(qemu) > 2 else "-",
            **{name: listed.get(name.lower().replace("-", "_"), "-") for name in VERSIONS}}


def bare_python_mb(root: Path) -> dict[str, float]:
    """The RSS of a Python that imports nothing, in the root (qemu's translator with it) and on
    this host: what emulation adds to every figure, before sled's own."""
    code = "import sys; sys.stdout.write(open('/proc/self/status').read())"
    def rss(argv: list[str]) -> float:
        status = subprocess.run(argv, capture_output=True, text=True, timeout=300).stdout
        line = next((l for l in status.splitlines() if l.startswith("VmRSS:")), "VmRSS: 0 kB")
        return round(int(line.split()[1]) * 1024 / MB, 1)
    with proc_mounted(root):      # the root's own /proc/self: the emulated process's
        emulated = rss(["chroot", str(root), PYTHON, "-c", code])
    return {"emulated": emulated, "host": rss(["python3", "-c", code])}


@contextmanager
def proc_mounted(root: Path):
    """/proc mounted in the root while the drafters run (onnxruntime refuses to load without
    it), unmounted after."""
    point = root / "proc"
    subprocess.run(["mount", "-t", "proc", "proc", str(point)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


@contextmanager
def shared_folder(root: Path, cpu: str):
    """A folder with one path inside the root and out: a folder in the root's /tmp, and a link
    to it at the same path here (the daemon's config and the python that enters the root)."""
    inner = Path(f"/tmp/sled-arm-device-{id(root):x}")
    real = root / str(inner).lstrip("/")
    real.mkdir(parents=True, exist_ok=True)
    if inner.is_symlink() or inner.exists():
        inner.unlink()
    inner.symlink_to(real)
    python = real / "python"
    python.write_text(f"#!/bin/sh\nexport QEMU_CPU={cpu}\nexec taskset -c {CORE} chroot {root} "
                      f"/usr/bin/env -i {' '.join(root_env(cpu))} {PYTHON} \"$@\"\n")
    python.chmod(0o755)
    try:
        yield inner
    finally:
        inner.unlink(missing_ok=True)
        shutil.rmtree(real, ignore_errors=True)


# --- one drafter ----------------------------------------------------------------------------------

async def _one_drafter(root: Path, shared: Path, kind: str, spec: str, served, served_target,
                       args, console) -> dict:
    address = served.server.address
    with console.status(f"{kind}: sled generate in the root"):
        start = time.monotonic()
        done = await asyncio.to_thread(in_root, root, [
            SLED, "generate", "--server", address, "--drafter", spec, "--max-new-tokens",
            str(args.max_new_tokens), "--json", "--prompt", PROMPT], QEMU_CPUS[args.board])
        generate_s = time.monotonic() - start
    if done.returncode != 0:
        raise harness.Stop(f"sled generate --drafter {spec} in the root: "
                           f"{(done.stderr.strip().splitlines() or ['no message'])[-1]}",
                           harness.SERVER_FAILED)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    want = greedy_ids(served_target, served_target.tokenizer(PROMPT).input_ids,
                      args.max_new_tokens)
    daemon_run = await _daemon(shared, spec, address, served_target, args, console, kind)
    row = {"drafter": kind, "spec": spec, "generate_s": round(generate_s, 1),
           "generate_same": result["token_ids"] == want, "rounds": result.get("rounds"),
           "acceptance": result.get("acceptance_rate"), **daemon_run}
    console.print(f"{kind}: generate {'=' if row['generate_same'] else '!='} generate(), chat "
                  f"{'=' if row['chat_same'] else '!='} the target's; RSS idle "
                  f"{row['idle_rss_mb']:.0f} MB, after {row['loaded_rss_mb']:.0f} MB (budget "
                  f"{row['budget_mb']:.0f} MB)")
    return row


async def _daemon(shared: Path, spec: str, address: str, served_target, args, console,
                  kind: str) -> dict:
    """`sled device` in the root: ready, one chat completion through the openai client, RSS."""
    env = Env("aarch64 root", str(shared / "python"))
    with console.status(f"{kind}: sled device in the root"):
        daemon = Daemon(env, spec, address, shared / f"device-{kind}.yaml")
        try:
            ready = await asyncio.to_thread(daemon.wait_ready, 900.0)
            await asyncio.sleep(2.0)
            idle = daemon.memory()
            start = time.monotonic()
            text = await _chat(daemon.port, daemon.model, args.max_new_tokens)
            chat_s = time.monotonic() - start
            loaded = daemon.memory()
        finally:
            daemon.stop()
    model_mb = _model_mb(spec)
    budget = (model_mb or 0.0) + (BUDGET_OVER_GGUF_MB if model_mb else BUDGET_NGRAM_MB)
    return {"ready_s": ready["ready_s"], "chat_s": round(chat_s, 1), "chat_text": text,
            "chat_same": text == chat_reply(served_target, CHAT, args.max_new_tokens),
            "idle_rss_mb": idle["rss"], "loaded_rss_mb": loaded["rss"],
            "peak_rss_mb": loaded["hwm"], "model_mb": model_mb, "budget_mb": budget}


async def _chat(port: int, model: str, max_tokens: int) -> str:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                timeout=600)
    try:
        done = await client.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                                    max_tokens=max_tokens)
    finally:
        await client.close()
    return done.choices[0].message.content or ""


def _model_mb(spec: str) -> float | None:
    """The drafter's model files in MB (a GGUF file, an ONNX export folder, as this host's
    cache holds them); None for ngram."""
    kind, _, inner = spec.partition(":")
    if not inner:
        return None
    path = Path(resolve_spec(DRAFTERS[kind]).partition(":")[2])
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return round(sum(p.stat().st_size for p in files) / MB, 1)


def _print(console, data: dict) -> None:
    steps = Table(title="sled lab arm-device: the steps")
    steps.add_column("step")
    steps.add_column("seconds", justify="right")
    for name, seconds in data["steps_s"].items():
        steps.add_row(name, f"{seconds:.1f}")
    console.print(steps)
    table = Table(title=f"Drafting for {data['target']} from the aarch64 root")
    for column in ("drafter", "generate = target", "chat = target", "generate s", "ready s",
                   "RSS idle MB", "RSS after chat MB", "peak MB", "budget MB"):
        table.add_column(column, justify="left" if column == "drafter" else "right")
    for run in data["runs"]:
        table.add_row(run["drafter"], _yes(run["generate_same"]), _yes(run["chat_same"]),
                      f"{run['generate_s']:.1f}", f"{run['ready_s']:.1f}",
                      f"{run['idle_rss_mb']:.0f}", f"{run['loaded_rss_mb']:.0f}",
                      f"{run['peak_rss_mb']:.0f}", f"{run['budget_mb']:.0f}")
    console.print(table)
    bare = data["bare_python_mb"]
    console.print(f"a Python that imports nothing: {bare['emulated']:.0f} MB in the root "
                  f"(qemu's translator included), {bare['host']:.0f} MB on this host")
    console.print("versions in the root: " + ", ".join(f"{name} {version}" for name, version
                                                      in data["versions"].items()))


def _yes(value: bool) -> str:
    return "yes" if value else "[red]no[/]"
