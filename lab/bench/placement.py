"""`sled bench placement`: a server that moves sessions as its load changes, with real processes.

`sled serve --placement latency` runs as a process of its own; the devices run here, on loopback,
each drafting with the tiny pair's drafter. They join and leave in waves, so that the server's
load goes up and down during the run:

    0 .. T      --base devices, each starting one session after another
    T .. 2T     every one of --devices
    2T .. 3T    --base devices again (the others finish the session they are in, then leave)

Every output is held to the target's own generate() (with --seeded: sampled, each session with a
seed of its own, and held to what a --placement fixed server gives the same prompt and seed),
and each session's moves (Opened and Verdict.placement) and tokens by placement are counted.
Exit 1 when an output differs.

    sled bench placement --devices 16 --base 2 --phase-s 6
    sled bench placement --model gemma3-270m --drafter ngram    # steps that grow with rows

The tiny target's steps on a CPU are mostly the host's own work, so its load hardly moves; a
target whose steps grow with their rows (Gemma 3 270M on this CPU, any target on a GPU) takes
the server past HIGH at the peak, and sessions go back to their devices.
"""
from __future__ import annotations

import asyncio
from collections import Counter

from rich.table import Table

from drafters import bind_target_tokenizer, load_drafter
from edge_client.session import RoundSettings, Target, generate
from edge_client.wire import SessionRequest
from lab.bench import harness
from lab.oracle import greedy_ids, load_target
from lab.tiny import CORPUS, cached_pair
from sled import clock
from sled.flags import positive_float, positive_int
from sled.models import resolve_model
from sled.wire.sampling import Sampling
from verify_server.flags import served_settings


def add_arguments(parser) -> None:
    harness.add_server_flags(parser, model_help="target alias or path (default: the tiny pair's "
                                                "target)")
    parser.add_argument("--drafter", default=None,
                        help="each device's drafter (default: the tiny pair's drafter; with "
                             "--model, e.g. ngram or a GGUF alias)")
    parser.add_argument("--devices", type=positive_int, default=16, help="devices at the peak")
    parser.add_argument("--base", type=positive_int, default=2,
                        help="devices before and after the peak")
    parser.add_argument("--phase-s", type=positive_float, default=6.0,
                        help="seconds of each phase (light, peak, light)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=160,
                        help="tokens of each session")
    parser.add_argument("--placement", default="latency", choices=("latency", "gpu"),
                        help="the server's --placement")
    parser.add_argument("--seeded", action="store_true",
                        help="sample (temperature 0.8, top-k 20) with a seed per session, and "
                             "hold each output to a --placement fixed server's for the same "
                             "prompt and seed (default: greedy, held to generate())")
    harness.add_out_flag(parser, "placement")


def run(args) -> int:
    return harness.run_bench("placement", bench, args)


async def bench(args) -> int:
    console = harness.bench_console()
    target, drafter = _pair(args)
    server_args = ["--placement", args.placement, *harness.server_flags(args)]
    async with harness.serving(target, server_args, console=console) as served:
        tokenizer = await served.conn.tokenizer()
        prompts = [tokenizer(text).input_ids for text in CORPUS]
        loads: list[tuple[float, float]] = []
        sampler = asyncio.create_task(_sample_load(served.server, loads))
        try:
            sessions = await _waves(served, args, prompts, drafter, tokenizer, console)
        finally:
            sampler.cancel()
        moves = sum(_labelled(served.server, "sled_placement_moves_total", f'to="{to}"')
                    for to in ("device", "server", "server_sat"))
    references = await _references(args, sessions, target, drafter, server_args, console)
    wrong = [s for s in sessions if s["tokens"] != references[_key(s)]]
    _table(console, sessions, loads, args)
    moved = sum(1 for s in sessions if s["moves"])
    oracle = "a fixed-placement server's" if args.seeded else "generate()"
    console.print(f"{len(sessions)} sessions, {moved} moved at least once, "
                  f"{sum(s['moves'] for s in sessions)} moves ({moves:.0f} by the server's "
                  f"count); outputs equal to {oracle}: {len(sessions) - len(wrong)} of "
                  f"{len(sessions)}")
    harness.write_results(console, args.out, {
        "target": target, "drafter": drafter,
        "devices": args.devices, "base": args.base, "phase_s": args.phase_s,
        "placement": args.placement, "max_new_tokens": args.max_new_tokens,
        "seeded": args.seeded,
        "sessions": [{k: v for k, v in s.items() if k not in ("prompt", "tokens")}
                     for s in sessions],
        "loads": [[round(t, 2), round(v, 3)] for t, v in loads],
        "moved": moved, "identical": len(sessions) - len(wrong)})
    return harness.DONE if not wrong else 1


def _key(session: dict) -> tuple:
    return tuple(session["prompt"]), session["seed"]


