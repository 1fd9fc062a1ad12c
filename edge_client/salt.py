"""The cache salt a device sends with every Open: its sessions share prompt blocks with each
other and with nobody else on the same host.

The salt must be secret to separate anything: a salt another client of the same host (or NAT) can
send reaches this device's blocks, and `cached_prompt_tokens` then tells it which prompts the
device sent. The device id is no secret (it is a topic level, the hostname by default), so the
salt is HMAC-SHA256(secret, device id), the secret 16 random bytes kept (mode 0600) in
$SLED_CACHE/device-secret, made once:

    device_salt("kitchen-pi")   -> "3f9c...": the same on every start, unguessable without the file
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import tempfile
from pathlib import Path

from sled.cache import cache_dir

log = logging.getLogger("sled.device")

SECRET_FILE = "device-secret"
_SECRET = re.compile(r"[0-9a-f]{32}")


def device_salt(device_id: str, folder: Path | None = None) -> str:
    """This device's cache salt (hex). A cache folder that cannot be written gives a secret for
    this run only (the salt stays secret; the device's blocks are just not shared across runs)."""
    try:
        secret = _kept_secret((folder or cache_dir()) / SECRET_FILE)
    except OSError as exc:
        log.warning("cannot keep the device secret in %s (%s): using one for this run only",
                    folder or cache_dir(), exc.strerror or exc)
        secret = secrets.token_hex(16)
    return hmac.new(secret.encode(), device_id.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def _kept_secret(path: Path) -> str:
    """The secret in PATH, made there first when it is missing or damaged. Written whole into a
    temporary file (mkstemp: mode 0600) and linked into place, so processes starting at once
    agree on the first one written."""
    secret = _read(path)
    if secret is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(16))
            try:
                os.link(partial, path)
            except FileExistsError:      # another process made it first, or it is damaged
                if _read(path) is None:
                    os.replace(partial, path)
        finally:
            Path(partial).unlink(missing_ok=True)
        secret = _read(path)
    if secret is None:
        raise OSError(f"{path} does not hold a secret")
    return secret


def _read(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if _SECRET.fullmatch(text) else None
