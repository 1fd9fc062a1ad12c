"""A warm `sled generate` pays only for what it must: the device's cached copy of the target's
tokenizer is fingerprinted once (its manifest records the fingerprint it was checked against),
the target's tokenizer loads while the drafter loads, and a phase cut short says it stopped.

Nothing here touches the shared ~/.cache/sled: each test has its own SLED_CACHE.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging

import pytest

import edge_client.connection as connection
from conftest import keep_tokenizer
from edge_client.connection import Connection, cached_tokenizer, save_tokenizer
from sled import progress
from sled.cache import (MANIFEST, manifest_fingerprint, read_manifest, tokenizer_dir,
                        verify_folder, write_manifest)
from sled.wire.fingerprint import fingerprint_tokenizer
from conftest import count_fingerprints


@pytest.fixture
def fingerprints(monkeypatch):
    """Counts the device's tokenizer fingerprintings (the slow part of a cached load)."""
    return count_fingerprints(monkeypatch, connection)


def _files(tokenizer, folder) -> dict[str, bytes]:
    tokenizer.save_pretrained(folder)
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def _same(a, b) -> bool:
    text = "def add(a, b):\n    return a + b  # ünïcødé"
    return (a(text).input_ids == b(text).input_ids and a.get_vocab() == b.get_vocab()
            and a.all_special_ids == b.all_special_ids)


# -- the cached tokenizer is fingerprinted once ----------------------------------------------

