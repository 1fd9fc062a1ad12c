"""The README is the user's contract: every `sled ...` line in its code blocks is accepted by the
real command line (flag for flag, no abbreviations), every file it names exists, and every
module attribute it names (`edge_client.session.generate`) is there. Nothing is run."""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from conftest import run_main
from sled_cli.main import COMMANDS, Command, Group, parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

# What the README writes as a placeholder or a choice, and a value that stands for it here.
PLACEHOLDERS = [
    (r"HOST:50051", "127.0.0.1:50051"),
    (r"\bPATH_OR_ID\b", "gemma3-270m"),
    (r"\bPATH_OR_ALIAS\b", "gemma3-270m"),
    (r"\[OUT_DIR\]", "onnx-out/"),
    (r"--sat-adapter PATH\b", "--sat-adapter sat/sat_adapter.safetensors"),
    (r"--lr X\b", "--lr 0.03"),
    (r"(?<![\w./])device\.toml\b", "docs/device.example.toml"),
    (r"(\w+)(?:\|[\w.-]+)+", r"\1"),          # a choice (int4|int8|fp32): its first
    (r"\[(--[^\[\]]*)\]", r"\1"),             # an optional part: checked like the rest
]


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)


def logical_lines(block: str) -> list[str]:
    """The block's lines with backslash continuations joined."""
    return re.sub(r"\\\n\s*", " ", block).splitlines()


def readme_commands(text: str = README) -> list[tuple[str, dict[str, str], list[str]]]:
    """(the README line, its VAR=value prefix, the words after `sled`) of every sled command."""
    out = []
    for block in code_blocks(text):
        for line in logical_lines(block):
            words = shlex.split(substituted(line), comments=True)
            env = {}
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                name, value = words.pop(0).split("=", 1)
                env[name] = value
            if words and words[0] == "sled":
                out.append((line.strip(), env, words[1:]))
    return out


def substituted(line: str) -> str:
    for pattern, value in PLACEHOLDERS:
        line = re.sub(pattern, value, line)
    return line


