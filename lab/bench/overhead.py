"""`sled bench overhead`: what one round costs beyond drafting and the target's forward pass.

A server process and device sessions on loopback; each round the device times drafting and the
round trip, the server reports its forward time. Overhead = round trip - server forward: gRPC,
serialisation, the event loops and the scheduler's queueing.

--access runs the same rounds once per way of reaching the server, each against a server of its
own, one after the other in one run: plain (plaintext, anyone), tls (the server's certificate),
mtls (mutual TLS and a device token pinned to the device's certificate, what a secured fleet
runs; certificates from sled certs in a temporary folder). The table then sets each overhead
beside plain's.
"""
from __future__ import annotations

import asyncio
import statistics
import tempfile
from pathlib import Path

from rich.progress import Progress
from rich.table import Table

from drafters import bind_target_tokenizer, load_drafter
from edge_client.security import ChannelSecurity
from edge_client.session import RoundSettings, Target, generate
from edge_client.wire import SessionRequest
from lab.bench import harness
from lab.bench.report import percentile
from lab.tiny import CORPUS, cached_pair
from sled.flags import positive_int
from sled.pki import make_certs


def add_arguments(parser) -> None:
    harness.add_target_flags(parser, model_help="target path (default: a tiny random model)",
                             dtype_help=None)
    parser.add_argument("--drafter", default="ngram", help="drafter spec (as sled generate)")
    parser.add_argument("--sessions", type=positive_int, default=1, help="concurrent device sessions")
    parser.add_argument("--rounds", type=positive_int, default=300, help="rounds per session (at least)")
    parser.add_argument("--draft-len", type=positive_int, default=4, help="tokens drafted per round")
    parser.add_argument("--access", type=access_modes, default=["plain"], metavar="MODES",
                        help="comma-separated, each run side by side: plain, tls, mtls (mutual "
                             "TLS + a pinned device token) (default: plain)")
    harness.add_out_flag(parser, "overhead")


def run(args) -> int:
    return harness.run_bench("overhead", bench, args)


ACCESS_MODES = ("plain", "tls", "mtls")


def access_modes(text: str) -> list[str]:
    modes = [mode.strip() for mode in text.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in ACCESS_MODES]
    if not modes or unknown or len(set(modes)) != len(modes):
        raise ValueError(f"--access takes distinct names from {', '.join(ACCESS_MODES)}, "
                         f"comma-separated; got {text!r}")
    return modes


async def bench(args) -> int:
    console = harness.bench_console()
    model = args.model or cached_pair()[0]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="sled-overhead-") as folder:
        for mode in args.access:
            flags, security = _access(mode, Path(folder))
            async with harness.serving(model, flags, security=security) as served:
                stats = await _rounds(served, args, console)
                passes, rounds = served.forward_passes(), served.server.metric("sled_rounds_total")
            console.print(f"[bold]{mode}[/bold]: forward passes {passes:.0f} for {rounds:.0f} "
                          f"rounds ({passes / rounds:.2f} passes per round)")
            runs[mode] = {"rounds": len(stats), "forward_passes": passes,
                          "summary": _summary(stats, args, console, mode)}
    if len(runs) > 1:
        _compare(console, runs)
    first = runs[args.access[0]]
    harness.write_results(console, args.out, {
        "model": model, "drafter": args.drafter, "sessions": args.sessions,
        "draft_len": args.draft_len, **first, "access": runs})
    return harness.DONE


def _access(mode: str, folder) -> tuple[list[str], object]:
    """The server flags and the device's ChannelSecurity of one access mode."""
    if mode == "plain":
        return [], None
    pki = make_certs(folder, ["bench-device"])
    flags = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    if mode == "tls":
        return flags, ChannelSecurity.from_files(pki.ca)
    device = pki.device_files("bench-device")
    flags += ["--tls-client-ca", str(pki.ca), "--auth-tokens", str(pki.tokens)]
    return flags, ChannelSecurity.from_files(pki.ca, device.cert, device.key,
                                             device.token.read_text().strip())


def _compare(console, runs: dict) -> None:
    """Each mode's round trip and overhead beside the first mode's (p50 and mean)."""
    base_name, base = next(iter(runs.items()))
    table = Table(title=f"access: each against {base_name} (same rounds, one run)")
    for column in ("access", "round trip p50 (ms)", "overhead p50 (ms)", "overhead mean (ms)",
                   f"overhead p50 / {base_name}"):
        table.add_column(column, justify="right" if column != "access" else "left")
    for name, run in runs.items():
        overhead, trip = run["summary"]["overhead (ms)"], run["summary"]["round trip (ms)"]
        ratio = overhead["p50"] / base["summary"]["overhead (ms)"]["p50"]
        run["overhead_p50_ratio"] = ratio
        table.add_row(name, f"{trip['p50']:.2f}", f"{overhead['p50']:.2f}",
                      f"{overhead['mean']:.2f}", f"x{ratio:.2f}")
    console.print(table)


async def _rounds(served, args, console) -> list:
    """--sessions devices generating from the tiny corpus until each has --rounds rounds."""
    conn, info = served.conn, served.info
    prompts = await served.prompt_ids(CORPUS[:7])
    tokenizer = await conn.tokenizer()
    stats = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("rounds", total=args.rounds * args.sessions)

        async def device(index: int) -> None:
            drafter = load_drafter(args.drafter)
            bind_target_tokenizer(drafter, tokenizer)
            done = 0
            while done < args.rounds:
                result = await generate(conn.stub, drafter,
                                        SessionRequest(prompts[(index + done) % len(prompts)],
                                                       max_new_tokens=128, ignore_eos=True),
                                        settings=RoundSettings(draft_len=args.draft_len),
                                        target=Target(fingerprint=info.tokenizer_fingerprint))
                stats.extend(result.round_stats)
                done += result.rounds
                progress.update(task, advance=result.rounds)

        await asyncio.gather(*(device(i) for i in range(args.sessions)))
    return stats


def _summary(stats: list, args, console, mode: str = "plain") -> dict:
    """p50, p95 and mean of each per-round time, printed as a table."""
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
    table = Table(title=f"per-round overhead ({mode}): {len(stats)} rounds, {args.sessions} "
                        f"session(s), drafter {args.drafter}, k={args.draft_len}")
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
