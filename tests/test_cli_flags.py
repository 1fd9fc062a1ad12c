"""Every flag of every command as the parser sees it: --help shows each flag with a line and its
default, a value out of range is one line and exit 2 (never a traceback), a mistyped drafter
alias lists the aliases, and `sled models list` into a pipe is plain text."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from sled.models import BUILTIN
from conftest import run_main
from sled_cli.main import COMMANDS, Command, Group, parser


def command_names(table: dict = COMMANDS, prefix: tuple = ()) -> list[tuple[str, ...]]:
    """Every runnable command as the words that name it, e.g. ("bench", "serve")."""
    out = []
    for name, entry in table.items():
        if isinstance(entry, Group):
            out += command_names(entry.commands, (*prefix, name))
        else:
            out.append((*prefix, name))
    return out


def subparser(words: tuple[str, ...]) -> argparse.ArgumentParser:
    found = parser()
    for word in words:
        action = next(a for a in found._actions if isinstance(a, argparse._SubParsersAction))
        found = action.choices[word]
    return found


def own_argv(words: tuple[str, ...]) -> bool:
    entry = COMMANDS[words[0]]
    return isinstance(entry, Command) and entry.own_argv


def flag_lines(help_text: str) -> dict[str, str]:
    """--help's options, each flag with the text of its help entry (continued lines joined)."""
    entries, current = {}, None
    for line in help_text.splitlines():
        stripped = line.strip()
        if line.startswith("  -") or line.startswith("  --"):
            current = stripped.split()[0].rstrip(",")
            entries[current] = stripped
        elif current and line.startswith("        "):
            entries[current] += " " + stripped
        else:
            current = None
    return entries


@pytest.mark.parametrize("words", [w for w in command_names() if not own_argv(w)], ids=" ".join)
def test_help_shows_every_flag_with_a_line_and_its_default(capsys, words):
    code, out, _ = run_main(capsys, *words, "--help")
    assert code == 0
    entries = flag_lines(out)
    for action in subparser(words)._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        if action.help == argparse.SUPPRESS:       # an old name kept for one release, not shown
            assert action.option_strings[0] not in entries
            continue
        text = entries[action.option_strings[0]]
        assert action.help, f"{' '.join(words)} {action.option_strings[0]}: no help line"
        assert action.required or "default" in text, f"{' '.join(words)}: {text}"


def test_device_help_names_every_setting(capsys):
    code, out, _ = run_main(capsys, "device", "--help")
    assert code == 0 and "--config" in out and "usage:" in out


@pytest.mark.parametrize("words", [("generate",), ("run-device",), ("serve",),
                                   ("sdsat", "train"), ("trace", "record"), ("export-onnx",)],
                         ids=" ".join)
def test_model_and_drafter_help_list_the_builtin_aliases(capsys, words):
    _, out, _ = run_main(capsys, *words, "--help")
    assert all(alias in " ".join(out.split()) for alias in BUILTIN), out


GENERATE = ("generate", "--server", "127.0.0.1:1", "--prompt", "x")
BAD_FLAGS = [
    (GENERATE, "--max-new-tokens", "-1"),
    (GENERATE, "--max-new-tokens", "0"),
    (GENERATE, "--max-new-tokens", "many"),
    (GENERATE, "--draft-len", "0"),
    (GENERATE, "--lookahead", "-2"),
    (GENERATE, "--temperature", "nan"),
    (GENERATE, "--temperature", "-0.5"),
    (GENERATE, "--top-p", "0"),
    (GENERATE, "--top-p", "1.5"),
    (GENERATE, "--top-k", "-1"),
    (GENERATE, "--seed", "-3"),
    (GENERATE, "--stop-id", "-1"),
    (("demo",), "--prompts", "0"),
    (("demo",), "--max-new-tokens", "-5"),
    (("run-device", "--server", "127.0.0.1:1"), "--draft-len", "0"),
    (("run-device", "--server", "127.0.0.1:1"), "--max-new-tokens", "1e3"),
    (("trace", "record", "--out", "t.jsonl"), "--max-k", "0"),
    (("trace", "record", "--out", "t.jsonl"), "--prompts", "-1"),
    (("sdsat", "train", "--model", "m", "--corpus", "c", "--out", "o"), "--steps", "0"),
    (("sdsat", "train", "--model", "m", "--corpus", "c", "--out", "o"), "--heldout", "1"),
    (("sdsat", "train", "--model", "m", "--corpus", "c", "--out", "o"), "--lr", "inf"),
    (("sdsat", "train", "--model", "m", "--corpus", "c", "--out", "o", "--mode", "lora"), "--rank", "0"),
    (("sdsat", "train", "--model", "m", "--corpus", "c", "--out", "o", "--mode", "lora"), "--cuts", "-2"),
    (("sdsat", "train", "--model", "m", "--corpus", "c", "--out", "o", "--mode", "lora"),
     "--embedding-lr", "nan"),
    (("bench", "sdsat"), "--temperature", "-0.5"),
    (("generate", "--server", "127.0.0.1:1", "--prompt", "p"), "--hints", "sometimes"),
    (("bench", "overhead"), "--rounds", "-1"),
    (("bench", "engine"), "--reps", "-3"),
    (("bench", "serve"), "--target-rate", "nan"),
    (("bench", "device"), "--min-confidence", "-1"),
    (("bench", "reliability"), "--idle-timeout", "inf"),
    (("bench", "drafter", "--model", "gguf:x"), "--tokens", "-1"),
    (("bench", "sdsat"), "--devices", "-1"),
    (("bench", "acceptance"), "--devices", "x"),
    (("serve", "--model", "m"), "--max-sessions", "-1"),
    (("serve", "--model", "m"), "--port", "abc"),
    (("serve", "--model", "m"), "--trusted-proxy", "10.0.0.300"),
    (("serve", "--model", "m"), "--trusted-proxy", "10.0.0.5/8"),
    (("serve", "--model", "m"), "--proxy-cert-header", "grpc-client-cert"),
    (("device",), "--port", "-1"),
    (("device",), "--max-new-tokens", "nan"),
]


@pytest.mark.parametrize("before, flag, value", BAD_FLAGS,
                         ids=[f"{' '.join(b[:2])} {f} {v}" for b, f, v in BAD_FLAGS])
def test_a_bad_flag_value_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path, before, flag,
                                                 value):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, *before, flag, value)
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if not line.startswith(("usage:", " "))]
    assert len(errors) == 1, err
    assert flag.lstrip("-").replace("-", "_") in errors[0].replace("-", "_"), err


def test_a_mistyped_drafter_alias_lists_the_aliases(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for spec in ("gguf:gemma3-270", "onnx:smollm2"):
        code, _, err = run_main(capsys, *GENERATE, "--drafter", spec)
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert "neither a" in err and "built-in alias" in err, err
        assert all(alias in err for alias in BUILTIN), err


def test_the_alias_check_leaves_paths_to_the_drafter(tmp_path):
    from drafters import load_drafter

    with pytest.raises(FileNotFoundError):
        load_drafter(f"gguf:{tmp_path / 'nope.gguf'}")


def test_models_list_into_a_pipe_is_plain_with_full_paths():
    done = subprocess.run([sys.executable, "-m", "sled_cli.main", "models", "list"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split("\t")[0] == "alias"
    assert "…" not in done.stdout and not any(c in done.stdout for c in "│┃━─┏")
    rows = {line.split("\t")[0]: line.split("\t") for line in lines[1:]}
    assert set(rows) == set(BUILTIN)
    assert all(len(row) == 5 for row in rows.values())
