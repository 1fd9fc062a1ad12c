"""The key-value metadata of a GGUF file, read without the gguf package.

gguf.GGUFReader reads the same values, but it makes a numpy view per array element: three arrays
of 262k (gemma3's tokens, scores and types) take it twenty seconds and more on a small CPU. This
walks the header (magic, version, tensor count, key-value count, then the key-value pairs, byte
order from the version as GGUFReader decides it), decodes the keys asked for and jumps over the
rest; tensors are never read.

A file may come from anywhere, so every count is checked against the bytes left before anything
is read or allocated: a string or array that runs past the end, a key-value count the file cannot
hold, an array of more than MAX_ITEMS items to decode, a nested array, an unknown value type or a
GGUF version other than 2 and 3 is a ValueError of one line, quickly and without a big allocation.
"""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

MAGIC = 0x46554747          # "GGUF" read as a little-endian uint32
VERSIONS = (2, 3)
MAX_ITEMS = 1 << 22         # items of one array to decode (gemma3's token table: 262k)
MIN_PAIR = 12               # the smallest key-value pair: empty key (8) and a uint8 (4 + 1)

# GGUF value types (the gguf package's GGUFValueType numbers)
STRING, ARRAY = 8, 9
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}        # type -> struct format of the fixed-size types


def read_metadata(path: Path, keys: tuple[str, ...]) -> dict:
    """The values of KEYS found in the GGUF file at PATH (a missing key is absent): numbers,
    strings, and lists of either."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:   # mmap refuses an empty file
                return _Header(b"").pairs(keys)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _Header(data).pairs(keys)
    except (ValueError, struct.error, OverflowError, UnicodeError) as exc:
        raise ValueError(f"cannot read the metadata of {path}: {_one_line(exc)}") from None


def _one_line(exc: Exception) -> str:
    if isinstance(exc, UnicodeError):
        return "a string is not UTF-8"
    if isinstance(exc, (struct.error, OverflowError)):
        return f"a value is out of range ({exc})"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class _Header:
    """A cursor over a GGUF header; each read first checks the bytes left."""

    def __init__(self, data) -> None:   # mmap.mmap or bytes
        self.data, self.offset = data, 0
        if len(data) < 24:
            raise ValueError(f"not a GGUF file (only {len(data)} bytes)")
        magic, version = struct.unpack_from("<II", data, 0)
        if magic != MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        self.order = ">" if version & 0xFFFF == 0 else "<"   # big-endian: the version swapped
        self.offset = 4
        version = self.number("I")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (only 2 and 3)")
        self.number("Q")                                     # tensors: not read here

    def pairs(self, keys: tuple[str, ...]) -> dict:
        count = self.number("Q")
        if count > self.remaining // MIN_PAIR:
            raise ValueError(f"{count} key-value pairs cut short at byte {self.offset} "
                             f"({self.remaining} bytes left)")
        found = {}
        for _ in range(count):
            key = self.string()
            kind = self.number("I")
            if key in keys:
                found[key] = self.value(kind)
            else:
                self.skip(kind)
        return found

    @property
    def remaining(self) -> int:
        return len(self.data) - self.offset

    def take(self, size: int, what: str) -> int:
        """The offset of the next SIZE bytes (WHAT), past them afterwards."""
        if size > self.remaining:
            raise ValueError(f"{what} cut short at byte {self.offset} (needs {size} bytes, "
                             f"{self.remaining} left)")
        start, self.offset = self.offset, self.offset + size
        return start

    def number(self, fmt: str):
        start = self.take(struct.calcsize(fmt), "a number")
        return struct.unpack_from(self.order + fmt, self.data, start)[0]

    def string(self) -> str:
        length = self.number("Q")
        start = self.take(length, "a string")
        return self.data[start:start + length].decode("utf-8")

    def array_head(self) -> tuple[int, int]:
        """(item type, length) of an array, the length checked against the bytes left."""
        item, length = self.number("I"), self.number("Q")
        if item == ARRAY:
            raise ValueError(f"nested arrays are not supported (byte {self.offset})")
        size = 8 if item == STRING else struct.calcsize(self._format(item))
        if length > self.remaining // size:
            raise ValueError(f"an array of {length} items cut short at byte {self.offset} "
                             f"({self.remaining} bytes left)")
        return item, length

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            return self.number(self._format(kind))
        item, length = self.array_head()
        if length > MAX_ITEMS:
            raise ValueError(f"an array of {length} items is more than {MAX_ITEMS} "
                             f"(byte {self.offset})")
        if item == STRING:
            return [self.string() for _ in range(length)]
        fmt = self._format(item)
        start = self.take(length * struct.calcsize(fmt), "an array")
        return list(struct.unpack_from(f"{self.order}{length}{fmt}", self.data, start))

    def skip(self, kind: int) -> None:
        if kind == STRING:
            self.take(self.number("Q"), "a string")
        elif kind != ARRAY:
            self.take(struct.calcsize(self._format(kind)), "a number")
        else:
            item, length = self.array_head()
            if item != STRING:   # fixed-size items: one jump
                self.take(length * struct.calcsize(self._format(item)), "an array")
                return
            for _ in range(length):
                self.take(self.number("Q"), "a string")

    def _format(self, kind: int) -> str:
        if kind not in SCALARS:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.offset - 4}")
        return SCALARS[kind]
