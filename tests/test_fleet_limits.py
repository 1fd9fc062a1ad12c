"""One device harms no other: what a device holds on a shared server (streams, GetTokenizer
replies, KV) is counted against that device, so whatever it does, another device's sessions go on
and stay lossless."""
from __future__ import annotations

import asyncio
import time
import gc

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafters.ngram import NgramDrafter
from edge_client.connection import Connection
from edge_client.security import ChannelSecurity
from edge_client.session import generate
from edge_client.wire import SessionRequest, open_message
from sled.wire.sampling import Sampling
from sled.v1 import verifier_pb2 as pb
from sled.v1.verifier_pb2_grpc import VerifierStub
from sled.wire.auth import bearer_metadata
from tests.conftest import greedy_reference
from tests.test_access import PROMPT, TOKENS, open_session, refused, stub_of, token_file
from verify_server.engines.blocks import KVShape
from verify_server.settings import ServerSettings
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
        assert server.service.core.ledger.streams == {}
    finally:
        await channel.close()


async def stalled_replies(server, token: str | None, count: int, metadata=()):
    """COUNT GetTokenizer calls of one device that read one chunk each, then nothing (of a reply
    far longer than flow control sends ahead; later calls get the real one)."""
    files = server.service.core.target.tokenizer_reply
    lengthened(server)
    channel = grpc.aio.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)])
    stub = ChannelSecurity(token=token).stub(channel)
    calls = [stub.GetTokenizer(pb.GetTokenizerRequest(), metadata=metadata) for _ in range(count)]
    for call in calls:
        assert (await asyncio.wait_for(call.read(), 10)).offset == 0
    server.service.core.target.tokenizer_reply = files
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
        assert victim.fingerprint == server.service.core.target.fingerprint
    finally:
        await channel.close()


async def test_a_host_without_a_token_holds_at_most_its_share_of_the_tokenizer_replies(
        serve, models):
    """A host (its address block: a NAT's devices together) holds at most
    --max-tokenizer-calls-per-host replies, fewer than the server's by default; another host is
    served meanwhile. The test's client is a trusted proxy forwarding both hosts."""
    defaults = ServerSettings()
    assert defaults.max_tokenizer_calls_per_host < defaults.max_tokenizer_calls
    server = await serve(models["llama"], trusted_proxies=["127.0.0.1"], reflection=False,
                         max_tokenizer_calls_per_host=2, tokenizer_stall_timeout=3600.0)
    nat = (("x-forwarded-for", "203.0.113.7"),)
    channel, calls = await stalled_replies(server, None, 2, nat)
    try:
        async with grpc.aio.insecure_channel(server.address) as other:   # a window of its own
            stub = VerifierStub(other)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.GetTokenizer(pb.GetTokenizerRequest(), metadata=nat):
                    pass
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ("host:203.0.113.7 holds 2 GetTokenizer replies (limit 2 per host without a "
                    "token or certificate)") in refused.value.details()
            neighbour = stub.GetTokenizer(pb.GetTokenizerRequest(),
                                          metadata=(("x-forwarded-for", "203.0.113.8"),))
            chunks = [chunk async for chunk in neighbour]
            assert chunks and await neighbour.code() == grpc.StatusCode.OK
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
        assert victim.fingerprint == server.service.core.target.fingerprint
        assert server.service.core.ledger.tokenizer_calls == 0
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
    core = server.service.core
    capacity, share = core.pool.capacity_tokens, core.ledger.kv_share_tokens()
    block = core.pool.block_tokens
    assert share == capacity // 3 // block * block          # in whole blocks
    fingerprint = core.target.fingerprint
    big = share // block // 2 * block - len(PROMPT)
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
        await wait_for(lambda: server.service.core.ledger.kv_reserved == {}, "the reservations to go")
    finally:
        await channel.close()


async def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        await asyncio.sleep(0.02)


# --- every call is bounded, health and reflection included --------------------------------------

