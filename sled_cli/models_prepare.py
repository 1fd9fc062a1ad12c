"""`sled models prepare [ALIAS ...]`: assemble, convert (and export) built-in models ahead of use.

Each step is skipped when its result is already in the sled cache; the steps that take long show
their own progress (the conversion a spinner, the ONNX export a bar over the model's layers)."""
from __future__ import annotations

from rich.console import Console

from drafters.onnx_export import export_alias
from sled.models import BUILTIN, gguf_path, hf_checkpoint


def add_arguments(parser) -> None:
    parser.add_argument("aliases", nargs="*", help="default: all")
    parser.add_argument("--onnx", action="store_true", help="also export an int4 ONNX drafter")


def steps(aliases: list[str], onnx: bool) -> list[tuple[str, str, object]]:
    """(alias, what, make) for each result to prepare, in the order they depend on each other."""
    out = []
    for alias in aliases:
        out += [(alias, "gguf", gguf_path), (alias, "transformers", hf_checkpoint)]
        if onnx:
            out.append((alias, "onnx", export_alias))
    return out


def run(args) -> int:
    console = Console(soft_wrap=True)
    unknown = [alias for alias in args.aliases if alias not in BUILTIN]
    if unknown:
        Console(stderr=True).print(f"sled models prepare: unknown model {unknown[0]!r}; built-in "
                                   f"models: {', '.join(BUILTIN)}", style="red", highlight=False)
        return 2
    todo = steps(args.aliases or list(BUILTIN), args.onnx)
    for n, (alias, what, make) in enumerate(todo, 1):
        console.print(f"[{n}/{len(todo)}] [bold]{alias}[/]: {what} ...", highlight=False)
        console.print(f"      {make(alias)}", highlight=False)
    return 0
