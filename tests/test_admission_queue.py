"""The admission queue at the memory wall (verify_server.admission): an Open the whole KV cache
cannot take now waits, inside the Open, for running sessions to free theirs, in arrival order,
bounded by --admission-queue sessions and --admission-wait seconds; with --admission-queue 0 it
is refused at once, as is a session larger than the whole cache or one past its device's share.

The pool here holds 240 tokens (15 blocks of 16): a "holder" session reserves all of it but
`leave` tokens, so the next sessions wait for it to close."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from sled import clock
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc
from tests.conftest import greedy_reference
from tests.test_core import DEV_1, DEV_2, DEV_3, MAX_NEW, in_blocks, kv_free, open_request, opened
from tests.test_core import make_core  # noqa: F401  (the fixture)
from verify_server.auth import Identity
from verify_server.core import VerifierCore
from verify_server.engines.blocks import KVShape
from verify_server.errors import Reason, SessionError
from verify_server.session import Session

POOL_BYTES = 1 << 18             # the tiny float64 target's KV: 1 KiB a token, 15 usable blocks


def holds_kv(session: Session) -> bool:
    """Whether the session still holds KV blocks or a reservation in the pool."""
    return session.kv is not None and bool(session.kv.table or session.kv.reserved_blocks)


async def until(predicate, what: str, timeout: float = 10.0) -> None:
    """Until `predicate()` holds, letting the loop run (the test fails after `timeout`)."""
    async def polled() -> None:
        while not predicate():
            await asyncio.sleep(0.005)
    try:
        await asyncio.wait_for(polled(), timeout)
    except asyncio.TimeoutError:
        pytest.fail(f"waited {timeout} s for {what}")


async def holder(core: VerifierCore, prompt: list[int], leave: int,
                 identity: Identity = DEV_1) -> Session:
    """A session reserving the whole pool but `leave` tokens (whole blocks)."""
    assert leave % core.pool.block_tokens == 0
    max_new = core.pool.capacity_tokens - leave - len(prompt) - core.target.sat_slots
    session, _ = await opened(core, prompt, identity, max_new_tokens=max_new)
    assert core.pool.committed_blocks == core.pool.usable_blocks - leave // core.pool.block_tokens
    return session


def charged(core: VerifierCore, prompt: list[int], max_new_tokens: int = MAX_NEW) -> int:
    """KV tokens a session of `prompt` reserves, in whole blocks."""
    return in_blocks(core, len(prompt) + max_new_tokens + core.target.sat_slots)


def waiting_open(core: VerifierCore, prompt: list[int], identity: Identity,
                 max_new_tokens: int = MAX_NEW) -> asyncio.Task:
    """core.open of a session, as a task: it returns once the session's KV is reserved."""
    return asyncio.ensure_future(core.open(None, open_request(core, prompt, max_new_tokens),
                                           identity))


async def generated(core: VerifierCore, session: Session, reference: list[int]) -> list[int]:
    """The session's output, drafting the reference (a device whose drafter is the target)."""
    await core.prefill(session, deadline=None)
    emitted: list[int] = []
    while not session.finished:
        draft = reference[len(emitted):len(emitted) + 3] or [0]
        verdict = await core.verify(session, pb.Draft(round=session.round, token_ids=draft), None)
        emitted += verdict.emitted_ids
    return emitted


def holds_nothing(core: VerifierCore, identity: Identity) -> bool:
    usage = core.ledger.quotas.usage.get(identity.key)
    return identity.key not in core.ledger.kv_reserved and (usage is None or usage.sessions == 0)


async def test_a_session_that_does_not_fit_waits_and_is_admitted_once_one_closes(
        make_core, models, prompts):
    core = await make_core(kv_budget_bytes=POOL_BYTES)
    prompt = prompts[1]
    first = await holder(core, prompts[0], leave=charged(core, prompt) - core.pool.block_tokens)
    waiting = waiting_open(core, prompt, DEV_2)
    await until(lambda: core.admission.waiting == 1, "the session to wait")
    await asyncio.sleep(0.05)
    assert not waiting.done() and list(core.sessions) == [first.id]   # not refused: waiting
    assert DEV_2.key not in core.ledger.kv_reserved
    core.close(first)
    session = await asyncio.wait_for(waiting, 10)
    assert core.admission.waiting == 0 and list(core.sessions) == [session.id]
    assert core.ledger.kv_reserved == {DEV_2.key: charged(core, prompt)}
    reference = greedy_reference(models["llama"], prompt, MAX_NEW)
    assert await generated(core, session, reference) == reference
    core.close(session)
    assert kv_free(core) and core.ledger.kv_reserved == {}


