"""The README and the pages under docs/ are the user's contract: every `sled ...` line in their
code blocks is accepted by the real command line (flag for flag, no abbreviations), every file they
name exists, every module attribute they name (`edge_client.session.generate`) is there, and
every relative link resolves. The README stays short and links every docs/ page. Nothing is run.

Paths named in the text (`docs/serve.example.toml`, `lab/profiles.py`) are from the repository's
root wherever they appear, as the commands are run from there; a markdown link is relative to the
page it is in (`../BENCHMARKS.md` from docs/)."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
from pathlib import Path, PurePath

import pytest

from conftest import run_main
from sled_cli.main import COMMANDS, Command, Group, parser

ROOT = Path(__file__).resolve().parent.parent
README_LINES = 250
PAGES = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").glob("*.md"))
DOCUMENTS = {name: (ROOT / name).read_text() for name in ["README.md", *PAGES]}
README = DOCUMENTS["README.md"]

# What the documents write as a placeholder or a choice, and a value that stands for it here.
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


def prose(text: str) -> str:
    """The text without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def logical_lines(block: str) -> list[str]:
    """The block's lines with backslash continuations joined."""
    return re.sub(r"\\\n\s*", " ", block).splitlines()


def readme_commands(text: str = README) -> list[tuple[str, dict[str, str], list[str]]]:
    """(the line, its VAR=value prefix, the words after `sled`) of every sled command in the
    text's code blocks."""
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


def per_document(found) -> tuple[list[tuple], list[str]]:
    """found(text) over every document: the (document, item) pairs, and readable test ids."""
    pairs = [(name, item) for name, text in DOCUMENTS.items() for item in found(text)]
    return pairs, [f"{name}: {item[0] if isinstance(item, tuple) else item}"
                   for name, item in pairs]


COMMAND_LINES, COMMAND_IDS = per_document(readme_commands)


def shown(text: str) -> set[str]:
    """The first two words after `sled` of every command the text shows."""
    return {" ".join(words[:2]) for _, _, words in readme_commands(text)}


def test_the_docs_show_sled_commands():
    everywhere = set().union(*(shown(text) for text in DOCUMENTS.values()))
    assert {"serve --model", "generate --server", "device --config", "bench overhead",
            "sdsat train", "trace record", "models list", "export-onnx gemma3-270m",
            "certs certs", "broker-config DIR", "lab run", "lab compose"} <= everywhere


def test_the_readme_shows_each_users_first_commands():
    """The device daemon, the verify server (and a device against it), and the lab."""
    assert {"device --servers", "device --config", "serve --model", "generate --server",
            "lab run", "lab compose"} <= shown(README)


def check_command(env: dict[str, str], words: list[str], capsys, monkeypatch) -> None:
    entry = COMMANDS.get(words[0])
    if isinstance(entry, Command) and entry.own_argv:
        check_device_flags(env, words[1:], monkeypatch)
    else:
        assert not env or all(name.startswith("SLED_") for name in env), words
        check_parses(words, capsys)


@pytest.mark.parametrize("document, command", COMMAND_LINES, ids=COMMAND_IDS)
def test_every_documented_command_is_accepted_by_the_cli(document, command, capsys, monkeypatch):
    line, env, words = command
    check_command(env, words, capsys, monkeypatch)


def with_one_change(wrong: str, right: str) -> tuple[str, str]:
    """(document, its text) with the first code block that holds `right` holding `wrong` there
    instead: README.md first, then the pages in order."""
    for name, text in DOCUMENTS.items():
        for block in code_blocks(text):
            if right in block:
                return name, text.replace(block, block.replace(right, wrong, 1), 1)
    raise AssertionError(f"no code block shows {right!r}")


@pytest.mark.parametrize("wrong, right", [("--draft-lne", "--draft-len"),
                                          ("--max-new-token ", "--max-new-tokens "),
                                          ("--kv-budgt", "--kv-budget"),
                                          ("--policy.draft-length 8000",
                                           "--drafter gguf:gemma3-270m --port 8000")])
def test_a_misspelled_flag_fails_the_check(wrong, right, capsys, monkeypatch):
    """The check itself: a document with one flag misspelled (or cut short) does not pass."""
    name, changed = with_one_change(wrong, right)
    assert changed != DOCUMENTS[name]
    failures = 0
    for line, env, words in readme_commands(changed):
        try:
            check_command(env, words, capsys, monkeypatch)
        except (AssertionError, pytest.fail.Exception, Exception):
            failures += 1
    assert failures == 1, name


def link_targets(text: str) -> list[str]:
    """Every markdown link and image target outside code blocks, as written."""
    return re.findall(r"\]\(([^)\s]+)\)", prose(text))


