"""One device harms no other: what a device holds on a shared server (streams, GetTokenizer
replies, KV) is counted against that device, so whatever it does, another device's sessions go on
and stay lossless."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from drafters.ngram import NgramDrafter
from edge_client.connection import Connection
from edge_client.security import ChannelSecurity
from edge_client.session import generate
from edge_client.wire import SessionRequest, open_message
from sled.wire.sampling import Sampling
from sled.v1 import verifier_pb2 as pb
from tests.conftest import greedy_reference
from tests.test_access import PROMPT, TOKENS, stub_of, token_file
from tests.test_tokenizer_stream import lengthened


async def secured(serve, models, tmp_path, **settings):
    """A server with per-device tokens (dev-1 attacks, dev-2 is the victim)."""
    return await serve(models["llama"], auth_tokens=str(token_file(tmp_path / "tokens")),
                       reflection=False, **settings)


async def victim_generates(server, models) -> None:
    """dev-2's greedy generation: opened, and the target's own output."""
    channel, stub = stub_of(server, TOKENS["dev-2"])
    try:
        result = await asyncio.wait_for(generate(stub, NgramDrafter(),
                                                 SessionRequest(PROMPT, max_new_tokens=8)), 60)
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


async def stalled_replies(server, token: str, count: int):
    """COUNT GetTokenizer calls of one device that read one chunk each, then nothing (of a reply
    far longer than flow control sends ahead; later calls get the real one)."""
    files = server.service.target.tokenizer_reply
    lengthened(server)
    channel = grpc.aio.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)])
    stub = ChannelSecurity(token=token).stub(channel)
    calls = [stub.GetTokenizer(pb.GetTokenizerRequest()) for _ in range(count)]
    for call in calls:
        assert (await asyncio.wait_for(call.read(), 10)).offset == 0
    server.service.target.tokenizer_reply = files
    return channel, calls


async def tokenizer_of(server, token: str):
    async with Connection(server.address, ChannelSecurity(token=token)) as conn:
        return await asyncio.wait_for(conn.tokenizer(), 60)


async def test_one_device_holds_at_most_its_share_of_the_tokenizer_replies(
        serve, models, tmp_path, monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    # dev-1's stalled replies hold their slots far past tokenizer_of's wait: a victim queued
    # behind them fails as a hang, however slow the machine, instead of being timed.
    server = await secured(serve, models, tmp_path, max_tokenizer_calls_per_device=2,
                           tokenizer_stall_timeout=3600.0)
    channel, calls = await stalled_replies(server, TOKENS["dev-1"], 2)
    try:
        third = ChannelSecurity(token=TOKENS["dev-1"]).stub(channel).GetTokenizer(pb.GetTokenizerRequest())
        assert await third.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "device dev-1 holds 2 GetTokenizer replies (limit 2 per device)" in await third.details()
        victim = await tokenizer_of(server, TOKENS["dev-2"])      # no slot is dev-1's to take
        assert victim.fingerprint == server.service.target.fingerprint
    finally:
        await channel.close()


async def test_a_reply_nobody_reads_ends_and_frees_its_slot(serve, models, tmp_path, monkeypatch):
    import edge_client.connection as connection

    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(connection, "BUSY_PAUSE_S", 0.2)
    server = await secured(serve, models, tmp_path, max_tokenizer_calls=2, tokenizer_stall_timeout=1.0)
    channel, calls = await stalled_replies(server, TOKENS["dev-1"], 2)   # every slot
    try:
        victim = await tokenizer_of(server, TOKENS["dev-2"])   # refused, asks again, served
        assert victim.fingerprint == server.service.target.fingerprint
        assert server.service.tokenizer_calls == 0
        for call in calls:                                     # dev-1's replies were ended
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                while await asyncio.wait_for(call.read(), 10) is not grpc.aio.EOF:
                    pass
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "read nothing of this reply for 1 s" in caught.value.details()
    finally:
        await channel.close()


async def opened(stub, fingerprint: str, max_new_tokens: int):
    """A session held open with nothing drafted: (the call, the server's first answer)."""
    call = stub.Generate()
    await call.write(open_message(SessionRequest(PROMPT, max_new_tokens, Sampling(),
                                                 fingerprint=fingerprint, drafter="idle")))
    return call, await asyncio.wait_for(call.read(), 30)


async def test_one_device_reserves_at_most_its_share_of_the_kv(serve, models, tmp_path):
    """Idle sessions with a large max_new_tokens reserve KV: one device's may take its share (a
    third: three devices in the token file), never another's."""
    server = await secured(serve, models, tmp_path, kv_budget=3 << 20)
    capacity, share = server.service.pool.capacity_tokens, server.service.kv_share_tokens()
    assert share == capacity // 3
    fingerprint = server.service.target.fingerprint
    big = share // 2 - len(PROMPT)
    channel, stub = stub_of(server, TOKENS["dev-1"])
    try:
        idle = [await opened(stub, fingerprint, big) for _ in range(2)]
        assert all(reply.WhichOneof("kind") == "opened" for _, reply in idle)
        over, refusal = await opened(stub, fingerprint, big)
        assert refusal.error.reason == pb.ErrorDetail.REASON_KV_BUDGET
        assert f"device dev-1's share of the KV cache is {share} tokens" in refusal.error.message
        assert str(capacity) not in refusal.error.message        # its own share, not the totals
        victim_channel, victim = stub_of(server, TOKENS["dev-2"])
        try:
            held, reply = await opened(victim, fingerprint, share - len(PROMPT) - 1)
            assert reply.WhichOneof("kind") == "opened", reply        # its whole share is there
            held.cancel()
        finally:
            await victim_channel.close()
        await victim_generates(server, models)
        for call, _ in idle:
            call.cancel()
        await wait_for(lambda: server.service.kv_reserved == {}, "the reservations to go")
    finally:
        await channel.close()


async def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        await asyncio.sleep(0.02)