async def test_waiting_sessions_are_admitted_in_arrival_order_and_none_jumps_ahead(
        make_core, prompts):
    """Strict FIFO: a later session that would fit waits behind an earlier one that does not."""
    core = await make_core(kv_budget_bytes=POOL_BYTES)
    block = core.pool.block_tokens
    large, small = prompts[0], prompts[7]
    assert charged(core, large, 40) > block and charged(core, small, 4) == block
    first = await holder(core, prompts[2], leave=block)        # the small one would fit now
    order: list[str] = []
    earlier = waiting_open(core, large, DEV_2, 40)
    earlier.add_done_callback(lambda _: order.append("earlier"))
    await until(lambda: core.admission.waiting == 1, "the earlier session to wait")
    later = waiting_open(core, small, DEV_3, 4)
    later.add_done_callback(lambda _: order.append("later"))
    await until(lambda: core.admission.waiting == 2, "the later session to wait")
    await asyncio.sleep(0.05)
    assert not later.done() and DEV_3.key not in core.ledger.kv_reserved   # it did not jump ahead
    core.close(first)
    sessions = await asyncio.wait_for(asyncio.gather(earlier, later), 10)
    assert order == ["earlier", "later"]
    assert set(core.sessions) == {s.id for s in sessions} and core.admission.waiting == 0
    for session in sessions:
        core.close(session)
    assert kv_free(core)


async def test_past_admission_queue_sessions_waiting_the_next_is_refused(make_core, prompts):
    core = await make_core(kv_budget_bytes=POOL_BYTES, admission_queue=1)
    first = await holder(core, prompts[0], leave=0)
    waiting = waiting_open(core, prompts[1], DEV_2)
    await until(lambda: core.admission.waiting == 1, "a session to wait")
    with pytest.raises(SessionError) as refused:
        await asyncio.wait_for(core.open(None, open_request(core, prompts[2]), DEV_3), 5)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.reason == Reason.REASON_KV_BUDGET
    assert "--admission-queue 1" in refused.value.message
    assert "retry later" in refused.value.message
    assert holds_nothing(core, DEV_3) and core.admission.waiting == 1
    assert core.metrics.value("sled_admission_refusals_total", {"bound": "queue"}) == 1
    core.close(first)
    core.close(await asyncio.wait_for(waiting, 10))
    assert kv_free(core)


async def test_past_admission_wait_a_waiting_session_is_refused_holding_nothing(
        make_core, prompts):
    core = await make_core(kv_budget_bytes=POOL_BYTES, admission_wait=0.3)
    first = await holder(core, prompts[0], leave=0)
    committed = core.pool.committed_blocks
    started = clock.now()
    with pytest.raises(SessionError) as refused:
        await asyncio.wait_for(core.open(None, open_request(core, prompts[1]), DEV_2), 10)
    assert clock.now() - started >= 0.3
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.reason == Reason.REASON_KV_BUDGET
    assert "--admission-wait 0.3" in refused.value.message
    assert holds_nothing(core, DEV_2) and core.admission.waiting == 0
    assert core.pool.committed_blocks == committed and list(core.sessions) == [first.id]
    assert core.metrics.value("sled_admission_refusals_total", {"bound": "wait"}) == 1
    core.close(first)
    assert kv_free(core)


async def test_admission_queue_0_refuses_at_once(make_core, prompts):
    core = await make_core(kv_budget_bytes=POOL_BYTES, admission_queue=0)
    first = await holder(core, prompts[0], leave=0)
    opening = asyncio.ensure_future(core.open(None, open_request(core, prompts[1]), DEV_2))
    await asyncio.sleep(0)          # one turn of the loop: refused, not waiting
    assert opening.done() and core.admission.waiting == 0
    with pytest.raises(SessionError) as refused:
        opening.result()
    assert refused.value.reason == Reason.REASON_KV_BUDGET
    assert "the KV cache is full" in refused.value.message
    assert "admission" not in refused.value.message
    assert holds_nothing(core, DEV_2)
    core.close(first)


async def test_a_session_larger_than_the_whole_cache_is_refused_never_queued(make_core, prompts):
    core = await make_core(kv_budget_bytes=POOL_BYTES)
    first = await holder(core, prompts[0], leave=0)
    too_large = core.pool.capacity_tokens          # with its prompt: more than the pool
    with pytest.raises(SessionError) as refused:
        await asyncio.wait_for(core.open(None, open_request(core, prompts[1], too_large), DEV_2),
                               5)
    assert refused.value.reason == Reason.REASON_KV_BUDGET
    assert "more than the whole KV cache holds" in refused.value.message
    assert core.admission.waiting == 0 and holds_nothing(core, DEV_2)
    core.close(first)


async def test_a_device_past_its_share_is_refused_at_once_even_with_a_queue(make_core, prompts):
    """The queue is for the server-wide wall: a device past its own share is refused at once,
    even while other sessions wait."""
    core = await make_core(kv_budget_bytes=POOL_BYTES, kv_share=0.5)
    share = core.ledger.kv_share_tokens()
    halves = []
    for identity, prompt in ((DEV_1, prompts[0]), (DEV_2, prompts[1])):
        max_new = share - len(prompt) - core.target.sat_slots
        halves.append((await opened(core, prompt, identity, max_new_tokens=max_new))[0])
    waiting = waiting_open(core, prompts[2], DEV_3)
    await until(lambda: core.admission.waiting == 1, "a session to wait for the full cache")
    with pytest.raises(SessionError) as refused:
        await asyncio.wait_for(core.open(None, open_request(core, prompts[3]), DEV_1), 5)
    assert f"device dev-1's share of the KV cache is {share} tokens" in refused.value.message
    assert core.admission.waiting == 1
    waiting.cancel()
    for session in halves:
        core.close(session)
    assert kv_free(core)


