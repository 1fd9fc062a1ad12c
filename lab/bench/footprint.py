"""`sled bench footprint`: what the device daemon costs a small machine, per drafter and per
installed environment.

Against one `sled serve` (the target, from this environment), `sled device` runs with each
drafter in each environment: the one --python names (this one by default; --source runs a
source tree's code in it, e.g. a git worktree of an older commit), and slim venvs built with
only a device extra (--slim gguf,onnx; lab.slim_env). Per daemon:

- RSS (VmRSS) and its peak (VmHWM) from /proc at idle, once /health says ready, and after
  --requests concurrent /v1/completions of --max-tokens tokens each;
- seconds from starting the process to /health ready, and the model load in them (the
  drafter's sled.progress phases, logged by the daemon), so import-to-ready without the load;
- per environment, the size of site-packages, with and without llama-cpp-python.

A slim venv has no built-in model packages: its gguf:ALIAS and onnx:ALIAS drafters are given as
the files this environment resolves the alias to (the same model). --compare FILE puts an earlier
run's numbers (e.g. before a change) beside these, with ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from rich.markup import escape
from rich.table import Table

from drafters import resolve_spec
from lab import slim_env
from lab.bench import harness
from lab.bench.report import save_figure, short_name, subplots
from lab.server_process import free_port
from sled.flags import positive_int
from sled.models import resolve_model

DRAFTERS = "ngram,gguf:gemma3-270m,onnx:gemma3-270m"
# A drafter kind runs where its runtime is importable; ngram everywhere.
RUNTIME = {"gguf": "llama_cpp", "onnx": "onnxruntime_genai"}
# `sled device`, with sled.progress's phase times logged (the daemon logs at INFO otherwise).
DAEMON = ("import logging, sys; logging.getLogger('sled.progress').setLevel(logging.DEBUG); "
          "from sled_cli.main import main; sys.exit(main(sys.argv[1:]))")
PHASE = re.compile(r"sled\.progress DEBUG phase (\S+) (?:done in|stopped after) ([0-9.]+) s")
LOAD_PHASES = ("gguf.assemble", "drafter", "drafter.fingerprint")   # the model's, not the code's
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n",
           "Once upon a time", "def is_prime(n):", "SELECT name FROM", "class Stack:",
           "The three laws of"]
BUDGET_NGRAM_MB, BUDGET_OVER_GGUF_MB, BUDGET_READY_S, BUDGET_SLIM_MB = 120, 120, 2.0, 150
MB = 1e6
SLIM = ("gguf", "onnx", "none")     # the extras a device installs alone


def _no_extra(text: str) -> str:
    raise argparse.ArgumentTypeError(f"{text!r} is not a device extra (gguf, onnx or none)")


def add_arguments(parser) -> None:
    parser.add_argument("--target", default="gemma3-270m", help="the server's target alias or path")
    parser.add_argument("--drafters", default=DRAFTERS, help="drafter specs, comma-separated")
    parser.add_argument("--python", default=sys.executable,
                        help="the environment to measure besides the slim ones (its python)")
    parser.add_argument("--source", default=None, help="run this source tree's code with "
                        "--python (default: the code installed there)")
    parser.add_argument("--label", default="full", help="the name of --python's environment")
    parser.add_argument("--slim", default="gguf,onnx", type=harness.listed(_no_extra, *SLIM),
                        help="build a venv with only this extra, per extra (comma-separated: "
                        "gguf, onnx; none: no slim venv)")
    parser.add_argument("--venvs", default=None, help="folder for the slim venvs, reused when "
                        "there (default: a temporary one)")
    parser.add_argument("--requests", type=positive_int, default=8, help="concurrent requests")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="tokens per request")
    parser.add_argument("--reps", type=positive_int, default=1,
                        help="starts per daemon; the fastest start to ready is kept")
    parser.add_argument("--compare", default=None, help="an earlier run's JSON to set beside")
    harness.add_out_flag(parser, "footprint")


def run(args) -> int:
    return harness.run_bench("footprint", bench, args)


@dataclass
class Env:
    """One installed environment a daemon runs from."""
    name: str
    python: str
    source: str | None = None
    extras: str = "all"
    size: dict = field(default_factory=dict)
    modules: dict = field(default_factory=dict)


async def bench(args) -> int:
    console = harness.bench_console(150)
    specs = [spec.strip() for spec in args.drafters.split(",") if spec.strip()]
    compare = _load_compare(args.compare)
    _check_paths(args)
    with tempfile.TemporaryDirectory(prefix="sled-footprint-") as scratch:
        envs = _environments(args, Path(args.venvs or scratch), console)
        async with harness.serving(resolve_model(args.target), console=console,
                                   status=f"starting the verify server ({args.target})") as served:
            runs = [await _measure(env, spec, served.server.address, args, console, scratch)
                    for env in envs for spec in specs if _runs_in(env, spec, console)]
    data = {"target": args.target, "requests": args.requests, "max_tokens": args.max_tokens,
            "reps": args.reps, "machine": _machine(),
            "envs": {env.name: {"python": env.python, "source": env.source, "extras": env.extras,
                                "modules": env.modules, **env.size} for env in envs},
            "runs": runs}
    _print(console, data, compare)
    harness.write_results(console, args.out, data, lambda png: _plot(data, compare, png))
    return harness.DONE


def _check_paths(args) -> None:
    """A --python or --source that is not there stops the bench before anything starts (exit 2)."""
    if not Path(args.python).is_file():
        raise harness.Stop(f"--python {args.python}: no such file")
    if args.source is not None and not (Path(args.source) / "edge_client").is_dir():
        raise harness.Stop(f"--source {args.source}: not a sled source tree (no edge_client in it)")


def _environments(args, venvs: Path, console) -> list[Env]:
    """--python's environment, then a slim venv per --slim extra (built, or reused in --venvs)."""
    envs = [Env(args.label, args.python, args.source)]
    extras = [e.strip() for e in args.slim.split(",") if e.strip() and e.strip() != "none"]
    for extra in extras:
        with console.status(escape(f"building a venv with sled[{extra}] (pip's cache; "
                                   "minutes the first time)")):
            try:
                source = args.source or slim_env.REPO
                python = slim_env.build(venvs / f"slim-{extra}", extra, source)
            except (slim_env.BuildError, subprocess.TimeoutExpired) as exc:
                raise harness.Stop(f"the slim venv sled[{extra}]: {exc}") from None
        envs.append(Env(f"slim {extra}", str(python), None, extra))
    for env in envs:
        with console.status(f"sizing {env.name}"):
            env.size = slim_env.environment_size(env.python)
            env.modules = slim_env.importable(env.python, ["torch", "transformers",
                                                           *RUNTIME.values()])
        console.print(f"{env.name}: site-packages {env.size['site_packages_mb']:.0f} MB "
                      f"({env.size['without_llama_cpp_mb']:.0f} MB without llama-cpp-python); "
                      f"torch {'yes' if env.modules['torch'] else 'no'}, transformers "
                      f"{'yes' if env.modules['transformers'] else 'no'}")
    return envs


