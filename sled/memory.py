"""Giving freed heap back to the system after a big transient allocation.

Loading a large tokenizer.json (gemma3's is 33 MB, parsed into far more) or hashing a 262k-token
vocabulary frees its temporaries at the end, but glibc's allocator keeps the freed pages for later
use: the process stays about 260 MB bigger than what it holds. release_freed_heap() asks glibc to
return them (malloc_trim(0)), right after such a step; elsewhere (musl, macOS, Windows) it does
nothing. It never changes what the process computes, only its resident memory.
"""
from __future__ import annotations

import ctypes
import sys
from functools import lru_cache


def release_freed_heap() -> bool:
    """Return the heap glibc keeps after frees to the system; True when it gave some back."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


@lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim    # the C library the process already runs on
    except (OSError, AttributeError):   # no such library, or not glibc (musl has no malloc_trim)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim
