"""Where sled keeps what it converts, exports or fetches once: $SLED_CACHE (~/.cache/sled)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("SLED_CACHE", Path.home() / ".cache" / "sled"))


def tokenizer_dir(fingerprint: str) -> Path:
    """The on-disk copy of the tokenizer with this fingerprint (fetched from a server once)."""
    return cache_dir() / "tokenizers" / fingerprint.replace(":", "-")
