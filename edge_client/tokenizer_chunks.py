"""The tokenizer files of one GetTokenizer stream, checked chunk by chunk as they arrive.

A server sends its files one after another, each in chunks of at most MAX_TOKENIZER_CHUNK_BYTES
in order from offset 0, every chunk carrying the fingerprint, the file's size and its sha256.
Nothing is kept that breaks a rule: a name outside TOKENIZER_FILES, a file sent twice, a chunk
out of place, one too big, bytes past the declared size, more than MAX_TOKENIZER_BYTES declared
in all, a digest that does not match, another fingerprint. Any of these is TokenizerRefused, one
line naming the server. Memory is bounded by the declared sizes, checked before any byte is kept.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from sled.cache import (MAX_TOKENIZER_BYTES, MAX_TOKENIZER_CHUNK_BYTES, TOKENIZER_FILES,
                        CacheError)
from sled.printable import printable
from sled.v1 import verifier_pb2 as pb

HEX = frozenset("0123456789abcdef")


class TokenizerRefused(CacheError):
    """The server's tokenizer (its fingerprint, files or content) is not acceptable."""


@dataclass(slots=True)
class IncomingFile:
    """One file being received: what its first chunk declared, and the bytes so far."""
    name: str
    size: int
    sha256: str
    data: bytearray = field(default_factory=bytearray)
    digest: "hashlib._Hash" = field(default_factory=hashlib.sha256)

    @property
    def complete(self) -> bool:
        return len(self.data) == self.size


class TokenizerChunks:
    """Assembles the chunks of one stream into {name: bytes}; add() each chunk, then files()."""

    def __init__(self, fingerprint: str, address: str) -> None:
        self.fingerprint = fingerprint
        self.address = address
        self.done: dict[str, bytes] = {}
        self.current: IncomingFile | None = None   # the file whose chunks are arriving
        self.declared = 0                          # bytes of every file started, by their sizes

    def add(self, chunk: pb.TokenizerChunk) -> None:
        """Check one chunk against everything before it, then keep its bytes."""
        self._check_chunk(chunk)
        if self.current is None:
            self.current = self._start(chunk)
        incoming = self.current
        self._check_place(incoming, chunk)
        incoming.data += chunk.data
        incoming.digest.update(chunk.data)
        if incoming.complete:
            self._finish(incoming)

    def files(self) -> dict[str, bytes]:
        """Every file, once the stream has ended: none may be left incomplete."""
        if self.current is not None:
            self.refuse(f"ended the tokenizer stream inside {printable(self.current.name)} "
                        f"({len(self.current.data)} of {self.current.size} bytes)")
        if not self.done:
            self.refuse("sent no tokenizer files")
        return self.done

    def refuse(self, what: str) -> None:
        raise TokenizerRefused(f"the server at {self.address} {what}")

    def _check_chunk(self, chunk: pb.TokenizerChunk) -> None:
        """What any chunk must be: of this fingerprint, at most one chunk's worth of data."""
        if chunk.tokenizer_fingerprint != self.fingerprint:
            self.refuse(f"sent the tokenizer of another fingerprint "
                        f"({printable(chunk.tokenizer_fingerprint)})")
        if len(chunk.data) > MAX_TOKENIZER_CHUNK_BYTES:
            self.refuse(f"sent a tokenizer chunk of {len(chunk.data)} bytes "
                        f"(at most {MAX_TOKENIZER_CHUNK_BYTES})")

    def _start(self, chunk: pb.TokenizerChunk) -> IncomingFile:
        """A new file: an accepted name, not sent before, a digest, a size within the bound."""
        name = chunk.name
        if name not in TOKENIZER_FILES:   # never a path, never anything else
            self.refuse(f"sent a tokenizer file named {printable(name)}; "
                        f"accepted: {', '.join(sorted(TOKENIZER_FILES))}")
        if name in self.done:
            self.refuse(f"sent the tokenizer file {name} twice")
        if len(chunk.sha256) != 64 or not set(chunk.sha256) <= HEX:
            self.refuse(f"sent {name} with a malformed sha256 ({printable(chunk.sha256)})")
        self.declared += chunk.size
        if self.declared > MAX_TOKENIZER_BYTES:
            self.refuse(f"sent {self.declared} bytes of tokenizer files "
                        f"(at most {MAX_TOKENIZER_BYTES})")
        return IncomingFile(name, chunk.size, chunk.sha256)

    def _check_place(self, incoming: IncomingFile, chunk: pb.TokenizerChunk) -> None:
        """The chunk continues the current file exactly where it stands, within its size."""
        if chunk.name != incoming.name:
            self.refuse(f"began {printable(chunk.name)} before {incoming.name} was complete "
                        f"({len(incoming.data)} of {incoming.size} bytes)")
        if (chunk.size, chunk.sha256) != (incoming.size, incoming.sha256):
            self.refuse(f"changed the size or sha256 of {incoming.name} between its chunks")
        if chunk.offset != len(incoming.data):
            self.refuse(f"sent {incoming.name} out of order (a chunk at offset {chunk.offset}, "
                        f"expected {len(incoming.data)})")
        if not chunk.data and incoming.size:
            self.refuse(f"sent an empty chunk of {incoming.name}")
        if chunk.offset + len(chunk.data) > incoming.size:
            self.refuse(f"sent more of {incoming.name} than its size of {incoming.size} bytes")

    def _finish(self, incoming: IncomingFile) -> None:
        if incoming.digest.hexdigest() != incoming.sha256:
            self.refuse(f"sent {incoming.name} whose bytes do not match its sha256")
        self.done[incoming.name] = bytes(incoming.data)
        self.current = None
