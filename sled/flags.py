"""Flag value types for argparse: each checks its range, so a bad value is the parser's one-line
error (`sled CMD: error: argument --max-new-tokens: must be an integer >= 1, got '-1'`, exit 2)
and never a traceback from deep inside a run. Also the help formatter every command uses."""
from __future__ import annotations

import argparse
import math

from sled.models import BUILTIN
from sled.wire.loose import Loose


def _number(text: str, kind: type, wanted: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
    return value


def _checked(kind: type, wanted: str, ok) -> callable:
    """A type= function: parse as `kind`, then accept only values where ok(value)."""
    def parse(text: str):
        value = _number(text, kind, wanted)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value
    parse.__name__ = wanted
    return parse


positive_int = _checked(int, "an integer >= 1", lambda v: v >= 1)
non_negative_int = _checked(int, "an integer >= 0", lambda v: v >= 0)
any_int = _checked(int, "an integer", lambda v: True)
finite_float = _checked(float, "a finite number", lambda v: True)
positive_float = _checked(float, "a finite number > 0", lambda v: v > 0)
non_negative_float = _checked(float, "a finite number >= 0", lambda v: v >= 0)
probability = _checked(float, "a number in [0, 1]", lambda v: 0 <= v <= 1)
open_probability = _checked(float, "a number in (0, 1]", lambda v: 0 < v <= 1)
fraction = _checked(float, "a number in [0, 1)", lambda v: 0 <= v < 1)


def loose_flag(text: str):
    """--loose WINDOW:ENTROPY -> sled.wire.loose.Loose (a bad value is a usage error: exit 2)."""
    try:
        return Loose.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every optional flag's help ends with its default (unless required or already said)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default is argparse.SUPPRESS or action.required or not action.option_strings
                or "default" in text):
            return text
        return f"{text} (default: %(default)s)"


def builtin_aliases() -> str:
    """The built-in model aliases, comma separated, for --model/--drafter help."""
    return ", ".join(BUILTIN)


def checked_numbers(parser: argparse.ArgumentParser) -> None:
    """The floor for every command: a flag still typed plain int or float takes no negative,
    NaN or infinite value (a command narrows the range with the types above)."""
    loose = {int: non_negative_int, float: non_negative_float}
    for action in parser._actions:
        if action.type in loose:
            action.type = loose[action.type]


def one_line(exc: Exception) -> str:
    """A settings error (a heading, then one indented line per bad key) as one line."""
    heading, *details = str(exc).splitlines() or [""]
    if not details:
        return heading
    return f"{heading.rstrip(':')}: " + "; ".join(line.strip() for line in details if line.strip())
