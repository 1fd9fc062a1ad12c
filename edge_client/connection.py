"""A device's connection to one verify server: model info, tokenizer bootstrap, the stub.

The target's tokenizer is fetched once per fingerprint into sled.cache.tokenizer_dir and checked
against that fingerprint whenever it is loaded from there (cached_tokenizer).
"""
from __future__ import annotations

import logging
import shutil

import grpc

from sled.cache import tokenizer_dir
from sled.fingerprint import fingerprint_tokenizer, short
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc

log = logging.getLogger("sled.device")

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 30_000),
]
COMPLETE = ".complete"        # written last: the folder holds every file the server sent


class Connection:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.VerifierStub(self.channel)
        self._info: pb.ModelInfo | None = None

    async def model_info(self, timeout: float = 30.0, wait_for_ready: bool = True,
                         refresh: bool = False) -> pb.ModelInfo:
        """wait_for_ready=False fails at once (UNAVAILABLE) when nothing listens at the address;
        refresh=True asks again instead of answering from the first reply."""
        if self._info is None or refresh:
            self._info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout,
                                                      wait_for_ready=wait_for_ready)
        return self._info

    async def tokenizer(self, timeout: float = 60.0):
        """The target's tokenizer: from the cache when it is there and verifies, else fetched."""
        info = await self.model_info()
        tokenizer = cached_tokenizer(info.tokenizer_fingerprint)
        if tokenizer is None:
            files = await self.stub.GetTokenizer(pb.GetTokenizerRequest(), timeout=timeout)
            tokenizer = _save_tokenizer(info.tokenizer_fingerprint, files)
        return tokenizer

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "Connection":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def cached_tokenizer(fingerprint: str):
    """The tokenizer with this fingerprint from the cache; None when it is not there or does not
    verify (a damaged or stale copy, fetched again by the next Connection.tokenizer())."""
    folder = tokenizer_dir(fingerprint)
    if not (folder / COMPLETE).exists():
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        log.warning("cached tokenizer %s cannot be loaded (%s): fetching it again", short(fingerprint), exc)
        return None
    if fingerprint_tokenizer(tokenizer) != fingerprint:
        log.warning("cached tokenizer %s does not match its fingerprint: fetching it again",
                    short(fingerprint))
        return None
    return tokenizer


def _save_tokenizer(fingerprint: str, files: pb.TokenizerFiles):
    """Write the server's tokenizer files into the cache (plain file names only) and load them."""
    from transformers import AutoTokenizer

    folder = tokenizer_dir(fingerprint)
    shutil.rmtree(folder, ignore_errors=True)       # no file of an older copy survives
    folder.mkdir(parents=True, exist_ok=True)
    for item in files.files:
        if not _plain_name(item.name):
            raise ValueError(f"the server sent a tokenizer file named {item.name!r}")
        (folder / item.name).write_bytes(item.content)
    (folder / COMPLETE).touch()
    return AutoTokenizer.from_pretrained(str(folder))


def _plain_name(name: str) -> bool:
    """A file name with no folder in it that cannot stand for the folder or its parent."""
    return bool(name) and name not in (".", "..", COMPLETE) and "/" not in name and "\\" not in name \
        and "\0" not in name
