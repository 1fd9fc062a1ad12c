"""sled.memory.release_freed_heap: glibc gives freed heap back to the system, and elsewhere the
call does nothing (and never fails)."""
from __future__ import annotations

import sys

import pytest

from conftest import rss_mib
from sled import memory
from sled.memory import release_freed_heap


def _has_malloc_trim() -> bool:
    return memory._malloc_trim() is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_heap_held_by_glibc_is_given_back():
    if not _has_malloc_trim():
        pytest.skip("this C library has no malloc_trim")
    release_freed_heap()
    # 100k blocks of 2 kB from malloc (too big for Python's own allocator), one in 64 kept, so
    # the freed ones sit between live ones and glibc keeps them: what a parsed JSON leaves.
    blocks = [bytes(2048) for _ in range(100_000)]
    kept = blocks[::64]
    del blocks
    before = rss_mib()
    assert release_freed_heap() is True
    assert before - rss_mib() > 100, (before, rss_mib())
    assert len(kept) == 1563


def test_without_malloc_trim_it_does_nothing(monkeypatch):
    monkeypatch.setattr(memory, "_malloc_trim", lambda: None)
    assert release_freed_heap() is False


def test_off_linux_there_is_no_malloc_trim(monkeypatch):
    memory._malloc_trim.cache_clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    try:
        assert memory._malloc_trim() is None and release_freed_heap() is False
    finally:
        memory._malloc_trim.cache_clear()