def named_paths(text: str = README) -> list[str]:
    """Repository paths the text names from the root: docs/..., protos/..., a package's file.
    Not sled/...: MQTT topics (sled/devices/<id>/...) look like paths. Not link targets: those are
    relative to their page (checked below)."""
    roots = "docs|protos|edge_client|verify_server|drafters|lab|sled_cli|tests"
    text = re.sub(r"\]\([^)\s]*\)", "]", text)
    found = re.findall(rf"(?<![\w$/.])((?:{roots})/[\w./-]*[\w/])", text)
    found = [path for path in found if not re.search(r"[A-Z]{3,}", path)]   # not lab/bench/NAME.py
    return sorted(set(found))


PATHS, PATH_IDS = per_document(named_paths)


@pytest.mark.parametrize("document, path", PATHS, ids=PATH_IDS)
def test_every_path_the_docs_name_exists(document, path):
    assert (ROOT / path).exists(), f"{document} names {path}, which is not in the repository"


NOT_PYTHON = {"sled.v1.Verifier"}    # the gRPC service's full name


def named_attributes(text: str = README) -> list[str]:
    """`edge_client.session.generate`, `sled.printable`: dotted names in code spans."""
    spans = re.findall(r"`((?:edge_client|verify_server|drafters|lab|sled_cli|sled)(?:\.\w+)+)`",
                       text)
    return sorted(set(spans) - NOT_PYTHON)


ATTRIBUTES, ATTRIBUTE_IDS = per_document(named_attributes)


@pytest.mark.parametrize("document, name", ATTRIBUTES, ids=ATTRIBUTE_IDS)
def test_every_module_attribute_the_docs_name_exists(document, name):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            assert hasattr(found, attribute), f"{document} names {name}: no {attribute}"
            found = getattr(found, attribute)
        return
    pytest.fail(f"{document} names {name}, which does not import")


# -- the README's length and its links to docs/ ----------------------------------------------------