def test_a_fetched_tokenizer_is_not_fingerprinted_again_while_its_manifest_verifies(
        tokenizer, fingerprints, tmp_path, monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    fingerprint = fingerprint_tokenizer(tokenizer)
    saved = save_tokenizer(fingerprint, _files(tokenizer, tmp_path / "files"), "server:1")
    assert len(fingerprints) == 1                            # checked once, when written
    assert manifest_fingerprint(tokenizer_dir(fingerprint, saved.files_sha256)) == fingerprint
    for _ in range(3):
        assert _same(cached_tokenizer(fingerprint, saved.files_sha256), saved)
    assert len(fingerprints) == 1                            # never again while it verifies


def test_a_copy_whose_manifest_records_no_fingerprint_is_checked_once_then_recorded(
        tokenizer, fingerprints, tmp_path, monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    fingerprint = fingerprint_tokenizer(tokenizer)
    folder, digest = keep_tokenizer(tokenizer, fingerprint, tmp_path / "staging")
    write_manifest(folder)                                   # as written before fingerprints
    files = read_manifest(folder)
    assert cached_tokenizer(fingerprint, digest) is not None and len(fingerprints) == 1
    assert manifest_fingerprint(folder) == fingerprint and read_manifest(folder) == files
    assert cached_tokenizer(fingerprint, digest) is not None and len(fingerprints) == 1


def test_a_recorded_fingerprint_vouches_only_for_its_own_fingerprint(tokenizer, fingerprints,
                                                                      tmp_path, monkeypatch):
    """A manifest that records another fingerprint (a folder copied under another name) does not
    spare the check: the tokenizer is fingerprinted and refused."""
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    fingerprint = fingerprint_tokenizer(tokenizer)
    wrong = "sha256:" + "0" * 64
    folder, digest = keep_tokenizer(tokenizer, wrong, tmp_path / "staging")
    write_manifest(folder, fingerprint)
    assert cached_tokenizer(wrong, digest) is None and len(fingerprints) == 1
    assert manifest_fingerprint(folder) == fingerprint      # nothing recorded for the wrong one


@pytest.mark.parametrize("damage", ["edited", "added"])
def test_a_damaged_copy_with_a_recorded_fingerprint_is_not_used(damage, tokenizer, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    fingerprint = fingerprint_tokenizer(tokenizer)
    saved = save_tokenizer(fingerprint, _files(tokenizer, tmp_path / "files"), "server:1")
    folder = tokenizer_dir(fingerprint, saved.files_sha256)
    if damage == "edited":    # same size, mtime put back: only a full hash sees it
        path = folder / "tokenizer_config.json"
        stat, data = path.stat(), path.read_bytes()
        path.write_bytes(data.replace(b"<", b">", 1))
        import os
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    else:
        (folder / "added_tokens.json").write_text("{}")
    assert cached_tokenizer(fingerprint, saved.files_sha256) is None


def test_a_rehashed_folder_keeps_its_recorded_fingerprint(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    write_manifest(tmp_path, "sha256:ab")
    (tmp_path / "a.json").touch()                            # same content, new mtime
    assert verify_folder(tmp_path) and manifest_fingerprint(tmp_path) == "sha256:ab"
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["files"]["a.json"]["mtime_ns"] == (tmp_path / "a.json").stat().st_mtime_ns
    write_manifest(tmp_path)
    assert manifest_fingerprint(tmp_path) is None


# -- the drafter loads before the target's tokenizer, not beside it ---------------------------

async def test_generate_loads_the_drafter_before_the_targets_tokenizer(
        serve, models, tokenizer, tmp_path, monkeypatch, capsys):
    """Both may import transformers, whose lazy imports fail from two threads at once
    ("cannot import name AutoModelForCausalLM" for an hf: drafter): one after the other."""
    from drafters.ngram import NgramDrafter
    from sled_cli import generate

    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    server = await serve(models["llama"])
    async with Connection(server.address) as conn:           # the device's cache is warm
        await conn.tokenizer()
    order = []
    real_cached = connection.cached_tokenizer

    def cached(fingerprint, files_sha256):
        order.append("tokenizer")
        return real_cached(fingerprint, files_sha256)

    def load_drafter(spec, q_support=32):
        order.append("drafter")
        return NgramDrafter()

    monkeypatch.setattr(connection, "cached_tokenizer", cached)
    monkeypatch.setattr(generate, "load_drafter", load_drafter)
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(["--server", server.address, "--prompt", "def add(a, b):",
                              "--max-new-tokens", "8", "--json"])
    assert await generate.run(args) == 0
    assert order == ["drafter", "tokenizer"]
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 8


async def test_generate_says_a_wrong_drafter_before_an_unreachable_server(capsys):
    from lab.server_process import free_port
    from sled_cli import generate

    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(["--server", f"127.0.0.1:{free_port()}", "--prompt", "hi",
                              "--drafter", "magic:x"])
    assert await generate.run(args) == 2
    assert "unknown drafter spec 'magic:x'" in capsys.readouterr().err


# -- a phase cut short says it stopped ---------------------------------------------------------

def _cancelled():
    raise asyncio.CancelledError


def _interrupted():
    raise KeyboardInterrupt


def _failed():
    raise ValueError("no such file")


@pytest.mark.parametrize("end", [_interrupted, _cancelled, _failed])
@pytest.mark.parametrize("terminal", [True, False])
def test_a_phase_ended_by_any_exception_says_it_stopped(end, terminal, monkeypatch, capsys,
                                                        caplog):
    monkeypatch.setattr(progress, "on_terminal", lambda: terminal)
    caplog.set_level(logging.DEBUG, logger="sled.progress")
    with pytest.raises(BaseException) as raised:
        with progress.phase("test.phase", "loading the test"):
            end()
    assert not isinstance(raised.value, SystemExit)
    err = capsys.readouterr().err
    assert "done in" not in err and "done in" not in caplog.text
    assert "phase test.phase stopped after" in caplog.text
    if terminal:
        assert "loading the test... stopped after" in err
    assert progress.TIMINGS[-1][0] == "test.phase"


@pytest.mark.parametrize("terminal", [True, False])
def test_a_finished_phase_says_done(terminal, monkeypatch, capsys, caplog):
    monkeypatch.setattr(progress, "on_terminal", lambda: terminal)
    caplog.set_level(logging.DEBUG, logger="sled.progress")
    with progress.phase("test.phase", "loading the test"):
        pass
    err = capsys.readouterr().err
    assert "stopped" not in err and "phase test.phase done in" in caplog.text
    if terminal:
        assert "loading the test... done in" in err
