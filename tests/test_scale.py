"""The server at scale: prefix sharing, chunked prefill, KV admission, idle eviction and resume,
deadlines and their priority, server-side generation, and the suggested draft length. Every
output is still checked against generate(do_sample=False)."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from conftest import greedy_reference
from drafters.capabilities import Capabilities
from drafters.hf import HFDrafter
from edge_client.session import RoundSettings, generate
from edge_client.transport import half_close
from edge_client.wire import SessionRequest
from lab.tiny import make_tokenizer
from sled.wire.fingerprint import fingerprint_tokenizer
from sled.v1 import verifier_pb2 as pb
from sled.v1.verifier_pb2_grpc import VerifierStub
from verify_server.draft_advice import suggest_draft_len

Reason = pb.ErrorDetail.Reason
TARGET_FP = fingerprint_tokenizer(make_tokenizer())    # the tiny target's tokenizer
SYSTEM = list(range(40, 120))    # an 80-token shared instruction: 5 blocks of 16


def open_msg(prompt, max_new_tokens: int, mode=pb.GENERATION_MODE_DEVICE_DRAFTS) -> pb.DeviceMessage:
    return pb.DeviceMessage(open=pb.Open(prompt_ids=list(prompt), max_new_tokens=max_new_tokens,
                                         ignore_eos=True, mode=mode, tokenizer_fingerprint=TARGET_FP))


def draft_msg(round: int, tokens, deadline_ms: int = 0) -> pb.DeviceMessage:
    return pb.DeviceMessage(draft=pb.Draft(round=round, token_ids=list(tokens), deadline_ms=deadline_ms))


async def read_error(call, code: grpc.StatusCode, reason: int) -> str:
    """Read a stream that must end with `code` and an ErrorDetail of `reason`; its message."""
    detail = None
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            if msg.WhichOneof("kind") == "error":
                detail = msg.error
                await half_close(call)      # as a device does: the status follows at once
    except grpc.aio.AioRpcError:
        pass
    assert await call.code() == code, await call.details()
    assert detail is not None and detail.reason == reason
    return detail.message


async def drive(call, next_draft) -> list[int]:
    """Send next_draft(tokens so far) each round until the session finishes; the tokens."""
    tokens, round = [], 0
    while True:
        await call.write(draft_msg(round, next_draft(tokens)))
        verdict = (await call.read()).verdict
        tokens.extend(verdict.emitted_ids)
        round += 1
        if verdict.finish_reason:
            return tokens


async def run_device(stub, model, drafter_model, prompt, max_new: int = 12, draft_len: int = 3):
    result = await generate(stub, HFDrafter(drafter_model),
                            SessionRequest(prompt, max_new_tokens=max_new, ignore_eos=True),
                            settings=RoundSettings(draft_len=draft_len))
    return result.token_ids


async def test_prefix_cache_shared_by_concurrent_sessions(serve, models, drafter_models):
    model = models["gemma3"]
    server = await serve(model)
    prompts = [SYSTEM + [5 + i, 9, 200 + i] for i in range(6)]
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        first = await run_device(stub, model, drafter_models["gemma3"], prompts[0])
        assert first == greedy_reference(model, prompts[0], 12)
        outs = await asyncio.gather(*(run_device(stub, model, drafter_models["gemma3"], p)
                                      for p in prompts[1:]))
        call = stub.Generate()
        await call.write(open_msg(prompts[0], 4))
        opened = (await call.read()).opened
        call.cancel()
    for prompt, out in zip(prompts[1:], outs):
        assert out == greedy_reference(model, prompt, 12)
    assert opened.cached_prompt_tokens == 80
    assert server.metrics.value("sled_prefix_cache_hit_tokens_total") >= 6 * 80


async def test_long_prefill_is_chunked_and_does_not_stall_rounds(serve, models, drafter_models):
    """A 600-token prompt prefills in chunks within a 32-token step budget, and a short
    session's verify rounds share those steps instead of waiting for the whole prompt."""
    model = models["llama"]
    server = await serve(model, max_step_tokens=32, max_draft_tokens=4)
    engine = server.scheduler.engine
    forward, steps = engine.forward, []

    def recording_forward(rows):
        steps.append((sum(len(r.tokens) for r in rows), {r.want_logits for r in rows}))
        time.sleep(0.005)
        return forward(rows)

    engine.forward = recording_forward
    long_prompt = [3 + (i * 7) % 290 for i in range(600)]
    short_prompt = [11, 12, 13]
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)

        async def long_session():
            await asyncio.sleep(0.02)      # the short session is already drafting
            call = stub.Generate()
            await call.write(open_msg(long_prompt, 4))
            opened = (await call.read()).opened
            assert opened.prompt_tokens == 600
            return await drive(call, lambda tokens: [5])

        short = run_device(stub, model, drafter_models["llama"], short_prompt, max_new=40, draft_len=4)
        long_out, short_out = await asyncio.gather(long_session(), short)
    assert short_out == greedy_reference(model, short_prompt, 40)
    assert long_out == greedy_reference(model, long_prompt, 4)
    assert max(tokens for tokens, _ in steps) <= 32
    prefill_steps = [kinds for _, kinds in steps if False in kinds]
    assert len(prefill_steps) >= 599 // 32
    assert sum(kinds == {False, True} for kinds in prefill_steps) >= 2   # rounds rode along