async def watching(channel, metadata=()):
    """A Health.Watch stream that the server took (its first SERVING read), or its refusal."""
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(),
                                                      metadata=metadata)
    try:
        await asyncio.wait_for(call.read(), 10)
    except grpc.aio.AioRpcError as error:
        return call, error
    return call, None


async def test_thousands_of_watch_streams_hold_at_most_the_callers_bound(serve, models, tmp_path):
    """3,000 Health.Watch streams from one host: 256 (max_calls_per_device) are held, the rest
    refused at once, and what the server holds (its calls' tasks) stays flat however many
    more come. One connection carries them all: its own bound is lifted here."""
    server = await secured(serve, models, tmp_path, max_streams_per_connection=4000)
    limit = server.service.core.settings.max_calls_per_device
    async with grpc.aio.insecure_channel(server.address) as channel:
        first = await asyncio.gather(*(watching(channel) for _ in range(1000)))
        held = [call for call, error in first if error is None]
        assert len(held) == limit and server.service.core.ledger.calls == {"host:loopback": limit}
        refusal = next(error for _, error in first if error is not None)
        assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"holds {limit} calls (limit {limit}): end one first" in refusal.details()
        del first
        gc.collect()
        tasks = len(asyncio.all_tasks())
        more = await asyncio.gather(*(watching(channel) for _ in range(2000)))
        assert all(error is not None for _, error in more)
        del more
        gc.collect()       # a held stream keeps a task and its call (~14 KiB each)
        assert len(asyncio.all_tasks()) <= tasks, "refused streams left tasks running"
        assert server.service.core.ledger.watch_streams == limit
        for call in held:
            call.cancel()
        await wait_for(lambda: server.service.core.ledger.calls == {}, "the streams to be uncounted")
        assert server.service.core.ledger.watch_streams == 0


async def test_watch_streams_are_bounded_for_the_whole_server(serve, models, tmp_path):
    server = await secured(serve, models, tmp_path, max_watch_streams=3)
    async with grpc.aio.insecure_channel(server.address) as channel:
        taken = [await watching(channel, bearer_metadata(TOKENS[device]))
                 for device in ("dev-1", "dev-1", "dev-2")]          # a token counts its device
        assert [error for _, error in taken] == [None] * 3
        assert server.service.core.ledger.calls == {"device:dev-1": 2, "device:dev-2": 1}
        _, refusal = await watching(channel)
        assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "3 Health.Watch streams are open (limit 3)" in refusal.details()
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING   # Check still answers
        for call, _ in taken:
            call.cancel()


