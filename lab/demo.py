"""The loopback demo (`sled demo`): the offline default end to end.

A server verifies with the gemma3-270m target (the registry GGUF, dequantized into
transformers); three device processes draft for it with the same model family through three
edge runtimes: llama.cpp (GGUF), onnxruntime-genai (int4 ONNX) and prompt lookup (n-gram). They
work through HumanEval prompts while a live table shows each device; then the same prompts are
served centrally (the target alone, every session batched) as the baseline, and every device's
output is checked against it token for token. Last, the same kind of fleet against an H200
serving an 8B model on the fleet simulator (lab.demo_simulated), labelled as simulated.
"""
from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.table import Table

from drafters.onnx_export import export_alias
from lab.bench.harness import serving
from lab.demo_simulated import run_simulated, simulated_notes, simulated_table
from lab.workload import load_workload
from sled.models import gguf_path, hf_checkpoint
from verify_server.centralized import generate_centralized
from verify_server.engines import make_engine
from verify_server.target import Target

TARGET = "gemma3-270m"
DEVICES = {"pi-gguf": f"gguf:{TARGET}", "jetson-onnx": f"onnx:{TARGET}", "thin-ngram": "ngram"}


@dataclass
class DeviceRow:
    name: str
    drafter: str
    state: dict = field(default_factory=dict)

    def get(self, key: str, default=0):
        return self.state.get(key, default)


def _table(rows: list[DeviceRow], title: str):
    table = Table(title=title)
    # passes/tok: target passes this device's tokens needed (one per round; 1.00 without drafts)
    for column in ("device", "drafter", "tokens", "accept", "acc/round", "passes/tok", "tok/s"):
        table.add_column(column, justify="left" if column in ("device", "drafter") else "right")
    for r in rows:
        rounds, verified, seconds = r.get("rounds"), r.get("verified"), r.get("seconds", 0.0)
        tokens = r.get("tokens")
        table.add_row(r.name, r.drafter, str(tokens),
                      f"{r.get('accepted') / verified:.0%}" if verified else "-",
                      f"{r.get('accepted') / rounds:.2f}" if rounds else "-",
                      f"{rounds / tokens:.2f}" if tokens else "-",
                      f"{tokens / seconds:.1f}" if seconds else "-")
    return table


async def _device(row: DeviceRow, server: str, workload: str, max_new: int) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sled_cli.main", "run-device", "--server", server, "--drafter",
        row.drafter, "--workload", workload, "--max-new-tokens", str(max_new), "--name", row.name,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async for line in proc.stdout:
        row.state = json.loads(line)
    if await proc.wait() != 0:
        err = (await proc.stderr.read()).decode(errors="replace")[-1500:]
        raise RuntimeError(f"{row.name} ({row.drafter}) failed: {row.state.get('error') or err}")


async def run_demo(prompts: int, max_new_tokens: int, simulated_devices: int = 512) -> int:
    """The demo on `prompts` HumanEval prompts per device, then the simulated H200 with 3 and
    `simulated_devices` devices; 1 if any output differs from the target alone (or from its
    script, simulated)."""
    console = Console()
    _prepare(console)
    workload = f"humaneval:{prompts}"
    rows = [DeviceRow(name, spec) for name, spec in DEVICES.items()]
    async with serving(TARGET, console=console) as served:
        await _devices(console, rows, served.server.address, workload, max_new_tokens)
        passes = served.forward_passes()
        prompt_ids = await served.prompt_ids(load_workload(workload))
    with console.status("serving the same prompts centrally (baseline)"):
        baseline = _centralized(TARGET, load_workload(workload), len(rows), max_new_tokens)
    _report(console, rows, passes, baseline)
    with console.status(f"simulating 3 and {simulated_devices} devices against an H200"):
        simulated = await run_simulated(_acceptance(rows), prompt_ids, max_new_tokens,
                                        (len(rows), simulated_devices))
    console.print(simulated_table(simulated))
    for line in simulated_notes(simulated):
        console.print(line, highlight=False)
    lossless = all(_lossless(r, baseline) for r in rows)
    return 0 if lossless and not any(r["mismatches"] for r in simulated.rows) else 1


