"""What a device needs before it serves, and where each comes from: its drafter (loaded from
settings.drafter, shared by every session), the target's tokenizer (a local folder, a kept copy,
else the first compatible server's), the target's EOS ids and model name (from that server),
and the device's cache salt (edge_client.salt). One Bootstrap owns them; edge_client.daemon.Device
reads them through it."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc

from drafters import bind_target_tokenizer
from drafters.base import Drafter
from edge_client.connection import kept_tokenizer
from edge_client.drafting import SharedDrafter
from edge_client.salt import device_salt
from edge_client.servers import NoServer, ServerDirectory
from edge_client.settings import DeviceSettings, SettingsError
from edge_client.tokenizer import DeviceTokenizer, tokenizer_fingerprint
from sled.cache import CacheError
from sled.wire.fingerprint import short
from sled.printable import printable


class Bootstrap:
    def __init__(self, directory: ServerDirectory, load_drafter: Callable[[str], Drafter],
                 tokenizer=None, model_id: str = "") -> None:
        self.directory = directory
        self.load_drafter = load_drafter
        self.tokenizer = tokenizer
        self.drafter: SharedDrafter | None = None
        self.eos_ids: list[int] = []
        self.model_id = model_id
        self.cache_salt = ""      # secret to this device (edge_client.salt), known from load()

    @property
    def ready(self) -> bool:
        return self.tokenizer is not None and self.drafter is not None

    async def load(self, settings: DeviceSettings) -> None:
        """The cache salt, the drafter, and the tokenizer the device has without a server."""
        self.cache_salt = await asyncio.to_thread(device_salt, settings.id)
        self.drafter = SharedDrafter(await asyncio.to_thread(self.load_drafter, settings.drafter))
        if self.tokenizer is None and settings.tokenizer:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, settings.tokenizer)
        if self.tokenizer is None and self.drafter.tokenizer_fingerprint:
            # a target tokenizer fetched from a server earlier: until a server is reached, for
            # its files may not be the ones that server sends (see from_server)
            self.tokenizer = await asyncio.to_thread(kept_tokenizer, self.drafter.tokenizer_fingerprint)
        self.set_fingerprint(settings)
        self.bind(self.drafter)

    def set_fingerprint(self, settings: DeviceSettings) -> None:
        """The tokenizer servers must share: the drafter's own, else the local tokenizer's (the
        fingerprint its files were checked against when it carries one: not hashed again)."""
        own = tokenizer_fingerprint(self.tokenizer) if self.tokenizer is not None else ""
        fingerprint = (self.drafter.tokenizer_fingerprint if self.drafter else None) or own
        self.directory.set_fingerprint(fingerprint)
        if own and own != fingerprint:
            raise SettingsError(f"tokenizer {settings.tokenizer or '(cached)'} does not match the "
                                f"drafter {settings.drafter}: {short(fingerprint)} expected "
                                f"(xtok:{settings.drafter} drafts across tokenizers)")

    def bind(self, drafter: SharedDrafter) -> None:
        """A drafter that drafts across tokenizers (xtok:) gets the target's, once known."""
        if self.tokenizer is not None:
            bind_target_tokenizer(drafter.inner, self.tokenizer)

    async def from_server(self, settings: DeviceSettings) -> tuple[str, str]:
        """Take what is still missing (tokenizer, EOS ids, model name) from a compatible server:
        the device's state then, and why ("ready", else "waiting")."""
        try:
            server = self.directory.pick()
        except NoServer as exc:
            return "waiting", str(exc)
        try:
            info = await server.connect().model_info(timeout=10, wait_for_ready=False)
            if self.tokenizer is None or self.kept_but_not_these(settings, info.tokenizer_files_sha256):
                self.tokenizer = await server.connect().tokenizer(settings.tokenizer_timeout_s)
                self.set_fingerprint(settings)
                self.bind(self.drafter)
            self.directory.set_files(getattr(self.tokenizer, "files_sha256", None) or "")
        except grpc.aio.AioRpcError as exc:
            return "waiting", await server.connect().explain(exc)
        except CacheError as exc:  # its tokenizer was refused: one line, the device keeps waiting
            return "waiting", str(exc)
        self.eos_ids = list(info.eos_token_ids)
        self.model_id = settings.model_name or printable(info.model_id, 200)
        return "ready", f"verifying on {printable(server.id or server.endpoint, 200)}"

    def kept_but_not_these(self, settings: DeviceSettings, files_sha256: str) -> bool:
        """The device's tokenizer is a kept copy of other files than the server's (one
        vocabulary, another normalizer or chat template): the server's files are the ones to use.
        A tokenizer from a local folder (settings.tokenizer) is the operator's and stays."""
        return (not settings.tokenizer and getattr(self.tokenizer, "files_sha256", None) is not None
                and not self.directory.files_sha256 and files_sha256 != self.tokenizer.files_sha256)

    async def other_drafter(self, name: str) -> SharedDrafter:
        """Drafter `name` loaded to replace the device's (a live change), bound to the target's
        tokenizer; SettingsError when it cannot be loaded or drafts in another tokenizer."""
        try:
            drafter = SharedDrafter(await asyncio.to_thread(self.load_drafter, name))
        except (ValueError, OSError) as exc:
            raise SettingsError(f"drafter {name!r} cannot be loaded: {exc}") from None
        if drafter.tokenizer_fingerprint and self.tokenizer is not None and \
                drafter.tokenizer_fingerprint != tokenizer_fingerprint(self.tokenizer):
            raise SettingsError(f"drafter {name!r} has another tokenizer "
                                f"({short(drafter.tokenizer_fingerprint)}) than this device's "
                                f"target (xtok:{name} drafts across tokenizers)")
        self.bind(drafter)
        return drafter


def load_tokenizer(path: str):
    """The tokenizer of a local folder (what transformers' save_pretrained writes)."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise SettingsError(f"tokenizer folder {path} does not exist")
    if not (folder / "tokenizer.json").is_file():
        raise SettingsError(f"tokenizer folder {path} has no tokenizer.json: the device needs one "
                            f"(transformers' save_pretrained writes it)")
    try:
        return DeviceTokenizer.load(folder)
    except Exception as exc:  # tokenizers raises plain Exception on a malformed file
        raise SettingsError(f"cannot load the tokenizer in {path}: {printable(str(exc), 200)}") from None