async def test_a_session_cancelled_while_waiting_leaves_and_the_next_is_admitted(
        make_core, prompts):
    core = await make_core(kv_budget_bytes=POOL_BYTES)
    block = core.pool.block_tokens
    large, small = prompts[0], prompts[7]
    assert charged(core, large, 40) > block and charged(core, small, 4) == block
    first = await holder(core, prompts[2], leave=block)
    cancelled = waiting_open(core, large, DEV_2, 40)
    await until(lambda: core.admission.waiting == 1, "the first session to wait")
    behind = waiting_open(core, small, DEV_3, 4)
    await until(lambda: core.admission.waiting == 2, "the second session to wait")
    cancelled.cancel()
    session = await asyncio.wait_for(behind, 10)       # its turn: it fits beside the holder
    assert cancelled.cancelled() and core.admission.waiting == 0
    assert holds_nothing(core, DEV_2)
    assert set(core.sessions) == {first.id, session.id}
    for done in (first, session):
        core.close(done)
    assert kv_free(core) and core.ledger.kv_reserved == {}


async def test_the_wait_is_in_the_metrics(make_core, prompts):
    core = await make_core(kv_budget_bytes=POOL_BYTES)
    first = await holder(core, prompts[0], leave=0)
    assert core.metrics.value("sled_admission_wait_seconds_count") == 0
    waiting = waiting_open(core, prompts[1], DEV_2)
    await until(lambda: core.metrics.value("sled_admission_waiting") == 1, "the gauge to count it")
    await asyncio.sleep(0.2)
    core.close(first)
    session = await asyncio.wait_for(waiting, 10)
    assert core.metrics.value("sled_admission_waiting") == 0
    assert core.metrics.value("sled_admission_wait_seconds_count") == 1
    assert core.metrics.value("sled_admission_wait_seconds_sum") >= 0.2
    core.close(session)


async def test_kv_freed_after_a_step_in_flight_admits_the_waiting_session(make_core, prompts):
    """A session closed while its step is in flight frees its KV only once that step ends: the
    session waiting for that KV is admitted then, with no other session to end."""
    core = await make_core(kv_budget_bytes=POOL_BYTES)
    first = await holder(core, prompts[0], leave=0)
    waiting = waiting_open(core, prompts[1], DEV_2)
    await until(lambda: core.admission.waiting == 1, "a session to wait")
    started, go_on = asyncio.Event(), asyncio.Event()
    execute = core.scheduler.execute

    async def held_step(plan):
        started.set()
        await go_on.wait()
        return await execute(plan)
    core.scheduler.execute = held_step
    step = asyncio.ensure_future(core.verify(first, pb.Draft(round=0, token_ids=[5, 6]), None))
    await asyncio.wait_for(started.wait(), 10)
    step.cancel()
    core.close(first)
    assert holds_kv(first) and not waiting.done()   # its KV goes after the step in flight
    go_on.set()
    session = await asyncio.wait_for(waiting, 10)
    assert list(core.sessions) == [session.id] and not holds_kv(first)
    core.close(session)
    assert kv_free(core)


# --- through the gRPC service ------------------------------------------------------------------

async def test_a_device_waiting_over_grpc_gets_opened_once_the_holder_ends(serve, models, prompts):
    """The Opened of a waiting session comes once KV is free (its time to first token includes
    the wait); a call cancelled while it waits leaves the queue."""
    per_token = KVShape.of(models["llama"]).bytes_per_token
    server = await serve(models["llama"], kv_budget=(1 + 15) * 16 * per_token, kv_block_tokens=16)
    core, fingerprint = server.service.core, server.service.core.target.fingerprint
    capacity = core.pool.capacity_tokens

    def open_message(prompt: list[int], max_new: int) -> pb.DeviceMessage:
        return pb.DeviceMessage(open=pb.Open(prompt_ids=prompt, max_new_tokens=max_new,
                                             tokenizer_fingerprint=fingerprint))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        holding = stub.Generate()
        await holding.write(open_message(prompts[0], capacity - len(prompts[0])))
        assert (await holding.read()).WhichOneof("kind") == "opened"
        gone = stub.Generate()
        await gone.write(open_message(prompts[1], MAX_NEW))
        await until(lambda: core.admission.waiting == 1, "the first device to wait")
        gone.cancel()
        await until(lambda: core.admission.waiting == 0, "the cancelled call to leave")
        waiting = stub.Generate()
        await waiting.write(open_message(prompts[2], MAX_NEW))
        reply = asyncio.ensure_future(waiting.read())
        await until(lambda: core.admission.waiting == 1, "the second device to wait")
        await asyncio.sleep(0.1)
        assert not reply.done()
        await holding.done_writing()
        assert await holding.code() == grpc.StatusCode.OK
        assert (await asyncio.wait_for(reply, 10)).WhichOneof("kind") == "opened"
        waiting.cancel()
    assert server.metrics.value("sled_admission_wait_seconds_count") == 1
