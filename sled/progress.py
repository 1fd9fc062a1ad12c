"""Progress of the slow steps (assembling, converting, exporting, loading, fingerprinting): the
one place that tells a person what sled is doing while it makes them wait.

    with phase("target.weights", "loading the weights of gemma3-270m"):
        ...

Each phase is one line on stderr, written when the phase starts, prefixed with the command
("sled serve: loading the weights of gemma3-270m..."). On a terminal a spinner runs beside it
and the line stays with its time ("... done in 3.1 s"); elsewhere (a pipe, a log file) the plain
line is all. Nothing is written to stdout (generate's stdout is the generated text). A phase
inside another updates the spinner's text and gives it back when it ends.

Every finished phase is also kept in TIMINGS (key, seconds) for `sled bench startup`, and
logged at DEBUG on the "sled.progress" logger. A phase ended by an exception of any kind (an
error, KeyboardInterrupt, a cancelled task's CancelledError) says "stopped after", never "done".
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator

from rich.console import Console
from rich.text import Text

log = logging.getLogger("sled.progress")

TIMINGS: list[tuple[str, float]] = []   # (phase key, seconds) of every finished phase
_stack: list[str] = []                  # the messages of the phases running now, outermost first
_status = None                          # the terminal's spinner while a phase runs
_command = "sled"                       # what the lines start with: set_command()


def quiet_libraries() -> None:
    """sled's phases are the progress a person sees: transformers' and huggingface_hub's own bars
    ("Writing model shards" when a checkpoint is first made, "Loading weights") are turned off,
    at once where transformers is loaded and at its import otherwise. sled_cli.main calls it."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_progress_bar()


def set_command(name: str) -> None:
    """Name the command whose phases these are ("sled serve"); sled_cli.main sets it once."""
    global _command
    _command = name


def prefix() -> str:
    """The command that runs, as sled_cli.main named it ("sled" when nothing did)."""
    return _command


def on_terminal() -> bool:
    """A spinner only where a person watches: stderr is a terminal and TERM is not dumb."""
    try:
        return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def plain_line(text: str) -> None:
    """TEXT on stderr as one line, where no progress bar is drawn (a pipe, a log file): long
    work under nohup or CI still says how far it got."""
    if not on_terminal():
        print(f"{prefix()}: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def phase(key: str, message: str) -> Iterator[None]:
    """One line for MESSAGE now, a spinner while the block runs (on a terminal), and its time in
    TIMINGS under KEY when it ends (ended by an exception too: that time is still spent)."""
    start = time.perf_counter()
    line = f"{prefix()}: {message}..."
    if on_terminal():
        context = _spinning(line)
    else:
        print(line, file=sys.stderr, flush=True)
        context = contextlib.nullcontext()
    _stack.append(line)
    ended = "stopped after"    # an error, Ctrl-C or a cancelled task ends it: not "done"
    try:
        with context:
            yield
        ended = "done in"
    finally:
        _stack.pop()
        seconds = time.perf_counter() - start
        TIMINGS.append((key, seconds))
        log.debug("phase %s %s %.2f s", key, ended, seconds)


@contextlib.contextmanager
def _spinning(line: str) -> Iterator[None]:
    """The spinner shows LINE while the block runs; the line stays with its time afterwards."""
    global _status
    start = time.perf_counter()
    if _status is None:
        console = Console(stderr=True, highlight=False)
        _status = console.status(Text(line))
        _status.start()
        owner = True
    else:                      # nested: take over the spinner's text, give it back at the end
        _status.update(Text(line))
        owner = False
    ended = "stopped after"    # an exception (or Ctrl-C) ends the phase: not "done"
    try:
        yield
        ended = "done in"
    finally:
        status = _status
        status.console.print(f"{line} {ended} {time.perf_counter() - start:.1f} s", markup=False)
        if owner:
            status.stop()
            _status = None
        elif _stack[:-1]:
            status.update(Text(_stack[-2]))
