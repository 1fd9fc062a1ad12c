"""A GGUF drafter's tokenizer fingerprint comes from the file's own token table (drafters.gguf),
with no transformers: it must be the fingerprint of the tokenizer transformers converts from the
same file, which is what a server serving that model reports, and it must see a changed table."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")   # drafters.gguf runs on it

from drafters.base import tokenizer_json_fingerprint  # noqa: E402
from sled.wire.fingerprint import fingerprint_vocab  # noqa: E402

ALIASES = ("smollm2-135m", "gemma3-270m")


def write_gguf(path: Path, model: str, tokens: list[str]) -> Path:
    """A tensor-free GGUF holding only a tokenizer model and token table."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))   # a fixed-size array the reader jumps over
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fingerprint_of(path: Path, cache: Path, monkeypatch) -> str:
    """drafters.gguf's fingerprint, computed afresh (an empty cache, nothing in memory)."""
    import drafters.gguf as gguf

    monkeypatch.setenv("SLED_CACHE", str(cache))
    monkeypatch.setattr(gguf, "_FINGERPRINTS", {})
    return gguf.gguf_fingerprint(path)


# -- small files: the rules -----------------------------------------------------------------

def test_a_different_token_table_gives_another_fingerprint(tmp_path, monkeypatch):
    tokens = ["<unk>", "a", "b", "ab"]
    first = write_gguf(tmp_path / "first.gguf", "gpt2", tokens)
    swapped = write_gguf(tmp_path / "swapped.gguf", "gpt2", ["<unk>", "b", "a", "ab"])
    longer = write_gguf(tmp_path / "longer.gguf", "gpt2", tokens + ["ba"])
    want = fingerprint_of(first, tmp_path / "cache", monkeypatch)
    assert want == fingerprint_vocab({t: i for i, t in enumerate(tokens)})
    assert fingerprint_of(swapped, tmp_path / "cache", monkeypatch) != want
    assert fingerprint_of(longer, tmp_path / "cache", monkeypatch) != want


def test_sentencepiece_spaces_are_spelled_as_transformers_does(tmp_path):
    from drafters.gguf import gguf_vocab

    tokens = ["<unk>", " a", "a b", "  "]
    sentencepiece = write_gguf(tmp_path / "sp.gguf", "llama", tokens)
    bpe = write_gguf(tmp_path / "bpe.gguf", "gpt2", tokens)
    assert gguf_vocab(sentencepiece) == {"<unk>": 0, "\u2581a": 1, "a\u2581b": 2, "\u2581\u2581": 3}
    assert gguf_vocab(bpe) == {t: i for i, t in enumerate(tokens)}


def test_a_file_that_is_not_gguf_is_said(tmp_path):
    from drafters.gguf import gguf_vocab

    for content in (b"", b"GGUF", b"not a gguf file at all"):
        (tmp_path / "bad.gguf").write_bytes(content)
        with pytest.raises(ValueError, match="cannot read the metadata"):
            gguf_vocab(tmp_path / "bad.gguf")


def test_a_gguf_without_a_tokenizer_is_said(tmp_path):
    from gguf import GGUFWriter

    from drafters.gguf import gguf_vocab

    writer = GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="carries no tokenizer"):
        gguf_vocab(tmp_path / "bare.gguf")


# -- the built-in models --------------------------------------------------------------------

def builtin_files(alias: str) -> tuple[Path, Path]:
    """(its GGUF, its converted transformers copy); skipped when the copy is not prepared."""
    from sled.models import converted_checkpoint, gguf_path

    converted = converted_checkpoint(alias)
    if converted is None:
        pytest.skip(f"{alias} has no converted copy in the sled cache (sled models prepare)")
    return gguf_path(alias), converted


# (the metadata reader against gguf.GGUFReader: tests/test_gguf_metadata.py)


@pytest.mark.slow
@pytest.mark.parametrize("alias", ALIASES)
def test_the_fingerprint_is_the_converted_tokenizers(alias, tmp_path, monkeypatch):
    path, converted = builtin_files(alias)
    assert fingerprint_of(path, tmp_path, monkeypatch) == \
        tokenizer_json_fingerprint(converted / "tokenizer.json")


@pytest.mark.slow
def test_the_fingerprint_is_transformers_own_conversion_of_the_gguf(tmp_path, monkeypatch):
    """transformers converting the file itself (smollm2: a few seconds; gemma3 takes long and
    goes through its converted copy above)."""
    from transformers import AutoTokenizer

    from sled.wire.fingerprint import fingerprint_tokenizer

    path, _ = builtin_files("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert fingerprint_of(path, tmp_path, monkeypatch) == fingerprint_tokenizer(tokenizer)


@pytest.fixture(scope="module", params=ALIASES)
async def served(request):
    """(alias, the address of a server serving it) for each built-in target."""
    import torch

    from verify_server.server import start_server
    from verify_server.target import Target

    alias = request.param
    _, converted = builtin_files(alias)
    torch.set_num_threads(2)
    running = await start_server(Target.load(str(converted), name=alias))
    yield alias, running.address
    await running.stop(grace=0)


@pytest.mark.slow
async def test_the_fingerprint_is_the_one_a_server_of_that_model_reports(served, tmp_path,
                                                                         monkeypatch):
    import grpc

    from sled.models import gguf_path
    from sled.v1 import verifier_pb2 as pb
    from sled.v1 import verifier_pb2_grpc as pb_grpc

    alias, address = served
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert fingerprint_of(gguf_path(alias), tmp_path, monkeypatch) == info.tokenizer_fingerprint
