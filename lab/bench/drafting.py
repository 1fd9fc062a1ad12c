"""`sled bench drafting`: the drafters side by side, chains and trees, on an emulated board.

One `sled serve` of the target. Per workload, every prompt goes through every configuration (a
drafter as chains, and as trees of --tree candidates per position where it drafts trees) before
the next prompt, the configurations' order rotating from prompt to prompt, so a noisy machine
slows every configuration alike. Each session's drafter runs through
PacedDrafter(measured=True) on --device (the work it really does here, slowed to the board's
cores, plus its per-round overhead) over a --link emulated in user space; one drafter per
configuration serves all its sessions, as on a device (Cacheback's table keeps what earlier
prompts wrote).

Per configuration and workload: acceptance (accepted / verified draft tokens; every token of a
tree counts as verified), tokens per round (per target pass of the session), drafting time per
drafted token here and on the board, the board's drafting time per accepted draft token (what a
drafter's kept work costs: hier: against its model drafter alone), and tokens/s of the sessions
end to end. Every output is
checked against the first configuration's: all are greedy, so all must be the target's own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich.progress import Progress
from rich.table import Table

from drafters import bind_target_tokenizer, load_drafter
from drafters.base import drafts_trees
from edge_client.emulation import PacedDrafter
from edge_client.session import RoundSettings, Target, generate
from edge_client.wire import SessionRequest
from lab.bench import harness
from lab.bench.report import save_figure, short_name, subplots
from lab.link import link_transport
from lab.profiles import Link, device_profile, link_profile
from lab.workload import prompt_texts
from sled.flags import positive_int
from sled.progress import plain_line

DRAFTERS = "ngram,cacheback,hier:cacheback>gguf:gemma3-270m,gguf:gemma3-270m"


def add_arguments(parser) -> None:
    harness.add_server_flags(parser, model_default="gemma3-270m",
                             model_help="the target: alias or checkpoint path")
    parser.add_argument("--drafters", default=DRAFTERS, help="comma-separated drafter specs")
    parser.add_argument("--tree", type=positive_int, default=2,
                        help="candidates per position of the tree runs (1: chains only)")
    parser.add_argument("--workloads", default="humaneval:10,chat",
                        help="comma-separated workloads: humaneval[:N], chat or a prompt file")
    harness.add_draft_len_flag(parser, help="draft length (a tree's depth)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="new tokens per prompt")
    parser.add_argument("--device", default="pi5", help="board profile (lab.profiles)")
    parser.add_argument("--link", default="wifi", help="link profile (lab.profiles)")
    harness.add_out_flag(parser, "drafting")


def run(args) -> int:
    return harness.run_bench("drafting", bench, args)


@dataclass(frozen=True, slots=True)
class Config:
    """One drafter, drafting chains (tree 1) or trees."""
    spec: str
    tree: int

    @property
    def name(self) -> str:
        return short_name(self.spec) + (f" tree={self.tree}" if self.tree > 1 else "")


@dataclass(slots=True)
class Tally:
    """What one configuration's sessions on one workload added up to."""
    sessions: int = 0
    rounds: int = 0
    verified: int = 0
    accepted: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, result) -> None:
        self.sessions += 1
        self.rounds += result.rounds
        self.verified += result.draft_tokens
        self.accepted += result.accepted_tokens
        self.tokens += len(result.token_ids)
        self.elapsed_s += result.elapsed_s
        self.outputs.append(result.token_ids)


async def bench(args) -> int:
    console = harness.bench_console()
    with harness.flag_errors():
        specs = harness.split_list(args.drafters)
        workloads = harness.split_list(args.workloads)
        texts = {w: prompt_texts(w) for w in workloads}
        board, link = device_profile(args.device), link_profile(args.link)
    async with harness.serving_target(args.model, args, console) as served:
        tokenizer = await served.conn.tokenizer()
        rows, differences = [], []
        for workload in workloads:
            prompts = await served.prompt_ids(texts[workload])
            pacers = _drafters(specs, args.tree, tokenizer, board)
            configs = list(pacers)
            tallies = await _run_workload(served, pacers, prompts, workload, link, args, console)
            rows += [_row(workload, config, tallies[config], pacers[config]) for config in configs]
            differences += _differences(workload, configs, tallies)
    console.print(_table(rows, args))
    setup = (f"{args.model} target, k={args.draft_len}, {args.max_new_tokens} new tokens, "
             f"{args.device} board over {args.link}")
    harness.write_results(console, args.out, {
        "target": args.model, "draft_len": args.draft_len, "tree": args.tree,
        "max_new_tokens": args.max_new_tokens, "device": args.device, "link": args.link,
        "workloads": workloads, "lossless": not differences, "results": rows},
        lambda png: _plot(rows, workloads, png, setup))
    return harness.lossless_exit(console, differences, "the first configuration's output")


