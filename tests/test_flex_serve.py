"""`sled serve --engine flex` on a CPU as a person starts it, at the default KV pool size: 16
devices at once get the target's own greedy output, and the server's memory follows the work,
not the pool. Its CPU flex kernel is compiled for AVX2 code (as on a CPU without AVX-512),
in an inductor cache of its own: torch keys that cache without the vector code picked through
ATEN_CPU_CAPABILITY, so a kernel built for another code would be reused. Run twice at once,
this test once found the server's engine thread compiling under dynamo's default recompile
limit (torch keeps it per context) and falling back to eager flex over the pool: 23 GB."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import PROMPT_TEXTS, greedy_reference, status_kib
from drafters.hf import HFDrafter
from edge_client.session import RoundSettings, generate
from edge_client.wire import SessionRequest
from lab.server_process import ServerProcess
from sled.v1 import verifier_pb2_grpc as pb_grpc
from verify_server.engines.blocks import KVShape

pytestmark = pytest.mark.slow

BLOCK_TOKENS = 16      # sled serve's default
DEVICES = 16
NEW_TOKENS = 24
GIB = 1 << 30


async def test_sixteen_devices_through_sled_serve_engine_flex_get_generates_tokens(
        pair, tmp_path, monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    target_dir, drafter_dir = pair
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = AutoModelForCausalLM.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    prompts = [tokenizer(text).input_ids for text in PROMPT_TEXTS] * (DEVICES // len(PROMPT_TEXTS))
    async with ServerProcess(str(target_dir), "--engine", "flex", "--dtype", "float32",
                             "--max-sessions", str(DEVICES)) as server:
        stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(server.address))
        results = await asyncio.gather(*(
            generate(stub, HFDrafter(drafter, tokenizer, name="hf:noisy"),
                     SessionRequest(prompt, max_new_tokens=NEW_TOKENS),
                     settings=RoundSettings(draft_len=4))
            for prompt in prompts))
        peak = status_kib("VmHWM", server.proc.pid) * 1024
        pool_bytes = (server.metric("sled_kv_blocks_total") * BLOCK_TOKENS
                      * KVShape.of(target).bytes_per_token)
        log = server.child.log.read_text()
    assert "flex engine" in log and "compiled flex attention is wrong" not in log
    for result, prompt in zip(results, prompts):
        assert result.token_ids == greedy_reference(target, prompt, NEW_TOKENS)
    assert 0 < sum(r.accepted_tokens for r in results) < sum(r.draft_tokens for r in results)
    # the pool is most of a machine's free memory; the server holds a small part of it
    assert pool_bytes > 2 * GIB and peak < min(pool_bytes / 2, 3 * GIB), (peak, pool_bytes)