def subparser(words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser of the command the words name, and the words after the command's name."""
    found, table = parser(), COMMANDS
    for i, word in enumerate(words):
        action = next(a for a in found._actions if isinstance(a, argparse._SubParsersAction))
        found, entry = action.choices[word], table[word]
        if isinstance(entry, Command):
            return found, words[i + 1:]
        table = entry.commands
    raise AssertionError(f"`sled {' '.join(words)}` names a group, not a command")


def unknown_flags(command: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """Flags that are not spelled exactly as the parser has them (argparse alone would take an
    abbreviation such as --max-new-token)."""
    known = {option for action in command._actions for option in action.option_strings}
    return [arg.split("=", 1)[0] for arg in args
            if arg.startswith("--") and arg.split("=", 1)[0] not in known]


def check_parses(words: list[str], capsys) -> None:
    """`sled WORDS` as the CLI parses it (no command runs): a failure names the flag."""
    command, args = subparser(words)
    wrong = unknown_flags(command, args)
    assert not wrong, f"not a flag of sled {' '.join(words[:2])}: {wrong}"
    try:
        parser().parse_args(words)
    except SystemExit as exc:
        pytest.fail(f"sled {' '.join(words)}: exit {exc.code}: {capsys.readouterr().err.strip()}")


def check_device_flags(env: dict[str, str], args: list[str], monkeypatch) -> None:
    """`sled device ARGS` parses its own flags into the daemon's settings."""
    from edge_client.settings import load_settings
    from sled_cli.device import _config_flag

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)
    config, rest = _config_flag(args)
    load_settings(config, rest)


COMMAND_LINES = readme_commands()


def test_the_readme_shows_sled_commands():
    shown = {" ".join(words[:2]) for _, _, words in COMMAND_LINES}
    assert {"serve --model", "generate --server", "device --config", "bench overhead",
            "sdsat train", "trace record", "models list", "export-onnx gemma3-270m"} <= shown


@pytest.mark.parametrize("line, env, words", COMMAND_LINES, ids=[w for w, _, _ in COMMAND_LINES])
def test_every_readme_command_is_accepted_by_the_cli(line, env, words, capsys, monkeypatch):
    entry = COMMANDS.get(words[0])
    if isinstance(entry, Command) and entry.own_argv:
        check_device_flags(env, words[1:], monkeypatch)
    else:
        assert not env or all(name.startswith("SLED_") for name in env), line
        check_parses(words, capsys)


@pytest.mark.parametrize("wrong, right", [("--draft-lne", "--draft-len"),
                                          ("--max-new-token ", "--max-new-tokens "),
                                          ("--kv-budgt", "--kv-budget"),
                                          ("--policy.draft-length", "--port")])
def test_a_misspelled_readme_flag_fails_the_check(wrong, right, capsys, monkeypatch):
    """The check itself: a README with one flag misspelled (or cut short) does not pass."""
    changed = README.replace(right, wrong, 1) if right != "--port" else \
        README.replace("--drafter gguf:gemma3-270m --port 8000", f"{wrong} 8000", 1)
    assert changed != README
    failures = 0
    for line, env, words in readme_commands(changed):
        try:
            test_every_readme_command_is_accepted_by_the_cli(line, env, words, capsys, monkeypatch)
        except (AssertionError, pytest.fail.Exception, Exception):
            failures += 1
    assert failures == 1


def named_paths(text: str = README) -> list[str]:
    """Repository paths the README names: docs/..., protos/..., a package's file, a link."""
    roots = "docs|protos|edge_client|verify_server|drafters|lab|sled_cli|tests"
    found = re.findall(rf"(?<![\w$/.])((?:{roots})/[\w./-]*[\w/])", text)
    found = [path for path in found if not re.search(r"[A-Z]{3,}", path)]   # not lab/bench/NAME.py
    return sorted({*found, *re.findall(r"\]\(([\w./-]+)\)", text)})


@pytest.mark.parametrize("path", named_paths())
def test_every_path_the_readme_names_exists(path):
    assert (ROOT / path).exists(), f"README names {path}, which is not in the repository"


NOT_PYTHON = {"sled.v1.Verifier"}    # the gRPC service's full name


def named_attributes(text: str = README) -> list[str]:
    """`edge_client.session.generate`, `sled.printable`: dotted names in code spans."""
    spans = re.findall(r"`((?:edge_client|verify_server|drafters|lab|sled_cli|sled)(?:\.\w+)+)`",
                       text)
    return sorted(set(spans) - NOT_PYTHON)


@pytest.mark.parametrize("name", named_attributes())
def test_every_module_attribute_the_readme_names_exists(name):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            assert hasattr(found, attribute), f"README names {name}: no {attribute}"
            found = getattr(found, attribute)
        return
    pytest.fail(f"README names {name}, which does not import")


@pytest.mark.parametrize("config", ["docs/serve.example.toml", "docs/device.example.toml"])
def test_the_example_configs_load(config, monkeypatch):
    monkeypatch.chdir(ROOT)
    if "device" in config:
        from edge_client.settings import load_settings
    else:
        from verify_server.settings import load_settings
    load_settings(config)


@pytest.mark.parametrize("argv", [("/nonexistent-checkpoint",),
                                  ("/nonexistent-checkpoint", "onnx-out"),
                                  ("CHECKPOINT", "README.md")])
def test_export_onnx_refuses_a_bad_source_or_out_in_one_line(argv, capsys, monkeypatch, tmp_path):
    """No OUT_DIR for a path, no checkpoint there, OUT a file: one line and exit 2, before any
    export starts."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "config.json").write_text("{}")   # enough of a checkpoint to reach OUT's check
    argv = [str(tmp_path) if word == "CHECKPOINT" else word for word in argv]
    code, _, err = run_main(capsys, "export-onnx", *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("sled export-onnx: "), err


def test_export_onnx_says_what_it_waits_for_before_the_builder_runs(tmp_path, capsys,
                                                                     monkeypatch):
    """Into a pipe (no progress bar), `sled export-onnx` names the export on stderr at once."""
    import drafters.onnx_export as onnx_export

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    said_first = []

    def builder(source, checkpoint, partial, precision, provider, console):
        said_first.append(capsys.readouterr().err)
        (partial / "genai_config.json").write_text("{}")

    monkeypatch.setattr(onnx_export, "_run_builder", builder)
    code, _, err = run_main(capsys, "export-onnx", str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert code == 0 and (tmp_path / "out" / "genai_config.json").is_file()
    assert "exporting" in said_first[0] and "to ONNX (int4)" in said_first[0], said_first
