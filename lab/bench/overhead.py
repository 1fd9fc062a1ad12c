"""`sled bench overhead`: what one round costs beyond drafting and the target's forward pass.

A server process and device sessions on loopback; each round the device times drafting and the
round trip, the server reports its forward time. Overhead = round trip - server forward: gRPC,
serialisation, the event loops and the scheduler's queueing.
"""
from __future__ import annotations

import asyncio
import statistics

from lab.bench import harness
from lab.bench.report import percentile


def add_arguments(parser) -> None:
    from sled_cli.flags import positive_int

    parser.add_argument("--model", default=None, help="target path (default: a tiny random model)")
    parser.add_argument("--drafter", default="ngram", help="drafter spec (as sled generate)")
    parser.add_argument("--sessions", type=positive_int, default=1, help="concurrent device sessions")
    parser.add_argument("--rounds", type=positive_int, default=300, help="rounds per session (at least)")
    parser.add_argument("--draft-len", type=positive_int, default=4, help="tokens drafted per round")
    harness.add_out_flag(parser, "overhead")


def run(args) -> int:
    return harness.run_bench("overhead", bench, args)


async def bench(args) -> int:
    from lab.tiny import cached_pair

    console = harness.bench_console()
    model = args.model or cached_pair()[0]
    async with harness.serving(model) as served:
        stats = await _rounds(served, args, console)
        forward_passes = served.forward_passes()
        rounds_total = served.server.metric("sled_rounds_total")
    summary = _summary(stats, args, console)
    console.print(f"forward passes {forward_passes:.0f} for {rounds_total:.0f} rounds "
                  f"({forward_passes / rounds_total:.2f} passes per round)")
    harness.write_results(console, args.out, {
        "model": model, "drafter": args.drafter, "sessions": args.sessions,
        "draft_len": args.draft_len, "rounds": len(stats), "forward_passes": forward_passes,
        "summary": summary})
    return harness.DONE


async def _rounds(served, args, console) -> list:
    """--sessions devices generating from the tiny corpus until each has --rounds rounds."""
    from rich.progress import Progress

    from drafters import load_drafter
    from edge_client.session import RoundSettings, generate
    from lab.tiny import CORPUS

    conn, info = served.conn, served.info
    prompts = await served.prompt_ids(CORPUS[:7])
    stats = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("rounds", total=args.rounds * args.sessions)

        async def device(index: int) -> None:
            drafter = load_drafter(args.drafter)
            done = 0
            while done < args.rounds:
                result = await generate(conn.stub, drafter, prompts[(index + done) % len(prompts)],
                                        max_new_tokens=128, ignore_eos=True,
                                        settings=RoundSettings(draft_len=args.draft_len),
                                        target_fingerprint=info.tokenizer_fingerprint)
                stats.extend(result.round_stats)
                done += result.rounds
                progress.update(task, advance=result.rounds)

        await asyncio.gather(*(device(i) for i in range(args.sessions)))
    return stats


def _summary(stats: list, args, console) -> dict:
    """p50, p95 and mean of each per-round time, printed as a table."""
    from rich.table import Table

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
    return summary