async def test_kv_budget_refuses_with_the_budget_and_others_carry_on(serve, models, drafter_models):
    model = models["llama"]
    per_token = 2 * 2 * 2 * 16 * 8          # layers * (k, v) * kv heads * head dim * float64
    server = await serve(model, kv_budget=(1 + 8) * 16 * per_token, kv_block_tokens=16,
                         admission_queue=0)            # no waiting for KV: refused at once
    assert server.scheduler.engine.pool.capacity_tokens == 128
    prompt = [5, 6, 7, 8]
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        holder = stub.Generate()
        await holder.write(open_msg(prompt, 90))                   # reserves 94 -> 6 blocks
        await holder.read()
        refused = stub.Generate()
        await refused.write(open_msg(prompt, 40))                  # 44 -> 3 blocks, 2 free
        message = await read_error(refused, grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.REASON_KV_BUDGET)
        assert "needs 44 tokens" in message and "128" not in message and "32" not in message
        assert "--kv-budget" in message
        fits = await run_device(stub, model, drafter_models["llama"], prompt, max_new=20)
        assert fits == greedy_reference(model, prompt, 20)
        holder.cancel()
        await asyncio.sleep(0.05)
        after = await run_device(stub, model, drafter_models["llama"], prompt, max_new=40)
        assert after == greedy_reference(model, prompt, 40)
    assert server.scheduler.engine.pool.committed_blocks == 0


async def test_idle_session_is_evicted_and_resumes_losslessly(serve, models):
    model = models["llama"]
    server = await serve(model, idle_timeout=0.2)
    prompt = [21, 22, 23, 24, 25]
    want = greedy_reference(model, prompt, 10)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        call = stub.Generate()
        await call.write(open_msg(prompt, 10))
        await call.read()
        await call.write(draft_msg(0, want[:2]))
        verdict = (await call.read()).verdict
        committed = list(verdict.emitted_ids)
        assert committed == want[:3]
        blocks_in_use = server.scheduler.engine.pool.used_blocks
        await asyncio.sleep(0.6)
        assert server.scheduler.engine.pool.used_blocks < blocks_in_use
        await call.write(draft_msg(1, want[3:5]))
        message = await read_error(call, grpc.StatusCode.ABORTED, Reason.REASON_EVICTED)
        assert "reopen" in message and "3 committed tokens" in message
        assert server.metrics.value("sled_evicted_sessions_total") == 1
        # Resume: the committed tokens join the prompt, the rest of the budget continues.
        call = stub.Generate()
        await call.write(open_msg(prompt + committed, 10 - len(committed)))
        await call.read()
        tokens = await drive(call, lambda tokens: want[len(committed) + len(tokens):][:2])
    assert committed + tokens == want