def _runs_in(env: Env, spec: str, console) -> bool:
    runtime = RUNTIME.get(spec.partition(":")[0])
    if runtime is None or env.modules.get(runtime):
        return True
    console.print(f"[dim]{env.name}: {spec} skipped ({runtime} is not installed there)[/]")
    return False


def _daemon_spec(env: Env, spec: str) -> str:
    """The spec as this environment can load it: in a venv without the built-in model packages
    an alias is given as the file (or export folder) it resolves to here."""
    kind, _, arg = spec.partition(":")
    if env.extras == "all" or kind not in RUNTIME or "/" in arg:
        return spec
    return resolve_spec(spec)


async def _measure(env: Env, spec: str, address: str, args, console, scratch: str) -> dict:
    """Start the daemon --reps times (the fastest start is kept); on the last start its RSS at
    idle and after the concurrent requests."""
    daemon_spec = _daemon_spec(env, spec)
    if daemon_spec != spec:
        console.print(f"{env.name}: {spec} given as {daemon_spec} (the built-in aliases need "
                      "the models extra; the same model)")
    starts = []
    for rep in range(args.reps):
        with console.status(f"{env.name}: sled device with {spec} (start {rep + 1}/{args.reps})"):
            daemon = Daemon(env, daemon_spec, address, Path(scratch) / f"device-{rep}.yaml")
            try:
                starts.append(await asyncio.to_thread(daemon.wait_ready))
                if rep == args.reps - 1:
                    await asyncio.sleep(2.0)                      # settled after start-up
                    idle = daemon.memory()
                    await _load(daemon.port, daemon.model, args.requests, args.max_tokens)
                    loaded = daemon.memory()
            finally:
                daemon.stop()
    best = min(starts, key=lambda start: start["ready_s"])
    result = {"env": env.name, "drafter": spec, "spec": daemon_spec, **best,
              "idle_rss_mb": idle["rss"], "idle_hwm_mb": idle["hwm"],
              "loaded_rss_mb": loaded["rss"], "loaded_hwm_mb": loaded["hwm"],
              "model_file_mb": _model_mb(daemon_spec)}
    console.print(f"{env.name} {spec}: idle {idle['rss']:.0f} MB, after {args.requests} requests "
                  f"{loaded['rss']:.0f} MB (peak {loaded['hwm']:.0f}); ready in "
                  f"{best['ready_s']:.2f} s ({best['load_s']:.2f} s of it the model load)")
    return result


