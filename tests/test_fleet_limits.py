"""One device harms no other: what a device holds on a shared server (streams, GetTokenizer
replies, KV) is counted against that device, so whatever it does, another device's sessions go on
and stay lossless."""
from __future__ import annotations

import asyncio
import time

import grpc

from drafters.ngram import NgramDrafter
from edge_client.session import generate
from sled.v1 import verifier_pb2 as pb
from tests.conftest import greedy_reference
from tests.test_access import PROMPT, TOKENS, stub_of, token_file


async def secured(serve, models, tmp_path, **settings):
    """A server with per-device tokens (dev-1 attacks, dev-2 is the victim)."""
    return await serve(models["llama"], auth_tokens=str(token_file(tmp_path / "tokens")),
                       reflection=False, **settings)


async def victim_generates(server, models) -> None:
    """dev-2's greedy generation: opened, and the target's own output."""
    channel, stub = stub_of(server, TOKENS["dev-2"])
    try:
        result = await asyncio.wait_for(generate(stub, NgramDrafter(), PROMPT, max_new_tokens=8), 60)
    finally:
        await channel.close()
    assert result.token_ids == greedy_reference(models["llama"], PROMPT, 8)


async def test_streams_without_an_open_are_ended_and_counted_against_their_device(
        serve, models, tmp_path):
    server = await secured(serve, models, tmp_path, open_timeout=1.0, max_streams_per_device=4)
    channel, stub = stub_of(server, TOKENS["dev-1"])
    try:
        silent = [stub.Generate() for _ in range(4)]         # never send an Open
        await asyncio.gather(*(call.initial_metadata() for call in silent))
        over = stub.Generate()
        refusal = (await over.read()).error
        assert refusal.reason == pb.ErrorDetail.REASON_QUOTA
        assert "device dev-1 holds 4 Generate streams (limit 4)" in refusal.message
        assert await over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await victim_generates(server, models)               # dev-2 is not dev-1
        started = time.monotonic()
        for call in silent:                                  # ended, not kept
            refusal = (await asyncio.wait_for(call.read(), 10)).error
            assert "no Open within 1 s of the call" in refusal.message
            assert refusal.reason == pb.ErrorDetail.REASON_PROTOCOL
            assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 5
        assert server.service.streams == {}
    finally:
        await channel.close()