def _acceptance(rows: list[DeviceRow]) -> dict[str, float]:
    """Each device's drafter and the share of its drafted tokens the target accepted."""
    return {r.drafter: r.get("accepted") / r.get("verified") if r.get("verified") else 0.0
            for r in rows}


def _prepare(console) -> None:
    """The target's three forms, made on first use: GGUF, transformers copy, ONNX export."""
    console.rule(f"sled demo: {TARGET} target, three edge drafters, HumanEval on loopback")
    console.print(f"GGUF  {gguf_path(TARGET)}")
    console.print(f"HF    {hf_checkpoint(TARGET)}")
    console.print(f"ONNX  {export_alias(TARGET)}")


async def _devices(console, rows: list[DeviceRow], address: str, workload: str,
                   max_new_tokens: int) -> None:
    """The device processes at once, under a live table of their progress."""
    with Live(_table(rows, "devices (live)"), console=console, refresh_per_second=4) as live:
        work = asyncio.gather(*(_device(r, address, workload, max_new_tokens) for r in rows))
        while not work.done():
            live.update(_table(rows, "devices (live)"))
            await asyncio.sleep(0.25)
        await work
        live.update(_table(rows, "devices"))


@dataclass
class Baseline:
    outputs: list[list[int]]      # per prompt (every device asked for the same ones)
    tokens: int = 0               # generated for all devices together
    forward_passes: int = 0
    seconds: float = 0.0


def _centralized(alias: str, prompts: list[str], devices: int, max_new: int) -> Baseline:
    """The same workload served by the target alone: each device's requests one after another,
    the devices' concurrent requests batched together."""

    target = Target.load(str(hf_checkpoint(alias)))
    engine = make_engine(target.model, kv_budget_bytes=1 << 30)
    baseline = Baseline(outputs=[])
    for prompt in prompts:
        run = generate_centralized(engine, [target.tokenizer(prompt).input_ids] * devices, max_new,
                                   target.eos_ids)
        baseline.outputs.append(run.outputs[0])
        baseline.tokens += run.tokens
        baseline.forward_passes += run.forward_passes
        baseline.seconds += run.seconds
    return baseline


def _lossless(row: DeviceRow, baseline: Baseline) -> bool:
    outputs = row.get("outputs", [])
    return bool(outputs) and outputs == baseline.outputs[: len(outputs)]


def _report(console, rows: list[DeviceRow], passes: float, baseline: Baseline) -> None:
    tokens = sum(r.get("tokens") for r in rows)
    seconds = max(r.get("seconds", 0.0) for r in rows)
    table = Table(title="sled vs centralized serving (same prompts, same target)")
    for column in ("", "tokens", "wall s", "tok/s", "passes/token"):
        table.add_column(column, justify="right" if column else "left")
    table.add_row("sled: devices draft, server verifies", str(tokens), f"{seconds:.1f}",
                  f"{tokens / seconds:.1f}", f"{passes / tokens:.3f}")
    table.add_row("centralized: target alone, batched", str(baseline.tokens),
                  f"{baseline.seconds:.1f}", f"{baseline.tokens / baseline.seconds:.1f}",
                  f"{baseline.forward_passes / baseline.tokens:.3f}")
    console.print(table)
    for r in rows:
        verdict = "identical" if _lossless(r, baseline) else "DIFFERENT"
        console.print(f"{r.name:12} output vs the target alone: {verdict}")
    console.print("passes/token: target forward passes per generated token, all devices together. "
                  "Per device, one pass verifies a whole draft (see acc/round). Here the devices' "
                  "drafting shares this machine's cores with the server, so wall-clock favours the "
                  "baseline; on real hardware the drafting runs on the devices.")