class Daemon:
    """`sled device` from ENV with a drafter against a server; stderr read as it comes."""

    def __init__(self, env: Env, spec: str, address: str, config: Path) -> None:
        self.port = free_port()
        config.write_text(json.dumps({"id": "footprint", "servers": [address], "drafter": spec,
                                      "host": "127.0.0.1", "port": self.port}))   # JSON is YAML
        # Run where no sled code lies (python -c puts the working folder first on sys.path), so
        # an environment runs its own installed copy, or --source's.
        environ = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        if env.source:
            environ["PYTHONPATH"] = env.source
        self.lines: list[str] = []
        self.model = ""
        self.started = time.monotonic()
        self.proc = subprocess.Popen([env.python, "-c", DAEMON, "device", "--config", str(config)],
                                     cwd=env.source or config.parent, env=environ,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_ready(self, timeout: float = 300.0) -> dict:
        """Seconds to /health ready, the model load among them and every phase's seconds."""
        while time.monotonic() - self.started < timeout:
            if self.proc.poll() is not None:
                tail = [line for line in self.lines if line.strip()][-1:] or ["no message"]
                raise harness.Stop(f"sled device stopped: {tail[0]}", harness.SERVER_FAILED)
            status = self._health()
            if status.get("state") == "ready":
                ready = time.monotonic() - self.started
                self.model = status["model"]
                phases = self.phases()
                load = sum(phases.get(key, 0.0) for key in LOAD_PHASES)
                return {"ready_s": round(ready, 3), "load_s": round(load, 3),
                        "ready_without_load_s": round(ready - load, 3), "phases": phases}
            time.sleep(0.05)
        raise harness.Stop("sled device was not ready in time", harness.SERVER_FAILED)

    def _health(self) -> dict:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                return json.loads(reply.read())
        except (OSError, ValueError):
            return {}

    def phases(self) -> dict:
        seconds: dict[str, float] = {}
        for line in self.lines:
            if found := PHASE.search(line):
                seconds[found[1]] = round(seconds.get(found[1], 0.0) + float(found[2]), 3)
        return seconds

    def memory(self) -> dict:
        """VmRSS and VmHWM of the daemon's process, MB."""
        fields = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = round(int(value.split()[0]) * 1024 / MB, 1)
        return {"rss": fields["VmRSS"], "hwm": fields["VmHWM"]}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _load(port: int, model: str, requests: int, max_tokens: int) -> None:
    """REQUESTS greedy /v1/completions at once, each MAX_TOKENS tokens."""
    async def one(session, prompt: str) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as reply:
            if reply.status != 200:
                text = (await reply.text())[:300]
                raise harness.Stop(f"the device answered {reply.status}: {text}",
                                   harness.SERVER_FAILED)
            await reply.read()

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, PROMPTS[i % len(PROMPTS)]) for i in range(requests)))


def _model_mb(spec: str) -> float | None:
    """The size of a gguf: drafter's file (the budget is relative to it), MB."""
    kind, _, arg = spec.partition(":")
    if kind != "gguf":
        return None
    path = Path(resolve_spec(spec).partition(":")[2])
    return round(path.stat().st_size / MB, 1) if path.exists() else None


def _machine() -> str:
    return f"{os.cpu_count()} cores, {sys.platform}, python {sys.version.split()[0]}"


def _load_compare(path: str | None) -> dict | None:
    if path is None:
        return None
    with harness.flag_errors():
        return json.loads(Path(path).read_text())


def budget(run: dict) -> list[str]:
    """The device budgets (BENCHMARKS.md, "Device footprint") this run misses (empty: all met)."""
    missed = []
    if run["drafter"] == "ngram" and run["idle_rss_mb"] > BUDGET_NGRAM_MB:
        missed.append(f"RSS > {BUDGET_NGRAM_MB}")
    if run.get("model_file_mb") and run["idle_rss_mb"] > run["model_file_mb"] + BUDGET_OVER_GGUF_MB:
        missed.append(f"RSS > file + {BUDGET_OVER_GGUF_MB}")
    if run["ready_without_load_s"] > BUDGET_READY_S:
        missed.append(f"ready > {BUDGET_READY_S:g} s")
    return missed