def _drafters(specs: list[str], tree: int, tokenizer, board) -> dict:
    """Config -> its own drafter, paced to the board: each drafter as chains, and as trees when
    it drafts them. A fresh one per configuration, so no table learns from another's sessions
    (a bad spec stops the benchmark: exit 2)."""
    pacers = {}
    for spec in specs:
        pacers[Config(spec, 1)] = chained = _paced(spec, tokenizer, board)
        if tree > 1 and drafts_trees(chained):
            pacers[Config(spec, tree)] = _paced(spec, tokenizer, board)
    return pacers


def _paced(spec: str, tokenizer, board):
    with harness.flag_errors():
        drafter = load_drafter(spec)
    bind_target_tokenizer(drafter, tokenizer)       # an xtok: drafter drafts in the target's ids
    return PacedDrafter(drafter, board, measured=True)


async def _run_workload(served, pacers: dict, prompts: list[list[int]], workload: str, link, args,
                        console) -> dict:
    """Every prompt through every configuration, rotating their order per prompt."""
    configs = list(pacers)
    tallies = {config: Tally() for config in configs}
    with Progress(console=console) as progress:
        task = progress.add_task(workload, total=len(prompts) * len(configs))
        for i, prompt in enumerate(prompts):
            for config in harness.rotated(configs, i):
                progress.update(task, description=f"{workload}: {config.name}")
                tallies[config].add(await _session(served, pacers[config], config, prompt, link,
                                                   args))
                progress.advance(task)
            plain_line(f"{workload}: prompt {i + 1} of {len(prompts)} done")
    return tallies


async def _session(served, drafter, config: Config, prompt: list[int], link_profile, args):
    settings = RoundSettings(draft_len=args.draft_len, tree=config.tree,
                             max_draft_tokens=served.info.limits.max_draft_tokens)
    return await generate(served.stub, drafter,
                          SessionRequest(prompt, max_new_tokens=args.max_new_tokens),
                          settings=settings, target=Target(fingerprint=served.fingerprint),
                          transport=link_transport(Link(link_profile, seed=len(prompt))))


def _row(workload: str, config: Config, tally: Tally, pacer) -> dict:
    drafted = max(pacer.drafted, 1)
    return {"workload": workload, "drafter": config.spec, "tree": config.tree, "name": config.name,
            "sessions": tally.sessions, "rounds": tally.rounds, "verified": tally.verified,
            "accepted": tally.accepted, "tokens": tally.tokens,
            "acceptance_rate": tally.accepted / tally.verified if tally.verified else 0.0,
            "tokens_per_round": tally.tokens / tally.rounds if tally.rounds else 0.0,
            "drafted": pacer.drafted,
            "draft_ms_per_token_host": pacer.host_s * 1e3 / drafted,
            "draft_ms_per_token_board": pacer.board_s * 1e3 / drafted,
            "draft_ms_per_accepted_board": pacer.board_s * 1e3 / max(tally.accepted, 1),
            "tokens_per_s": tally.tokens / tally.elapsed_s if tally.elapsed_s else 0.0}


def _differences(workload: str, configs: list[Config], tallies: dict) -> list[str]:
    """Configurations whose outputs are not the first configuration's (all greedy)."""
    reference = tallies[configs[0]].outputs
    out = []
    for config in configs[1:]:
        differing = sum(a != b for a, b in zip(tallies[config].outputs, reference))
        if differing:
            out.append(f"{workload}, {config.name}: {differing} output(s)")
    return out


def _table(rows: list[dict], args):
    table = Table(title=f"drafters on {args.model}, k={args.draft_len}, greedy, {args.device} "
                        f"board over {args.link}")
    columns = ("workload", "drafter", "acceptance", "tokens/round", "draft ms/token here",
               f"draft ms/token {args.device}", f"per accepted token {args.device}",
               f"tokens/s ({args.device})")
    for column in columns:
        table.add_column(column, justify="left" if column in ("workload", "drafter") else "right")
    for r in rows:
        table.add_row(r["workload"], r["name"], f"{r['acceptance_rate']:.1%}",
                      f"{r['tokens_per_round']:.2f}", f"{r['draft_ms_per_token_host']:.2f}",
                      f"{r['draft_ms_per_token_board']:.2f}",
                      f"{r['draft_ms_per_accepted_board']:.2f}", f"{r['tokens_per_s']:.1f}")
    return table


def _plot(rows: list[dict], workloads: list[str], path, title: str) -> None:
    fig, (left, right) = subplots(2, figsize=(12, 4.5))
    names = list(dict.fromkeys(r["name"] for r in rows))
    width = 0.8 / len(workloads)
    for w, workload in enumerate(workloads):
        mine = {r["name"]: r for r in rows if r["workload"] == workload}
        xs = [i + w * width for i in range(len(names))]
        left.bar(xs, [mine[n]["tokens_per_round"] for n in names], width, label=workload)
        right.bar(xs, [mine[n]["tokens_per_s"] for n in names], width, label=workload)
    for axis, label in ((left, "tokens per round"), (right, "tokens/s per device")):
        axis.set_xticks([i + width * (len(workloads) - 1) / 2 for i in range(len(names))], names,
                        rotation=30, ha="right", fontsize=8)
        axis.set(ylabel=label, title=label)
    save_figure(fig, (left, right), path, title)
