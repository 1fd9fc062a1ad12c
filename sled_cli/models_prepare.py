"""`sled models prepare [ALIAS ...]`: assemble, convert (and export) built-in models ahead of use."""
from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("aliases", nargs="*", help="default: all")
    parser.add_argument("--onnx", action="store_true", help="also export an int4 ONNX drafter")


def run(args) -> int:
    from rich.console import Console

    from sled.models import BUILTIN, gguf_path, hf_checkpoint

    console = Console()
    for alias in args.aliases or list(BUILTIN):
        console.print(f"[bold]{alias}[/]: gguf {gguf_path(alias)}")
        console.print(f"[bold]{alias}[/]: transformers {hf_checkpoint(alias)}")
        if args.onnx:
            from drafters.onnx_export import export_alias
            console.print(f"[bold]{alias}[/]: onnx {export_alias(alias)}")
    return 0