def _rows(data: dict, compare: dict | None) -> list[tuple[dict, dict | None]]:
    """Each run with the earlier run of the same drafter (the compared file's first environment)."""
    earlier = {}
    if compare:
        first = next(iter(compare["envs"]), None)
        earlier = {r["drafter"]: r for r in compare["runs"] if r["env"] == first}
    return [(run, earlier.get(run["drafter"])) for run in data["runs"]]


def _print(console, data: dict, compare: dict | None) -> None:
    title = (f"sled device footprint against {short_name(data['target'])}: {data['requests']} "
             f"concurrent requests of {data['max_tokens']} tokens ({data['machine']})")
    table = Table(title=title)
    columns = ["environment", "drafter", "idle RSS MB", "peak after load MB", "ready s",
               "model load s", "ready w/o load s", "budgets"]
    if compare:
        columns[2:2] = ["earlier idle MB", "idle ratio"]
        columns[-1:-1] = ["earlier w/o load s"]
    for name in columns:
        table.add_column(name, justify="left" if name in ("environment", "drafter", "budgets")
                         else "right")
    for run, old in _rows(data, compare):
        cells = [run["env"], short_name(run["drafter"]), f"{run['idle_rss_mb']:.0f}",
                 f"{run['loaded_hwm_mb']:.0f}", f"{run['ready_s']:.2f}", f"{run['load_s']:.2f}",
                 f"{run['ready_without_load_s']:.2f}",
                 "; ".join(budget(run)) or "[green]met[/]"]
        if compare:
            cells[2:2] = _earlier_cells(run, old)[:2]
            cells[-1:-1] = _earlier_cells(run, old)[2:]
        table.add_row(*cells)
    console.print(table)
    _print_sizes(console, data, compare)


def _earlier_cells(run: dict, old: dict | None) -> list[str]:
    if old is None:
        return ["-", "-", "-"]
    return [f"{old['idle_rss_mb']:.0f}", f"{run['idle_rss_mb'] / old['idle_rss_mb']:.2f}x",
            f"{old['ready_without_load_s']:.2f}"]


def _print_sizes(console, data: dict, compare: dict | None) -> None:
    table = Table(title="installed environment (site-packages, MB)")
    for name in ("environment", "torch", "transformers", "total", "without llama-cpp-python",
                 "budget", "largest"):
        table.add_column(name, justify="right" if name in ("total", "without llama-cpp-python")
                         else "left")
    envs = dict(data["envs"])
    if compare:
        envs.update({f"{name} (earlier)": env for name, env in compare["envs"].items()})
    for name, env in envs.items():
        slim = env["extras"] != "all"
        within = env["without_llama_cpp_mb"] <= BUDGET_SLIM_MB
        verdict = ("[green]met[/]" if within else f"> {BUDGET_SLIM_MB} MB") if slim else "-"
        largest = ", ".join(f"{n} {mb:.0f}" for n, mb in env["largest"][:4])
        table.add_row(name, _yes(env["modules"]["torch"]), _yes(env["modules"]["transformers"]),
                      f"{env['site_packages_mb']:.0f}", f"{env['without_llama_cpp_mb']:.0f}",
                      verdict, largest)
    console.print(table)


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def _plot(data: dict, compare: dict | None, png: Path) -> None:
    """Idle RSS and ready-without-load per drafter, a bar per environment (earlier ones first)."""
    runs = (compare["runs"] if compare else []) + data["runs"]
    labels = [(f"{r['env']} (earlier)" if compare and i < len(compare["runs"]) else r["env"])
              for i, r in enumerate(runs)]
    drafters = list(dict.fromkeys(short_name(r["drafter"]) for r in runs))
    envs = list(dict.fromkeys(labels))
    fig, axes = subplots(2, (11, 4))
    width = 0.8 / max(len(envs), 1)
    for axis, key, unit in ((axes[0], "idle_rss_mb", "idle RSS, MB"),
                            (axes[1], "ready_without_load_s", "start to /health without load, s")):
        for j, env in enumerate(envs):
            values = {short_name(r["drafter"]): r[key] for r, label in zip(runs, labels)
                      if label == env}
            xs = [i + j * width for i, d in enumerate(drafters) if d in values]
            axis.bar(xs, [values[d] for d in drafters if d in values], width, label=env)
        axis.set_xticks([i + width * (len(envs) - 1) / 2 for i in range(len(drafters))], drafters)
        axis.set_ylabel(unit)
    save_figure(fig, axes, png, f"sled device footprint ({data['machine']})")
