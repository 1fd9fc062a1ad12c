"""`sled demo`: a verify server and several devices on loopback, with a live table and a report.

It runs a tiny random target (no download) with two devices: one drafting with a transformers
model close to the target, one drafting by prompt lookup. Each output is checked against the
target's own greedy generate().
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

PROMPTS = ["def fib(n):", "for i in range(10):", "The server verifies", "class Session:"]


@dataclass
class DeviceRow:
    name: str
    drafter: str
    tokens: int = 0
    rounds: int = 0
    verified: int = 0
    accepted: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)


def _table(rows: list[DeviceRow], title: str):
    from rich.table import Table

    table = Table(title=title)
    for column in ("device", "drafter", "tokens", "rounds", "accepted", "tok/round", "tok/s"):
        table.add_column(column, justify="left" if column in ("device", "drafter") else "right")
    for r in rows:
        table.add_row(r.name, r.drafter, str(r.tokens), str(r.rounds),
                      f"{r.accepted / r.verified:.0%}" if r.verified else "-",
                      f"{r.tokens / r.rounds:.2f}" if r.rounds else "-",
                      f"{r.tokens / r.seconds:.1f}" if r.seconds else "-")
    return table


async def run_demo(args) -> int:
    import torch
    from rich.console import Console
    from rich.live import Live

    from drafters import load_drafter
    from edge_client.connection import Connection, cache_dir
    from edge_client.session import generate
    from sled_cli.procs import ServerProcess
    from sled_cli.tiny import save_pair

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    console = Console()
    target_dir, drafter_dir = save_pair(cache_dir() / "tiny")
    console.print(f"[bold]sled demo[/]: tiny random target {target_dir.name} (no download); "
                  "devices draft, one server verifies in batched passes")
    rows = [DeviceRow("device-1", f"hf:{drafter_dir.name}"), DeviceRow("device-2", "ngram")]
    specs = {rows[0].name: f"hf:{drafter_dir}", rows[1].name: "ngram"}
    async with ServerProcess(str(target_dir)) as server, Connection(server.address) as conn:
        info = await conn.model_info()
        tokenizer = await conn.tokenizer()
        prompts = [tokenizer(p).input_ids for p in PROMPTS]

        async def device(row: DeviceRow) -> None:
            drafter = load_drafter(specs[row.name])
            for prompt in prompts:
                started = time.perf_counter()
                result = await generate(conn.stub, drafter, prompt, max_new_tokens=args.max_new_tokens,
                                        draft_len=4, target_fingerprint=info.tokenizer_fingerprint,
                                        on_tokens=lambda t: setattr(row, "tokens", row.tokens + len(t)))
                row.seconds += time.perf_counter() - started
                row.rounds += result.rounds
                row.verified += result.draft_tokens
                row.accepted += result.accepted_tokens
                row.outputs.append(result.token_ids)

        with Live(_table(rows, "live"), console=console, refresh_per_second=8) as live:
            work = asyncio.gather(*(device(r) for r in rows))
            while not work.done():
                live.update(_table(rows, "live"))
                await asyncio.sleep(0.1)
            await work
            live.update(_table(rows, "final"))
        passes = server.metric("sled_forward_passes_total")

    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    identical = 0
    for row in rows:
        for prompt, output in zip(prompts, row.outputs):
            reference = target.generate(torch.tensor([prompt]), max_new_tokens=args.max_new_tokens,
                                        do_sample=False, pad_token_id=tokenizer.pad_token_id)
            identical += reference[0, len(prompt):].tolist() == output
    total_tokens = sum(r.tokens for r in rows)
    console.print(f"target forward passes: {passes:.0f} for {total_tokens} tokens "
                  f"({passes / total_tokens:.2f} per token; autoregressive serving needs 1.00)")
    console.print(f"lossless: {identical}/{len(rows) * len(prompts)} outputs identical to the "
                  "target's greedy generate()")
    return 0 if identical == len(rows) * len(prompts) else 1
