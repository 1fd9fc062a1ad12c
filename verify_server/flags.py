"""`sled serve`'s command line, made from the server's settings (ServerSettings): each key is a
flag, a line of --config FILE and a SLED_SERVE_* variable. The lab parses server flags with the
same parser (lab.oracle), so a scenario's server.args mean what they mean to sled serve."""
from __future__ import annotations

import argparse
import contextlib
import io
import typing

from sled.flags import builtin_aliases
from verify_server.settings import (ACCESS, ANNOUNCE, ENV_PREFIX, ServerSettings, flag_spellings,
                                    load_settings)

EPILOG = f"""\
Every flag is also a key of a --config file (TOML or YAML, e.g. max_sessions = 64) and a
{ENV_PREFIX}* variable ({ENV_PREFIX}MAX_SESSIONS=64); flags win over variables, variables over
the file."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--config", metavar="FILE",
                        help="settings file (.toml, .yaml or .yml) (default: none)")
    groups = {ACCESS: parser.add_argument_group(
        ACCESS, "who may use this server: TLS (mutual with --tls-client-ca), device tokens,\n"
        "trusted proxies that name the devices behind them, per-device quotas\n"
        "(RESOURCE_EXHAUSTED past them)"),
        ANNOUNCE: parser.add_argument_group(
        ANNOUNCE, "announce this server to devices over MQTT (retained on PREFIX/servers/SERVER_ID;\n"
        "off without --mqtt-host)")}
    for name, field in ServerSettings.model_fields.items():
        extra = field.json_schema_extra or {}
        group = groups.get(extra.get("group"), parser)
        group.add_argument(*flag_spellings(name), dest=name, default=argparse.SUPPRESS,
                           help=_help(field) + _aliases(name), **_kind(field, extra))


def _aliases(name: str) -> str:
    """--model's help lists the built-in aliases."""
    return f"; built-in aliases: {builtin_aliases()}" if name == "model" else ""


def _kind(field, extra: dict) -> dict:
    """How a key reads from the command line: a switch, a choice or a value pydantic checks."""
    if field.annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    choices = typing.get_args(field.annotation)
    if typing.get_origin(field.annotation) is typing.Literal:
        return {"choices": choices}
    number = {int, float} & {field.annotation, *choices}
    kind = {"metavar": extra.get("metavar") or ("N" if number else "TEXT")}
    return {**kind, "action": "append"} if extra.get("repeatable") else kind


def _shown(default) -> str:
    """A default as --help shows it: none and empty spelled out."""
    return "none" if default is None else "empty" if default == "" else str(default)


def _help(field) -> str:
    default = field.get_default(call_default_factory=False)
    if field.is_required() or field.default_factory is not None or "default" in field.description:
        shown = ""
    else:
        shown = f" (default: {_shown(default)})"
    return (field.description + shown).replace("%", "%%")


def served_settings(target: str, server_args: list[str] | None = None):
    """The ServerSettings `sled serve --model TARGET SERVER_ARGS` runs with: the flags read by
    sled serve's own parser, then its loader (--config file, SLED_SERVE_* variables, flags).
    ValueError (one line) for flags sled serve would refuse."""
    parser = argparse.ArgumentParser(prog="sled serve", add_help=False)
    add_arguments(parser)
    try:
        with contextlib.redirect_stderr(io.StringIO()) as said:
            args = parser.parse_args(["--model", target, *(server_args or [])])
    except SystemExit:
        raise ValueError(f"server.args: {said.getvalue().strip().splitlines()[-1]}") from None
    flags = {name: getattr(args, name) for name in ServerSettings.model_fields if hasattr(args, name)}
    return load_settings(args.config, flags)
