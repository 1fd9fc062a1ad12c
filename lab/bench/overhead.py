"""`sled bench overhead`: what one round costs beyond drafting and the target's forward pass.

A server process and device sessions on loopback; each round the device times drafting and the
round trip, the server reports its forward time. Overhead = round trip - server forward: gRPC,
serialisation, the event loops and the scheduler's queueing.
"""
from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def default_target() -> str:
    from sled.cache import cache_dir
    from lab.tiny import save_pair

    target, _ = save_pair(cache_dir() / "tiny")
    return str(target)


async def run_overhead(args) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from drafters import load_drafter
    from edge_client.connection import Connection
    from edge_client.session import generate
    from lab.server_process import ServerProcess
    from lab.tiny import CORPUS

    console = Console()
    model = args.model or default_target()
    stats = []
    async with ServerProcess(model) as server, Connection(server.address) as conn:
        info = await conn.model_info()
        tokenizer = await conn.tokenizer()
        prompts = [tokenizer(text).input_ids for text in CORPUS[:7]]
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("rounds", total=args.rounds * args.sessions)

            async def device(index: int) -> None:
                drafter = load_drafter(args.drafter)
                done = 0
                while done < args.rounds:
                    result = await generate(conn.stub, drafter, prompts[(index + done) % len(prompts)],
                                            max_new_tokens=128, draft_len=args.draft_len, ignore_eos=True,
                                            target_fingerprint=info.tokenizer_fingerprint)
                    stats.extend(result.round_stats)
                    done += result.rounds
                    progress.update(task, advance=result.rounds)

            await asyncio.gather(*(device(i) for i in range(args.sessions)))
        forward_passes = server.metric("sled_forward_passes_total")
        rounds_total = server.metric("sled_rounds_total")

    overhead = [s.round_trip_ms - s.forward_ms for s in stats]
    fraction = [(s.round_trip_ms - s.forward_ms) / (s.draft_ms + s.round_trip_ms) for s in stats]
    rows = {
        "round trip (ms)": [s.round_trip_ms for s in stats],
        "server forward (ms)": [s.forward_ms for s in stats],
        "server queue (ms)": [s.queue_ms for s in stats],
        "drafting (ms)": [s.draft_ms for s in stats],
        "overhead (ms)": overhead,
        "overhead / round": fraction,
    }
    table = Table(title=f"per-round overhead: {len(stats)} rounds, {args.sessions} session(s), "
                        f"drafter {args.drafter}, k={args.draft_len}")
    for column in ("", "p50", "p95", "mean"):
        table.add_column(column, justify="right" if column else "left")
    summary = {}
    for name, values in rows.items():
        p50, p95, mean = percentile(values, 50), percentile(values, 95), statistics.fmean(values)
        summary[name] = {"p50": p50, "p95": p95, "mean": mean}
        fmt = "{:.1%}" if name == "overhead / round" else "{:.2f}"
        table.add_row(name, fmt.format(p50), fmt.format(p95), fmt.format(mean))
    console.print(table)
    console.print(f"forward passes {forward_passes:.0f} for {rounds_total:.0f} rounds "
                  f"({forward_passes / rounds_total:.2f} passes per round)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "drafter": args.drafter, "sessions": args.sessions,
                               "draft_len": args.draft_len, "rounds": len(stats),
                               "forward_passes": forward_passes, "summary": summary}, indent=2))
    console.print(f"wrote {out}")
    return 0