async def _references(args, sessions: list[dict], target: str, drafter: str,
                      server_args: list[str], console) -> dict:
    """Each session's expected output, by (prompt, seed): greedy, the target's generate();
    seeded, what a --placement fixed server gives the same prompt and seed (one session at a
    time, the same drafter)."""
    keys = list(dict.fromkeys(_key(s) for s in sessions))
    if not args.seeded:
        served_target = load_target(target, settings=served_settings(target, server_args))
        with console.status("the target's own generate() for every prompt"):
            return {key: greedy_ids(served_target, list(key[0]), args.max_new_tokens)
                    for key in keys}
    fixed_args = ["--placement", "fixed", *harness.server_flags(args)]
    async with harness.serving(target, fixed_args, console=console,
                               status="starting a --placement fixed server") as fixed:
        tokenizer = await fixed.conn.tokenizer()
        drafter_model = load_drafter(drafter)
        bind_target_tokenizer(drafter_model, tokenizer)
        info = Target(fingerprint=fixed.fingerprint)
        references = {}
        with console.status(f"{len(keys)} sessions again on the fixed-placement server"):
            for prompt, seed in keys:
                result = await generate(fixed.stub, drafter_model,
                                        _request(list(prompt), seed, args),
                                        settings=RoundSettings(draft_len=4), target=info)
                references[(prompt, seed)] = result.token_ids
    return references


def _request(prompt: list[int], seed: int | None, args) -> SessionRequest:
    """One session's request: greedy, or sampled with its own seed."""
    sampling = Sampling(temperature=0.8, top_k=20, seed=seed) if seed is not None else Sampling()
    return SessionRequest(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling)


def _pair(args) -> tuple[str, str]:
    """The server's target and the devices' drafter spec: the tiny pair unless --model."""
    if args.model is None:
        target, drafter_dir = cached_pair()
        return target, args.drafter or f"hf:{drafter_dir}"
    if args.drafter is None:
        raise harness.Stop("--model needs --drafter (e.g. ngram): the tiny pair's drafter "
                           "speaks the tiny target's vocabulary only", harness.BAD_FLAGS)
    return resolve_model(args.model), args.drafter


async def _waves(served, args, prompts, drafter_spec, tokenizer, console) -> list[dict]:
    """Every device's sessions: the base devices for the three phases, the others for the
    peak (a session they are in when it ends runs to its end)."""
    started = clock.now()
    info = Target(fingerprint=served.fingerprint)
    sessions: list[dict] = []

    async def device(index: int, joins: float, leaves: float) -> None:
        drafter = load_drafter(drafter_spec)
        bind_target_tokenizer(drafter, tokenizer)
        await asyncio.sleep(joins)
        n = 0
        while clock.now() - started < leaves:
            prompt = prompts[(index * 3 + n) % len(prompts)]
            seed = index * 1000 + n if args.seeded else None
            opened = clock.now() - started
            result = await generate(served.stub, drafter, _request(prompt, seed, args),
                                    settings=RoundSettings(draft_len=4), target=info)
            sessions.append({"device": index, "seed": seed, "opened_s": round(opened, 2),
                             "seconds": round(result.elapsed_s, 2), "moves": result.moves,
                             "placements": dict(result.placements), "prompt": prompt,
                             "tokens": result.token_ids})
            n += 1

    phase = args.phase_s
    with console.status(f"{args.base} devices, then {args.devices}, then {args.base} again "
                        f"({phase:g} s each)"):
        await asyncio.gather(*(
            device(i, 0.0, 3 * phase) if i < args.base else device(i, phase, 2 * phase)
            for i in range(args.devices)))
    return sessions


async def _sample_load(server, loads: list, every: float = 0.25) -> None:
    """The server's load (sled_step_load) every EVERY seconds, as (seconds from the start,
    load), until cancelled."""
    started = clock.now()
    while True:
        load = await asyncio.to_thread(server.metric, "sled_step_load")
        loads.append((clock.now() - started, load))
        await asyncio.sleep(every)


def _labelled(server, name: str, label: str) -> float:
    """One labelled sample of the server's /metrics (0 when it has none yet)."""
    try:
        return server.metric(f"{name}{{{label}}}")
    except KeyError:
        return 0.0


def _table(console, sessions: list[dict], loads: list, args) -> None:
    """Sessions by the phase they opened in: how many, how many moved, tokens by placement,
    and the server's load in the phase (its mean and its most)."""
    table = Table(title=f"sled serve --placement {args.placement}: sessions by the phase they "
                        "opened in")
    for column in ("phase", "sessions", "moved", "moves", "device tokens", "server tokens",
                   "load: mean, most"):
        table.add_column(column, justify="right" if column != "phase" else "left")
    names = ("light", "peak", "light again")
    for k, name in enumerate(names):
        def within(t: float) -> bool:
            return k * args.phase_s <= t < (k + 1) * args.phase_s or (k == 2 and t >= 3 * args.phase_s)

        mine = [s for s in sessions if within(s["opened_s"])]
        load = [v for t, v in loads if within(t)] or [0.0]
        placed = Counter()
        for s in mine:
            placed.update(s["placements"])
        table.add_row(name, str(len(mine)), str(sum(1 for s in mine if s["moves"])),
                      str(sum(s["moves"] for s in mine)), str(placed["device"]),
                      str(placed["server"] + placed["server_sat"]),
                      f"{sum(load) / len(load):.2f}, {max(load):.2f}")
    console.print(table)
