"""The server's memory stays flat while it works: a CPU KV pool is allocated untouched and its
pages are faulted in on first write, so the pool must reuse the blocks it has already written
before untouched ones, or its RSS climbs with every session until the whole budget is resident."""
from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import sys

import grpc
import pytest
import torch

from conftest import rss_mib
from drafters.ngram import NgramDrafter
from edge_client.session import RoundSettings, generate
from edge_client.wire import SessionRequest
from sled.v1 import verifier_pb2_grpc as pb_grpc
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server.engines.kv import SessionKV

MIB = 1 << 20


def _session(pool: BlockPool, prompt: list[int], new_tokens: int, publish: bool) -> SessionKV:
    """One session's KV life: admit, write the prompt and new tokens, commit them."""
    kv = SessionKV(pool)
    kv.admit(prompt, len(prompt) + new_tokens, b"")
    kv.slots(0, len(prompt) + new_tokens)
    kv.commit(len(prompt) + new_tokens - kv.length)
    if publish:
        kv.publish(prompt)
    return kv


def test_sessions_one_after_another_reuse_the_same_blocks():
    pool = BlockPool(KVShape(1, 1, 2, torch.float32), num_blocks=1024, block_tokens=4)
    touched: set[int] = set()
    for n in range(200):
        kv = _session(pool, [1, 2, 3, n + 10], 9, publish=False)   # 13 tokens: 4 blocks
        touched.update(kv.table)
        kv.free()
    assert len(touched) == 4


def test_published_blocks_outlive_unpublished_ones_and_the_rest_is_reused():
    pool = BlockPool(KVShape(1, 1, 2, torch.float32), num_blocks=1024, block_tokens=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]                        # 2 full blocks published
    _session(pool, prompt, 3, publish=True).free()
    touched: set[int] = set()
    for _ in range(100):
        kv = SessionKV(pool)
        assert kv.admit(prompt, len(prompt) + 3, b"") == 8          # still found: not reused
        kv.slots(0, len(prompt) + 3)
        touched.update(kv.table[kv.shared:])
        kv.free()
    assert pool.cached_blocks() == 2 and len(touched) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
async def test_server_rss_does_not_grow_with_sessions(serve, models, prompts):
    server = await serve(models["llama"])
    stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(server.address))

    async def sessions(count: int) -> None:
        for start in range(0, count, 8):
            await asyncio.gather(*(
                generate(stub, NgramDrafter(),
                         SessionRequest(prompts[(start + i) % len(prompts)], max_new_tokens=32,
                                        ignore_eos=True), settings=RoundSettings(draft_len=4))
                for i in range(8)))

    await sessions(48)                       # warm-up: code paths, caches, grpc buffers
    gc.collect()
    before = rss_mib()
    await sessions(320)
    gc.collect()
    growth = rss_mib() - before
    # Each of these sessions writes 3 blocks (48 KiB of float64 KV): touching fresh blocks
    # would add about 15 MiB here; reusing written ones adds well under a MiB.
    assert growth < 5, f"RSS grew {growth:.1f} MiB over 320 sessions"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's memory the kernel holds in RAM now (mincore: its own pages, whatever
    the rest of the process does meanwhile)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.nbytes - start
    pages = (ctypes.c_ubyte * (-(-length // page)))()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(flag & 1 for flag in pages) * page


def test_a_cpu_pool_is_zero_and_costs_no_memory_until_written():
    """Every slot reads zero (the flex engine reads a row's last block whole), yet a 1 GiB pool
    is not resident until its blocks are written."""
    pool = BlockPool(KVShape(2, 4, 64, torch.float32), num_blocks=16384, block_tokens=16)
    tensors = (*pool.keys, *pool.values)
    assert pool.nbytes >= 1 << 30 and sum(map(resident_bytes, tensors)) < 64 << 20
    assert all(not tensor[::997].any() for tensor in (*pool.keys, *pool.values))
