"""`sled`: one command line for the server, the device side, benchmarks and the demo.

COMMANDS is the whole command line: each name maps to the module that runs it, which exposes
add_arguments(parser) and run(args), or to a group of such names (`sled bench serve`).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import logging
import os
import signal
import sys
from dataclasses import dataclass

from sled import progress
from sled.extras import MissingExtra, require_extra
from sled.flags import HelpFormatter, checked_numbers
from sled_cli.logs import configure_logging

# OpenMP's default busy-waiting threads starve the server's event loop when the forward runs on
# its engine thread (a tiny batched forward took ~300 ms instead of ~2 ms on 2 cores). This must
# be set before torch loads; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@dataclass(frozen=True, slots=True)
class Command:
    """A command's module (add_arguments(parser), run(args)) and its one-line help."""
    module: str
    help: str
    verbose: bool = False      # log at INFO even without -v
    own_argv: bool = False     # parses its own flags: run(argv) gets the words after its name
    needs: tuple[str, ...] = ()   # the extras it cannot run without (sled.extras), checked first


@dataclass(frozen=True, slots=True)
class Group:
    """Commands under one name, e.g. `sled bench NAME`."""
    help: str
    commands: dict


SERVER, SERVER_LAB = ("server",), ("server", "lab")   # what the server-side commands need