async def test_calls_that_never_send_their_request_are_counted_and_ended(serve, models, tmp_path):
    """Headers and no message hold a call until open_timeout, counted against the caller's
    bound: GetModelInfo, GetTokenizer and a reflection stream alike."""
    server = await serve(models["llama"], open_timeout=1.0, max_calls_per_device=3)
    async with grpc.aio.insecure_channel(server.address) as channel:
        silent = [channel.stream_stream(method)() for method in (
            "/sled.v1.Verifier/GetModelInfo", "/sled.v1.Verifier/GetTokenizer",
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")]
        await wait_for(lambda: server.service.core.ledger.calls.get("host:loopback") == 3,
                       "the silent calls to be counted")
        refusal = await refused(health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest()))
        assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "device anonymous holds 3 calls (limit 3)" in refusal.details()
        started = time.monotonic()
        for call in silent:
            assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "no request within 1 s of the call" in await call.details()
        assert time.monotonic() - started < 5
        assert server.service.core.ledger.calls == {}
        info = await VerifierStub(channel).GetModelInfo(pb.GetModelInfoRequest())
        assert info.vocab_size == server.service.core.target.vocab_size     # served once it is asked


# --- a reader slower than the floor ---------------------------------------------------------------

async def trickle(call, every_s: float) -> grpc.aio.AioRpcError | None:
    """Read one chunk every `every_s` (under the stall timeout) until the reply ends."""
    try:
        while await asyncio.wait_for(call.read(), 30) is not grpc.aio.EOF:
            await asyncio.sleep(every_s)
    except grpc.aio.AioRpcError as error:
        return error
    return None


async def test_trickle_readers_are_ended_and_another_device_is_served(
        serve, models, tmp_path, monkeypatch):
    """Two devices hold every slot (two each) reading a 1 MiB chunk every 1.5 s, under the 3 s
    stall timeout: each reply ends once it falls under the floor, and a third device's fetch
    gets a slot."""
    import edge_client.connection as connection

    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(connection, "BUSY_PAUSE_S", 0.2)
    server = await secured(serve, models, tmp_path, max_tokenizer_calls=4,
                           tokenizer_stall_timeout=3.0, tokenizer_min_rate="4MiB",
                           tokenizer_rate_grace=1.0)
    files = server.service.core.target.tokenizer_reply
    lengthened(server)
    channel = grpc.aio.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)])
    try:
        calls = [ChannelSecurity(token=TOKENS[device]).stub(channel).GetTokenizer(
            pb.GetTokenizerRequest()) for device in ("dev-1", "dev-1", "dev-2", "dev-2")]
        readers = [asyncio.create_task(trickle(call, 1.5)) for call in calls]
        await wait_for(lambda: server.service.core.ledger.tokenizer_calls == 4, "the slots to be taken")
        server.service.core.target.tokenizer_reply = files
        started = time.monotonic()
        victim = await tokenizer_of(server, TOKENS["cam-3"])
        assert victim.fingerprint == server.service.core.target.fingerprint
        assert time.monotonic() - started < 15
        for error in await asyncio.wait_for(asyncio.gather(*readers), 30):
            assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "under the server's floor of 4096 KiB/s" in error.details()
    finally:
        await channel.close()


# --- KV charged in whole blocks, certificates as devices --------------------------------------------

async def test_tiny_sessions_are_charged_whole_blocks_and_leave_the_other_share(
        serve, models, tmp_path):
    """Blocks of 4 tokens, two devices: 1-token prompts with 1 new token each hold a block. dev-1
    opens sessions until refused: they hold its share (half), and dev-2 still opens one that
    needs all of its own."""
    block, blocks = 4, 32
    per_token = KVShape.of(models["llama"]).bytes_per_token
    path = token_file(tmp_path / "tokens", {d: TOKENS[d] for d in ("dev-1", "dev-2")})
    server = await serve(models["llama"], auth_tokens=str(path), kv_block_tokens=block,
                         kv_budget=(blocks + 1) * block * per_token, quota_sessions=0)
    share = server.service.core.ledger.kv_share_tokens()
    assert share == server.service.core.pool.capacity_tokens // 2 == blocks * block // 2
    fingerprint = server.service.core.target.fingerprint
    channel, stub = stub_of(server, TOKENS["dev-1"])
    other_channel, other = stub_of(server, TOKENS["dev-2"])
    tiny = pb.Open(prompt_ids=[5], max_new_tokens=1, tokenizer_fingerprint=fingerprint)
    try:
        held = []
        for _ in range(blocks):
            call = stub.Generate()
            await call.write(pb.DeviceMessage(open=tiny))
            held.append((call, await asyncio.wait_for(call.read(), 30)))
            if held[-1][1].WhichOneof("kind") == "error":
                break
        opened = [reply for _, reply in held if reply.WhichOneof("kind") == "opened"]
        assert len(opened) == share // block                    # a block each, not 2 tokens
        assert held[-1][1].error.reason == pb.ErrorDetail.REASON_KV_BUDGET
        assert "this one needs 4 (whole blocks of 4)" in held[-1][1].error.message
        assert server.service.core.ledger.kv_reserved == {"device:dev-1": share}
        call, reply = await open_session(other, fingerprint, prompt=[5], max_new_tokens=share - 1)
        assert reply.WhichOneof("kind") == "opened", reply       # its whole share is there
        call.cancel()
        for call, _ in held:
            call.cancel()
    finally:
        await channel.close()
        await other_channel.close()
