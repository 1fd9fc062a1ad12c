"""The grid `sled lab landscape --sweep` runs: one `sled lab simulate` of a scenario per prompt
length x answer length, each over the same fleet sizes and modes, its results in a folder of
its own (RUNS/CONTEXT-ANSWER).

    folders = sweep("fleet-sizing", [512, 2048, 8192], [64, 512], "--fleet-sizes 1,4,16,64",
                    Path("lab-results/landscape"))
"""
from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from pathlib import Path

from lab.sim import simulate


class SweepError(ValueError):
    """A flag of the sweep's simulate runs, or one of its runs, that failed: one line."""


def sweep(scenario: str, contexts: Sequence[int], answers: Sequence[int], simulate_args: str,
          runs: Path) -> list[Path]:
    """Every (context, answer) run, answers outermost; their result folders."""
    parser = argparse.ArgumentParser(prog="sled lab simulate", exit_on_error=False)
    simulate.add_arguments(parser)
    extra = shlex.split(simulate_args)
    taken = {"--context", "--max-new-tokens", "--out"} & set(extra)
    if taken:
        raise SweepError(f"--simulate-args: {', '.join(sorted(taken))} is the sweep's own: "
                         "give --contexts and --answers instead")
    folders = []
    for answer in answers:
        for context in contexts:
            out = runs / f"{context}-{answer}"
            try:
                args = parser.parse_args([scenario, "--context", str(context), "--max-new-tokens",
                                          str(answer), *extra, "--out", str(out)])
            except (argparse.ArgumentError, SystemExit) as exc:
                raise SweepError(f"--simulate-args: {exc}") from None
            if simulate.run(args) != 0:
                raise SweepError(f"the run of {context} prompt tokens and {answer} new tokens "
                                 f"failed (its output is above; its results: {out})")
            folders.append(out)
    return folders