async def test_expired_work_is_dropped_before_the_forward(serve, models):
    """While a slow forward runs, a round with a 30 ms deadline waits and expires: it gets
    DEADLINE_EXCEEDED without ever entering a forward; the slow session is unaffected."""
    model = models["llama"]
    server = await serve(model)
    engine = server.scheduler.engine
    forward, batches = engine.forward, []

    def slow_forward(rows):
        batches.append(len(rows))
        time.sleep(0.3)
        return forward(rows)

    engine.forward = slow_forward
    prompt = [31]   # no prefill step
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        slow, late = stub.Generate(), stub.Generate()
        for call in (slow, late):
            await call.write(open_msg(prompt, 4))
            await call.read()
        await slow.write(draft_msg(0, [5]))
        await asyncio.sleep(0.05)                        # the slow round is in its forward
        await late.write(draft_msg(0, [5], deadline_ms=30))
        message = await read_error(late, grpc.StatusCode.DEADLINE_EXCEEDED,
                                   Reason.REASON_DEADLINE_EXCEEDED)
        assert "missed its deadline" in message
        assert (await slow.read()).verdict.emitted_ids
        slow.cancel()
    assert batches == [1]
    assert server.metrics.value("sled_expired_work_total") == 1


async def test_earliest_deadline_goes_first(serve, models):
    """One session per forward: of two queued rounds the one with a deadline is served first,
    though the other was queued earlier."""
    model = models["llama"]
    server = await serve(model, max_batch_sessions=1)
    engine = server.scheduler.engine
    forward, served = engine.forward, []

    def recording_forward(rows):
        served.append(rows[0].kv)
        time.sleep(0.1)
        return forward(rows)

    engine.forward = recording_forward
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        calls = [stub.Generate() for _ in range(3)]
        for call in calls:
            await call.write(open_msg([41], 4))
            await call.read()
        sessions = list(server.service.core.sessions.values())
        await calls[0].write(draft_msg(0, [5]))           # occupies the engine
        await asyncio.sleep(0.03)
        await calls[1].write(draft_msg(0, [5]))           # no deadline, queued first
        await asyncio.sleep(0.01)
        await calls[2].write(draft_msg(0, [5], deadline_ms=5000))
        for call in calls:
            await call.read()
            call.cancel()
    order = [next(s for s in sessions if s.kv is kv) for kv in served]
    assert order == [sessions[0], sessions[2], sessions[1]]


async def test_server_mode_matches_generate_alongside_drafting_devices(serve, models, drafter_models):
    model = models["gemma3"]
    server = await serve(model)
    prompts = [[7, 8, 9], [100, 101], list(range(50, 90))]

    async def server_side(stub, prompt):
        call = stub.Generate()
        await call.write(open_msg(prompt, 14, mode=pb.GENERATION_MODE_SERVER))
        await call.read()
        tokens = []
        while (msg := await call.read()) is not grpc.aio.EOF:
            tokens.extend(msg.verdict.emitted_ids)
        return tokens

    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        outs = await asyncio.gather(*(server_side(stub, p) for p in prompts),
                                    *(run_device(stub, model, drafter_models["gemma3"], p, 14)
                                      for p in prompts))
    for prompt, out in zip(prompts * 2, outs):
        assert out == greedy_reference(model, prompt, 14)


async def test_verdicts_suggest_a_draft_length(serve, models, drafter_models):
    model = models["llama"]
    server = await serve(model, max_draft_tokens=8)
    seen = []
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        call = stub.Generate()
        await call.write(open_msg([5, 6], 12))
        await call.read()
        for round in range(3):
            await call.write(draft_msg(round, [250, 251]))   # nonsense: mostly rejected
            seen.append((await call.read()).verdict.suggested_draft_len)
        call.cancel()
    assert all(1 <= k <= 8 for k in seen) and seen[-1] <= seen[0]