COMMANDS = {
    "serve": Command("sled_cli.serve", "run the shared verify server", verbose=True, needs=SERVER),
    "generate": Command("sled_cli.generate", "generate on this device, verified by a server"),
    "device": Command("sled_cli.device", "the device daemon: local OpenAI-compatible API, MQTT, "
                      "drafting (sled device --config FILE; sled device --help lists its "
                      "settings)", own_argv=True),
    "bench": Group("benchmarks", {
        "overhead": Command("lab.bench.overhead",
                            "per-round gRPC + scheduling overhead on loopback", needs=SERVER),
        "acceptance": Command("lab.bench.acceptance",
                              "acceptance and tokens per round per drafter and k",
                              needs=SERVER_LAB),
        "serve": Command("lab.bench.serve",
                         "sled vs centralized serving as the number of devices grows",
                         needs=SERVER_LAB),
        "device": Command("lab.bench.device", "adaptive draft length vs fixed k per link, and "
                          "pipelined drafting on vs off per round trip time, on emulated devices",
                          needs=SERVER_LAB),
        "derive-profile": Command("lab.bench.derive", "a DERIVED step-cost profile for a target "
                                  "never measured: its roofline on a GPU, scaled by a profile "
                                  "measured there"),
        "publish-profile": Command("lab.bench.publish", "a PUBLISHED step-cost profile of vLLM "
                                   "or SGLang: their published figures for Llama 3.1 8B, on "
                                   "an H100 or moved to an H200 by its roofline"),
        "placement": Command("lab.bench.placement", "a server moving sessions between the "
                             "devices' drafts and its own as devices join and leave, every "
                             "output held to generate()", needs=SERVER_LAB),
        "kv-windows": Command("lab.bench.kv_windows", "sessions a GPU's KV memory holds per "
                              "context, sliding-window layers keeping their window or every "
                              "token"),
        "engine": Command("lab.bench.engine",
                          "paged engine vs the padded fallback as contexts grow", needs=SERVER_LAB),
        "drafting": Command("lab.bench.drafting", "the drafters side by side, chains and trees "
                            "(ngram, cacheback, hier:, model drafters), interleaved, on an "
                            "emulated board", needs=SERVER_LAB),
        "loose": Command("lab.bench.loose", "HumanEval pass@1 and tokens per target pass, "
                         "lossless vs opt-in loose verification", needs=SERVER_LAB),
        "drafter": Command("lab.bench.drafter",
                           "GGUF/ONNX drafter vs its runtime's own generation loop", needs=SERVER),
        "sdsat": Command("lab.bench.sdsat", "SAT self-drafting vs plain decoding, and SAT "
                         "lookahead per drafter, on a SAT-tuned target", needs=SERVER_LAB),
        "startup": Command("lab.bench.startup", "where the wait before serving and before a "
                           "device's first token goes, phase by phase (warm, or --cold)",
                           needs=SERVER),
        "footprint": Command("lab.bench.footprint", "the device daemon's memory, start-up and "
                             "installed size per drafter, in slim venvs and a full one",
                             needs=SERVER_LAB),
        "fuzz": Command("lab.bench.fuzz", "generated hostile DeviceMessage streams against a "
                        "server beside a normal session: crashes, leaks, lossless output",
                        needs=SERVER_LAB),
        "soak": Command("lab.bench.soak", "a fleet of emulated devices for minutes with fault "
                        "steps: memory over time, errors, round latency, tokens lost",
                        needs=SERVER_LAB),
        "reliability": Command("lab.bench.reliability", "memory kept per refused prompt, round "
                               "time under a GetTokenizer flood, slots freed from idle sessions",
                               needs=SERVER_LAB),
    }),
    "lab": Group("the lab testbed: a fleet of devices against one server, with one report", {
        "run": Command("lab.run", "run a scenario locally: sled serve, Mosquitto and one sled "
                       "device process per device", needs=SERVER_LAB),
        "compose": Command("lab.compose", "run a scenario in Docker Compose: build the images, "
                           "bring the fleet up, collect the report", needs=SERVER_LAB),
        "simulate": Command("lab.sim.simulate", "a scenario's fleet on simulated time, sled "
                            "against centralized, from 1 to 4096 devices in seconds",
                            needs=SERVER_LAB),
        "landscape": Command("lab.sim.landscape", "where sled wins and where it does not: one "
                             "plot and tables from several `sled lab simulate` runs",
                             needs=SERVER_LAB),
        "arm-root": Command("lab.arm_root", "an aarch64 Debian Bookworm root (debootstrap, "
                            "qemu-user), built once into the cache; --check runs its python3"),
        "arm-wheel": Command("lab.arm_wheel", "llama-cpp-python cross-compiled for aarch64 with "
                             "a board's flags (pi5, pi4, orin), built once per set of flags"),
        "arm-device": Command("lab.arm_device", "the device side in the aarch64 root, drafting "
                              "for a server on this host: install, doctor, three drafters, RSS",
                              needs=SERVER_LAB),
        "device": Command("lab.device_entry", "a device container's entrypoint: take a place in "
                          "the scenario's fleet, set up its link, run sled device"),
    }),
    "demo": Command("sled_cli.demo", "loopback demo: a server and three devices on this machine",
                    needs=SERVER),
    "certs": Command("sled_cli.certs", "make a development CA, a server certificate, and "
                     "per-device client certificates and tokens into a folder"),
    "broker-config": Command("sled_cli.broker_config", "write a Mosquitto password file and ACL "
                             "that confine each device to its own topics"),
    "export-onnx": Command("sled_cli.export_onnx",
                           "export an HF checkpoint or built-in model to ONNX (drafter)",
                           needs=("export",)),
    "doctor": Command("sled_cli.doctor", "this CPU's vector extensions, llama.cpp's build flags "
                      "and a decode check of a GGUF (--repair: a portable rebuild on a crash); "
                      "--server: this machine as a verify server (CUDA, GPUs, memory, flex, one "
                      "step of the target)"),
    "models": Group("built-in offline models", {
        "list": Command("sled_cli.models_list", "aliases, their packages and cached conversions"),
        "prepare": Command("sled_cli.models_prepare",
                           "assemble, convert (and export) ahead of use"),
    }),
    "run-device": Command("sled_cli.run_device",
                          "run a workload as one device; JSON lines of progress"),
    "trace": Group("drafter traces for emulated devices", {
        "record": Command("sled_cli.trace_record",
                          "record a drafter's proposals along the target's greedy output",
                          needs=SERVER),
        "synthesize": Command("sled_cli.trace_synthesize",
                              "a stated acceptance process along a server's own output (for "
                              "synthetic targets)", needs=SERVER_LAB),
    }),
    "sdsat": Group("semantic adaptive tokens: the target drafts for itself", {
        "train": Command("sled_cli.sdsat_train",
                         "train SATs into a causal LM (an adapter, or all weights)",
                         needs=SERVER_LAB),
    }),
    "make-tiny": Command("sled_cli.make_tiny",
                         "write a tiny random target + drafter pair (testing)", needs=SERVER),
}


def parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser. Given argv, only the command it names gets its flags: that one
    command's module is imported (its extras checked first), the rest are names and help lines
    from COMMANDS, so `sled --help` and every command start without importing the others.
    Without argv, every command gets its flags."""
    root = argparse.ArgumentParser(prog="sled", description=__doc__.splitlines()[0])
    root.add_argument("-v", "--verbose", action="store_true")
    _add_commands(root, COMMANDS, "command", None if argv is None else _command_path(argv))
    return root


def _add_commands(parser: argparse.ArgumentParser, table: dict, dest: str,
                  path: list[str] | None) -> None:
    """One subparser per entry of `table`; a group nests its own. A command gets its flags when
    `path` (the command words of argv) names it, or when there is no path."""
    sub = parser.add_subparsers(dest=dest, required=True)
    for name, entry in table.items():
        named = path is None or (path[:1] == [name])
        if isinstance(entry, Group):
            _add_commands(sub.add_parser(name, help=entry.help), entry.commands, "action",
                          None if path is None else path[1:] if named else [])
            continue
        command = sub.add_parser(name, help=entry.help, add_help=not entry.own_argv,
                                 formatter_class=HelpFormatter)
        if named and not entry.own_argv:
            if path is not None:     # the command that runs: its extras before its imports
                for extra in entry.needs:
                    require_extra(extra, "this command")
            importlib.import_module(entry.module).add_arguments(command)
            checked_numbers(command)
        command.set_defaults(entry=entry)


def _command_path(argv: list[str]) -> list[str]:
    """The command words of argv (["bench", "serve"]), as far as COMMANDS knows them. Flags before
    a command's name are skipped: the root's and a group's take no value."""
    words, table = [], COMMANDS
    for word in argv:
        if word.startswith("-"):
            continue
        entry = table.get(word)
        if entry is None:
            break
        words.append(word)
        if not isinstance(entry, Group):
            break
        table = entry.commands
    return words


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    progress.set_command(_command_name(argv))
    progress.quiet_libraries()
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:   # Ctrl-C: the command's own cleanup (finally, async with) ran
        return interrupted(_command_name(argv))
    except MissingExtra as exc:  # this install lacks what the command needs: one line, exit 2
        print(f"{_command_name(argv)}: {exc}", file=sys.stderr, flush=True)
        return 2


def _dispatch(argv: list[str]) -> int:
    """Run the command argv names. An asyncio command's Ctrl-C cancels its task (its cleanup
    runs), then reaches main as KeyboardInterrupt unless the command ended on its own."""
    entry = COMMANDS.get(argv[0]) if argv else None
    if isinstance(entry, Command) and entry.own_argv:
        return importlib.import_module(entry.module).run(argv[1:])
    args = parser(argv).parse_args(argv)     # checks the command's extras (needs)
    configure_logging(logging.INFO if args.verbose or args.entry.verbose else logging.WARNING)
    result = importlib.import_module(args.entry.module).run(args)
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def interrupted(command: str) -> int:
    """One line and exit status 130 for Ctrl-C; a second Ctrl-C while exiting ends the process
    at once (no traceback from whatever exit code it interrupts)."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    print(f"{command}: interrupted", file=sys.stderr, flush=True)
    return 130


def _command_name(argv: list[str]) -> str:
    """`sled serve`, `sled bench device`: the command words of argv, as far as they are known."""
    words = ["sled"]
    table = COMMANDS
    for word in argv:
        entry = table.get(word) if not word.startswith("-") else None
        if entry is None:
            if word.startswith("-") and len(words) == 1:
                continue    # a root flag (-v) before the command
            break
        words.append(word)
        if not isinstance(entry, Group):
            break
        table = entry.commands
    return " ".join(words)


if __name__ == "__main__":
    sys.exit(main())