def test_the_readme_is_short():
    lines = len(README.splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines: move detail into docs/"


def readme_pages() -> set[str]:
    """The docs/*.md pages the README links to (anchors left off)."""
    return {target.split("#")[0] for target in link_targets(README)
            if re.fullmatch(r"docs/[^/]+\.md", target.split("#")[0])}


def test_every_docs_page_the_readme_links_to_exists():
    missing = sorted(page for page in readme_pages() if not (ROOT / page).is_file())
    assert not missing, f"README.md links to missing pages: {missing}"


def test_every_docs_page_is_linked_from_the_readme():
    unlinked = sorted(set(PAGES) - readme_pages())
    assert not unlinked, f"README.md does not link to {unlinked}"


@pytest.mark.parametrize("page", PAGES)
def test_every_docs_page_says_what_it_covers_and_links_back(page):
    """A title, then a first paragraph that says what the page covers and links to the README."""
    title, _, rest = DOCUMENTS[page].partition("\n\n")
    first = rest.split("\n\n", 1)[0]
    assert title.startswith("# ") and "\n" not in title, f"{page} does not start with a title"
    assert "](../README.md)" in first, f"{page}: its first paragraph does not link to the README"


# -- relative links ------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, no punctuation, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown text's headings (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", prose(text), re.M):
        base = slug(heading)
        out.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return out


def link_problem(document: str, target: str) -> str | None:
    """What is wrong with a relative link from a document (a path from the root), or None."""
    path, _, anchor = target.partition("#")
    found = ((ROOT / document).parent / path).resolve() if path else ROOT / document
    if not found.is_relative_to(ROOT):
        return f"{target}: outside the repository"
    if not found.exists():
        return f"{target}: no {found.relative_to(ROOT)} in the repository"
    if anchor and found.suffix == ".md" and anchor not in anchors(found.read_text()):
        return f"{target}: no heading with the anchor #{anchor} in {found.relative_to(ROOT)}"
    return None


def relative_links(text: str) -> list[str]:
    return sorted({target for target in link_targets(text)
                   if not re.match(r"[a-z][a-z0-9+.-]*:", target)})    # not https:, mailto:


LINKS, LINK_IDS = per_document(relative_links)


@pytest.mark.parametrize("document, target", LINKS, ids=LINK_IDS)
def test_every_relative_link_resolves(document, target):
    problem = link_problem(document, target)
    assert problem is None, f"{document} links to {problem}"


@pytest.mark.parametrize("document, target, resolves", [
    ("docs/lab.md", "../BENCHMARKS.md", True),
    ("docs/lab.md", "BENCHMARKS.md", False),          # from docs/, not from the root
    ("README.md", "docs/devices.md#mqtt-control-plane", True),
    ("README.md", "docs/devices.md#no-such-heading", False),
    ("docs/commands.md", "#token-trees---tree-n", True),
])
def test_the_link_check_resolves_from_the_page(document, target, resolves):
    assert (link_problem(document, target) is None) == resolves


def file_values(table: dict, prefix: str = "") -> dict[str, object]:
    """Every key a settings file sets, sections dotted (mqtt.host), as the file writes it."""
    flat: dict[str, object] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(file_values(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def as_loaded(value: object) -> object:
    """A file's value as the settings hold it: a size ("4GiB") in bytes, "" as none."""
    size = re.fullmatch(r"(\d+)([KMG])iB", value) if isinstance(value, str) else None
    if size:
        return int(size[1]) << {"K": 10, "M": 20, "G": 30}[size[2]]
    return None if value == "" else value


def held(settings: object, dotted: str) -> object:
    """The loaded value of a dotted key, a secret or a path as its text and "" as none."""
    for name in dotted.split("."):
        settings = getattr(settings, name)
    if hasattr(settings, "get_secret_value"):
        settings = settings.get_secret_value()
    if isinstance(settings, PurePath):
        settings = str(settings)
    return None if settings == "" else settings


# A valid value other than the example's, for keys whose type alone gives none: a choice, an
# address, a list.
OTHER_VALUES = {"dtype": "bfloat16", "engine": "paged", "flex_splits": "auto",
                "overlap_steps": "off", "host": "10.0.0.9",
                "policy.draft_len": "auto", "servers": ["10.0.0.3:50051"],
                "server_names": ["gpu-1.lan"], "api_hosts": ["pi5-kitchen.lan"],
                "api_origins": ["http://localhost:3000"]}


def other_value(key: str, value: object) -> object:
    """A valid value of `key` other than `value`: a flipped boolean, a number one off (a
    fraction halved), a size one unit more, a string one character longer."""
    if key in OTHER_VALUES:
        return OTHER_VALUES[key]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value - 1 if value > 1 else value + 1
    if isinstance(value, float):
        return value / 2 if value else 0.5
    assert isinstance(value, str), f"{key} = {value!r}: give it a value in OTHER_VALUES"
    size = re.fullmatch(r"(\d+)([KMG]iB)", value)
    if size:
        return f"{int(size[1]) + 1}{size[2]}"
    return value + "2" if value else "other"


def changed(table: dict, prefix: str = "") -> dict:
    """A settings file's table with every value other_value'd, sections kept."""
    return {key: changed(value, f"{prefix}{key}.") if isinstance(value, dict)
            else other_value(prefix + key, value) for key, value in table.items()}


def toml_text(table: dict) -> str:
    """A settings file's table as TOML: its keys, then a [section] per table. Values are
    written as JSON, which TOML reads alike for booleans, numbers, strings and their lists."""
    def lines(section: dict) -> str:
        return "".join(f"{key} = {json.dumps(value)}\n" for key, value in section.items()
                       if not isinstance(value, dict))
    return lines(table) + "".join(f"\n[{name}]\n{lines(section)}" for name, section in
                                  table.items() if isinstance(section, dict))


def wrongly_loaded(load_settings, path: Path) -> dict[str, tuple[object, object]]:
    """The keys of the file at `path` not loaded with the value it writes: (written, held)."""
    import tomllib

    written = file_values(tomllib.loads(path.read_text()))
    assert len(written) >= 20, sorted(written)
    loaded = load_settings(path)
    return {key: (value, held(loaded, key)) for key, value in written.items()
            if held(loaded, key) != as_loaded(value)}


@pytest.mark.parametrize("config", ["docs/serve.example.toml", "docs/device.example.toml"])
def test_the_example_configs_load(config, monkeypatch, tmp_path):
    """Every key the example sets is loaded with the value it writes (read here with tomllib,
    apart from the loader), untouched by the environment; and so is every key of a copy with
    every value changed: most of the example's values are the defaults, which a loader that
    dropped the key would give as well."""
    import tomllib

    monkeypatch.chdir(ROOT)
    for name in [n for n in os.environ if n.startswith(("SLED_DEVICE_", "SLED_SERVE_"))]:
        monkeypatch.delenv(name)
    if "device" in config:
        from edge_client.settings import load_settings
    else:
        from verify_server.settings import load_settings
    example = tomllib.loads((ROOT / config).read_text())
    copy = tmp_path / Path(config).name
    copy.write_text(toml_text(changed(example)))
    written, rewritten = file_values(example), file_values(tomllib.loads(copy.read_text()))
    assert rewritten.keys() == written.keys()
    assert not [key for key in written if rewritten[key] == written[key]]
    assert wrongly_loaded(load_settings, Path(config)) == {}
    assert wrongly_loaded(load_settings, copy) == {}


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