def test_draft_length_policy():
    assert suggest_draft_len(0.9, 4, 512, 16) == 16
    assert suggest_draft_len(0.5, 4, 512, 16) == 3
    assert suggest_draft_len(0.9, 256, 512, 16) == 1      # load wins
    assert suggest_draft_len(0.0, 1, 512, 16) == 1
    assert suggest_draft_len(0.8, 1, 512, 16) < suggest_draft_len(0.95, 1, 512, 16)


class StallingDrafter:
    """An HF drafter that stalls once, before its second draft, longer than the idle timeout."""
    capabilities = Capabilities(awaitable=True)

    def __init__(self, model, stall_s: float) -> None:
        self.inner, self.stall_s, self.calls = HFDrafter(model), stall_s, 0
        self.name, self.tokenizer_fingerprint = "stalling", ""

    async def apropose(self, context, k, sampling, generator):
        self.calls += 1
        if self.calls == 2:
            await asyncio.sleep(self.stall_s)
        return self.inner.propose(context, k, sampling, generator)

    def rollback(self, length: int) -> None:
        self.inner.rollback(length)


@pytest.mark.parametrize("pipeline", [False, True])
async def test_device_resumes_after_eviction_without_losing_tokens(serve, models, drafter_models, pipeline):
    model = models["gemma3"]
    server = await serve(model, idle_timeout=0.15)
    prompt = [61, 62, 63, 64]
    async with grpc.aio.insecure_channel(server.address) as channel:
        result = await generate(VerifierStub(channel),
                                StallingDrafter(drafter_models["gemma3"], 0.6),
                                SessionRequest(prompt, max_new_tokens=20, ignore_eos=True),
                                settings=RoundSettings(draft_len=3, pipeline=pipeline))
    assert result.resumes == 1
    assert server.metrics.value("sled_evicted_sessions_total") == 1
    assert result.token_ids == greedy_reference(model, prompt, 20)


async def test_kv_gauges_return_to_zero_after_shared_prefix_sessions(serve, models, drafter_models):
    model = models["llama"]
    server = await serve(model)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        for suffix in ([1], [2], [3]):
            await run_device(stub, model, drafter_models["llama"], SYSTEM + suffix, max_new=6)
    await asyncio.sleep(0.05)
    assert server.metrics.value("sled_prefix_cache_hit_tokens_total") == 2 * 80
    assert server.metrics.value("sled_kv_tokens") == 0
    assert server.metrics.value("sled_kv_blocks_used") == 0


class SlowDrafter(HFDrafter):
    """Drafts take a while, so a server restart lands in the middle of the sessions."""
    capabilities = HFDrafter.capabilities | Capabilities(awaitable=True)

    async def apropose(self, context, k, sampling, generator):
        await asyncio.sleep(0.02)
        return self.propose(context, k, sampling, generator)


async def test_sessions_survive_a_server_restart_without_losing_tokens(models, drafter_models, tokenizer):
    """The server stops mid-generation and comes back on the same port (empty: no sessions, no
    KV); every device reopens with its committed tokens and finishes with the target's output."""
    from verify_server.settings import ServerSettings
    from verify_server.server import start_server
    from verify_server.target import Target

    model = models["gemma3"]
    config = ServerSettings(kv_budget=16 << 20)
    server = await start_server(Target.from_model(model, tokenizer, "tiny"), config)
    port = server.port
    prompts = [[70 + i, 71, 72 + i] for i in range(4)]
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        tasks = [asyncio.create_task(generate(stub, SlowDrafter(drafter_models["gemma3"]),
                                              SessionRequest(p, max_new_tokens=40, ignore_eos=True),
                                              settings=RoundSettings(draft_len=2, reconnect_s=20)))
                 for p in prompts]
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in tasks)
        await server.stop(grace=0)
        await asyncio.sleep(0.3)
        server = await start_server(Target.from_model(model, tokenizer, "tiny"), config, port=port)
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        finally:
            await server.stop(grace=0)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_reference(model, prompt, 40)
        assert result.resumes >= 1
