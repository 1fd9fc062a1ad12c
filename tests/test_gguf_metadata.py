"""sled.gguf_metadata reads a GGUF file's key-value metadata as gguf.GGUFReader does, and a
hostile file (built here byte by byte) is a one-line ValueError, quickly and with no big
allocation: a GGUF file may come from anywhere, and a device reads its token table at start-up."""
from __future__ import annotations

import struct
import time
import tracemalloc
from pathlib import Path

import pytest

from sled.gguf_metadata import MAX_ITEMS, read_metadata

TOKENS = "tokenizer.ggml.tokens"
U32, STR, ARR = 4, 8, 9


def text(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("<Q", len(raw)) + raw


def header(pairs: int, version: int = 3) -> bytes:
    return struct.pack("<IIQQ", 0x46554747, version, 0, pairs)


def nested(depth: int) -> bytes:
    """An array of an array of ... (DEPTH levels) of no uint32."""
    return struct.pack("<I", ARR) + struct.pack("<IQ", ARR, 1) * depth + struct.pack("<IQ", U32, 0)


HOSTILE = {
    "nested arrays, skipped": (header(1) + text("x.nested") + nested(5000), "nested arrays"),
    "nested arrays, read": (header(1) + text(TOKENS) + nested(5000), "nested arrays"),
    "a string of 2**63 bytes": (header(1) + struct.pack("<Q", 2**63) + b"abc" + b"\0" * 64,
                                "cut short at byte 32"),
    "a string past the end": (header(1) + text(TOKENS) + struct.pack("<IIQ", ARR, STR, 2)
                              + text("ab") + struct.pack("<Q", 1000) + b"cd", "cut short at byte"),
    "an array of 2**63 strings": (header(1) + text(TOKENS) + struct.pack("<IIQ", ARR, STR, 2**63)
                                  + struct.pack("<Q", 0) * 10, "cut short at byte"),
    "an array of 2**62 floats, skipped": (header(1) + text("x.scores")
                                          + struct.pack("<IIQ", ARR, 6, 2**62) + b"\0" * 64,
                                          "cut short at byte"),
    "2**63 key-value pairs": (header(2**63) + text("a") + struct.pack("<II", U32, 1),
                              "key-value pairs cut short at byte 24"),
    "a key-value pair cut short": (header(1) + text("key") + struct.pack("<I", U32) + b"\1",
                                   "cut short at byte"),
    "an unknown value type": (header(1) + text("k") + struct.pack("<I", 99) + b"\0" * 16,
                              "unknown GGUF value type 99"),
    "GGUF version 1": (header(1, version=1) + text("k") + struct.pack("<II", U32, 1),
                       "version 1 is not supported"),
    "GGUF version 4": (header(1, version=4) + text("k") + struct.pack("<II", U32, 1),
                       "version 4 is not supported"),
    "a key that is not UTF-8": (header(1) + struct.pack("<Q", 2) + b"\xff\xfe"
                                + struct.pack("<II", U32, 1), "not UTF-8"),
    "empty": (b"", "not a GGUF file"),
    "the magic only": (b"GGUF", "not a GGUF file"),
    "another format": (b"PK\3\4" + b"\0" * 40, "bad magic"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_file_is_one_line_quickly_and_small(name, tmp_path):
    data, said = HOSTILE[name]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ValueError, match=said) as raised:
            read_metadata(path, (TOKENS,))
        took = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(raised.value)
    assert message.startswith(f"cannot read the metadata of {path}: ") and "\n" not in message
    assert took < 1.0 and peak < 1 << 20, (took, peak)


def test_an_array_too_long_to_decode_is_refused_but_can_be_skipped(tmp_path):
    """More than MAX_ITEMS items: refused when asked for, jumped over when not."""
    count = MAX_ITEMS + 1
    body = text("x.big") + struct.pack("<IIQ", ARR, 0, count) + b"\0" * count
    path = tmp_path / "big.gguf"
    path.write_bytes(header(2) + body + text("x.after") + struct.pack("<II", U32, 7))
    assert read_metadata(path, ("x.after",)) == {"x.after": 7}
    with pytest.raises(ValueError, match=f"more than {MAX_ITEMS}"):
        read_metadata(path, ("x.big",))


@pytest.mark.parametrize("tokens", [
    struct.pack("<II", U32, 7),                                    # a number
    struct.pack("<I", STR) + text("abc"),                          # a string
    struct.pack("<IIQ", ARR, U32, 3) + struct.pack("<III", 1, 2, 3),  # an array of numbers
])
def test_a_token_table_that_is_not_strings_names_the_file(tokens, tmp_path):
    pytest.importorskip("llama_cpp")   # drafters.gguf runs on it
    from drafters.gguf import gguf_vocab

    path = tmp_path / "odd.gguf"
    path.write_bytes(header(1) + text(TOKENS) + tokens)
    with pytest.raises(ValueError, match="is not a list of strings") as raised:
        gguf_vocab(path)
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)


# -- the same values as gguf.GGUFReader ----------------------------------------------------------

def reader_fields(path: Path) -> dict:
    """Every key-value pair of PATH as gguf.GGUFReader reads it (its GGUF.* header entries left
    out)."""
    from gguf import GGUFReader

    return {key: field.contents() for key, field in GGUFReader(str(path)).fields.items()
            if not key.startswith("GGUF.")}


def test_every_value_type_reads_as_gguf_reader_does(tmp_path):
    gguf = pytest.importorskip("gguf")

    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for kind, value in (("uint8", 200), ("int8", -5), ("uint16", 60000), ("int16", -300),
                        ("uint32", 4_000_000_000), ("int32", -7), ("uint64", 2**63 + 1),
                        ("int64", -(2**40)), ("float32", 0.25), ("float64", 1e300),
                        ("bool", True), ("string", "ünï 🙂")):
        getattr(writer, f"add_{kind}")(f"x.{kind}", value)
    writer.add_array("x.strings", ["a", "", "b c"])
    writer.add_array("x.ints", [1, 2, 3])
    writer.add_array("x.floats", [0.5, -1.5])
    writer.add_array("x.empty", [])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    want = reader_fields(path)
    assert read_metadata(path, tuple(want)) == want
    assert read_metadata(path, ("x.int8", "x.absent")) == {"x.int8": -5}


@pytest.mark.slow
def test_the_builtin_ggufs_read_as_gguf_reader_does():
    """Every key of smollm2's GGUF, and its chat template (gemma3's takes GGUFReader too long;
    its token table is checked through its fingerprint in test_gguf_fingerprint)."""
    pytest.importorskip("gguf")
    from sled.chat_templates import gguf_chat_template
    from sled.models import gguf_path

    path = gguf_path("smollm2-135m")
    if not path.is_file():
        pytest.skip("needs the prepared smollm2-135m GGUF (sled models prepare)")
    want = reader_fields(path)
    assert read_metadata(path, tuple(want)) == want
    assert gguf_chat_template(path) == want["tokenizer.chat_template"]
