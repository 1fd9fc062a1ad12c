"""A device's connection to one verify server: model info, tokenizer bootstrap, the stub.

The target's tokenizer is fetched once per fingerprint and files digest (what the files are, which
the server names in its model info: two servers with one vocabulary can normalize, split or
template text otherwise) into sled.cache.tokenizer_dir. What the
server streams is checked chunk by chunk before anything is written (edge_client.tokenizer_chunks:
only the file names of sled.cache.TOKENIZER_FILES, once each, in order, each whole and matching
its sha256, within MAX_TOKENIZER_BYTES); the fingerprint is bounded (and only its hash names the
folder). The files are written into a temporary folder inside the cache, loaded (as an
edge_client.tokenizer.DeviceTokenizer: no transformers on the device) and checked against the
fingerprint there, and only then renamed into place with their manifest.
A cached copy is used only while its manifest verifies (every file hashed: they are small) and
the loaded tokenizer matches its fingerprint; anything else is fetched again. The manifest
records the fingerprint its files were checked against (written only after that check), so a
copy that verifies in full is not fingerprinted again (262k tokens for gemma3); a copy whose
manifest records none (or another) is, and gets it recorded when it matches. Either way the
tokenizer returned carries the fingerprint it was checked against (DeviceTokenizer.fingerprint),
so the daemon does not hash it again. A refused server
raises TokenizerRefused, one line naming the server. The channel keeps gRPC's default message
limits: every message of the protocol fits them.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
from pathlib import Path

import grpc

from sled.backoff import Backoff
from edge_client.security import ChannelSecurity, speaks_tls
from edge_client.tokenizer import DeviceTokenizer
from edge_client.tokenizer_chunks import TokenizerChunks, TokenizerRefused
from edge_client.transport import connect_error
from sled.cache import (MAX_FINGERPRINT_CHARS, CacheError, cache_dir, manifest_fingerprint,
                        partial_dir, publish, read_manifest, record_fingerprint, tokenizer_dir,
                        verify_folder, write_manifest)
from sled.wire.fingerprint import files_fingerprint, fingerprint_tokenizer, short
from sled.memory import release_freed_heap
from sled.printable import printable
from sled.v1 import verifier_pb2 as pb

log = logging.getLogger("sled.device")

BUSY_RETRIES = 5        # GetTokenizer asked again this many times while the server is busy
BUSY_PAUSE_S = 0.5      # the first pause; it doubles (0.5 + 1 + 2 + 4 + 8 s in all)


class Connection:
    def __init__(self, address: str, security: ChannelSecurity | None = None,
                 tls_name: str = "") -> None:
        """A channel to ADDRESS: plaintext, or as `security` says (TLS, the device's token on
        every call; the server's certificate checked for tls_name, default the host)."""
        security = security or ChannelSecurity()
        self.address = address
        self.security = security
        self.channel = security.channel(address, tls_name)
        self.stub = security.stub(self.channel)
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
        """The target's tokenizer made of exactly the files this server sends: a kept copy of
        those very files (ModelInfo.tokenizer_files_sha256) when it verifies, else fetched.
        Raises TokenizerRefused when what the server sends cannot be used."""
        info = await self.model_info()
        fingerprint = checked_fingerprint(info.tokenizer_fingerprint, self.address)
        files_sha256 = checked_files_sha256(info.tokenizer_files_sha256, self.address)
        tokenizer = None
        if files_sha256:       # a server that does not say what its files are: fetched each time
            tokenizer = await asyncio.to_thread(cached_tokenizer, fingerprint, files_sha256)
        if tokenizer is None:
            files = await self.tokenizer_files(fingerprint, timeout)
            tokenizer = await asyncio.to_thread(save_tokenizer, fingerprint, files, self.address,
                                                files_sha256)
        return tokenizer

    async def tokenizer_files(self, fingerprint: str, timeout: float = 60.0) -> dict[str, bytes]:
        """The server's tokenizer files. A server at its bound of GetTokenizer calls (a fleet
        starting at once) answers RESOURCE_EXHAUSTED: it is asked again after a pause that
        doubles, BUSY_RETRIES times, before its refusal is raised."""
        pauses, refused = Backoff(BUSY_PAUSE_S), 0
        while True:
            try:
                return await self._tokenizer_stream(fingerprint, timeout)
            except grpc.aio.AioRpcError as exc:
                refused += 1
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or refused > BUSY_RETRIES:
                    raise
                pause = pauses.next()
                log.info("the server at %s is busy sending its tokenizer (%s): asking again in "
                         "%.1f s", self.address, printable(exc.details() or "", 200), pause)
                await asyncio.sleep(pause)

    async def _tokenizer_stream(self, fingerprint: str, timeout: float) -> dict[str, bytes]:
        """One GetTokenizer stream, each chunk checked as it arrives; the call is cancelled at
        the first chunk refused."""
        chunks = TokenizerChunks(fingerprint, self.address)
        call = self.stub.GetTokenizer(pb.GetTokenizerRequest(), timeout=timeout)
        try:
            async for chunk in call:
                chunks.add(chunk)
        except TokenizerRefused:
            call.cancel()
            raise
        return chunks.files()

    async def explain(self, error: Exception) -> str:
        """Why a call failed, as one line (transport.connect_error); a plaintext call the server
        hung up on is checked for a server that speaks TLS."""
        plaintext_hangup = (not self.security.tls and isinstance(error, grpc.aio.AioRpcError)
                            and "Socket closed" in (error.details() or ""))
        tls = plaintext_hangup and await speaks_tls(self.address)
        return connect_error(self.address, error, tls=self.security.tls, speaks_tls=tls)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "Connection":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def checked_fingerprint(fingerprint: str, address: str) -> str:
    """The server's fingerprint when it can be one: non-empty, short, printable."""
    if not fingerprint or len(fingerprint) > MAX_FINGERPRINT_CHARS or not fingerprint.isprintable():
        raise TokenizerRefused(f"the server at {address} sent a malformed tokenizer fingerprint "
                               f"({len(fingerprint)} characters: {printable(fingerprint)})")
    return fingerprint


def checked_files_sha256(files_sha256: str, address: str) -> str:
    """The server's files fingerprint when it can be one ("" when it sends none)."""
    if files_sha256 and (len(files_sha256) > MAX_FINGERPRINT_CHARS or not files_sha256.isprintable()):
        raise TokenizerRefused(f"the server at {address} sent a malformed tokenizer files digest "
                               f"({len(files_sha256)} characters: {printable(files_sha256)})")
    return files_sha256


def cached_tokenizer(fingerprint: str, files_sha256: str):
    """The kept tokenizer with this fingerprint made of these files; None when it is not there
    or does not verify (a damaged or stale copy, fetched again by the next
    Connection.tokenizer())."""
    folder = tokenizer_dir(fingerprint, files_sha256)
    if not folder.exists():
        return None
    files, checked = read_manifest(folder), manifest_fingerprint(folder) == fingerprint
    if not verify_folder(folder, full=True) or _files_sha256(files) != files_sha256:
        log.warning("cached tokenizer %s is incomplete or damaged: fetching it again",
                    printable(short(fingerprint)))
        return None
    try:
        tokenizer = _load(folder)
    except Exception as exc:  # tokenizers raises plain Exception (and KeyError...) on bad files
        log.warning("cached tokenizer %s cannot be loaded (%s): fetching it again",
                    printable(short(fingerprint)), printable(str(exc), 200))
        return None
    if not checked:     # else these very files (hashed just now) were checked against it
        if _hashed(tokenizer) != fingerprint:
            log.warning("cached tokenizer %s does not match its fingerprint: fetching it again",
                        printable(short(fingerprint)))
            return None
        _record(folder, files, fingerprint)
    tokenizer.fingerprint = fingerprint     # nobody needs to hash its vocabulary again
    tokenizer.files_sha256 = files_sha256
    return tokenizer


def kept_tokenizer(fingerprint: str):
    """The one kept tokenizer with this fingerprint, whatever server sent it (a device's start
    before any server answers); None when there is none, or several (servers with other files:
    which one is meant is known only from the server the device binds to)."""
    folders = [folder for folder in (cache_dir() / "tokenizers").glob("*")
               if folder.is_dir() and manifest_fingerprint(folder) == fingerprint]
    files = read_manifest(folders[0]) if len(folders) == 1 else None
    return cached_tokenizer(fingerprint, _files_sha256(files)) if files else None


def _files_sha256(files: dict[str, dict] | None) -> str:
    """files_fingerprint of a manifest's entries (verified ones: their sha256 are the files')."""
    return files_fingerprint({name: entry["sha256"] for name, entry in (files or {}).items()})


def _record(folder: Path, files: dict[str, dict], fingerprint: str) -> None:
    """A copy from before manifests recorded fingerprints gets its fingerprint recorded (the
    entries verified above, not hashed again); a cache that cannot be written keeps working."""
    try:
        record_fingerprint(folder, files, fingerprint)
    except OSError as exc:
        log.debug("cannot record the fingerprint of cached tokenizer %s: %s",
                  printable(short(fingerprint)), exc)


def save_tokenizer(fingerprint: str, files: dict[str, bytes], address: str, files_sha256: str = ""):
    """Load the server's checked files (edge_client.tokenizer_chunks) from a temporary folder in
    the cache, and keep them (renamed into place with their manifest, under their fingerprint and
    what they are) only when they match the fingerprint, and the files digest the server named
    (files_sha256, when it named one). A cache that cannot be written (read-only, full, not a
    folder) is one line: CacheError."""
    sent = files_fingerprint({name: hashlib.sha256(content).hexdigest() for name, content in files.items()})
    if files_sha256 and sent != files_sha256:
        raise TokenizerRefused(f"the server at {address} sent other tokenizer files than its model "
                               f"info names ({short(sent)}, not {printable(short(files_sha256))})")
    folder = tokenizer_dir(fingerprint, sent)
    try:
        partial = partial_dir(folder)
        try:
            tokenizer = _checked_tokenizer(partial, fingerprint, files, address)
            write_manifest(partial, fingerprint)      # checked against it just now
            publish(partial, folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    except OSError as exc:
        raise CacheError(f"cannot keep the tokenizer in the cache folder "
                         f"{printable(str(folder.parent), 200)}: {exc.strerror or exc}") from None
    tokenizer.files_sha256 = sent
    return tokenizer


def _checked_tokenizer(partial: Path, fingerprint: str, files: dict[str, bytes], address: str):
    """The server's files written into PARTIAL and loaded, when they match the fingerprint."""
    for name, content in files.items():
        (partial / name).write_bytes(content)
    try:
        tokenizer = _load(partial)
    except Exception as exc:
        raise TokenizerRefused(f"the tokenizer the server at {address} sent cannot be loaded: "
                               f"{printable(str(exc), 200)}") from None
    if _hashed(tokenizer) != fingerprint:
        raise TokenizerRefused(f"the tokenizer the server at {address} sent does not match its "
                               f"fingerprint {printable(fingerprint)}")
    tokenizer.fingerprint = fingerprint     # checked just now
    return tokenizer


def _hashed(tokenizer) -> str:
    """The fingerprint of a tokenizer's vocabulary as loaded (the check itself, never a carried
    one), with the hash's freed heap given back."""
    fingerprint = fingerprint_tokenizer(tokenizer)
    release_freed_heap()
    return fingerprint


def _load(folder: Path) -> DeviceTokenizer:
    return DeviceTokenizer.load(folder)
