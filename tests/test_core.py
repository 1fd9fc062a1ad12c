"""The server's core (verify_server.core) driven alone, with no gRPC server: a whole session from
its Open to its close, admission against each device's share of the KV cache (its ledger's),
eviction of an idle session, and that nothing of the core or its ledger takes a gRPC object."""
from __future__ import annotations

import ast
import asyncio
import inspect
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from sled import clock
from sled.v1 import verifier_pb2 as pb
from tests.conftest import greedy_reference
from verify_server import core as core_module
from verify_server import ledger as ledger_module
from verify_server.auth import Gate, Identity
from verify_server.core import VerifierCore
from verify_server.engines import make_engine
from verify_server.errors import Reason, SessionError
from verify_server.ledger import DeviceLedger
from verify_server.metrics import Metrics
from verify_server.origin import TrustedProxies
from verify_server.scheduler import Scheduler
from verify_server.settings import ServerSettings
from verify_server.target import Target

DEV_1 = Identity(device="dev-1", authenticated=True, key="dev-1")
DEV_2 = Identity(device="dev-2", authenticated=True, key="dev-2")
DEV_3 = Identity(device="dev-3", authenticated=True, key="dev-3")
MAX_NEW = 12


@pytest.fixture
async def make_core(models, tokenizer):
    """make_core(kv_budget_bytes, kind, overlap, **settings) -> a VerifierCore over a running
    scheduler of the tiny Llama target on the `kind` engine, its steps overlapped as `overlap`
    says (stopped after the test)."""
    schedulers = []

    async def make(kv_budget_bytes: int = 16 << 20, kind: str = "paged",
                   overlap: bool | None = None, **settings) -> VerifierCore:
        target = Target.from_model(models["llama"], tokenizer, "tiny")
        engine = make_engine(target.model, kv_budget_bytes=kv_budget_bytes, kind=kind)
        metrics = Metrics()
        server_settings = ServerSettings(**settings)
        scheduler = Scheduler(engine, metrics, server_settings.max_batch_sessions,
                              server_settings.max_step_tokens, overlap)
        scheduler.start()
        schedulers.append(scheduler)
        return VerifierCore(target, scheduler, server_settings, metrics)

    yield make
    for scheduler in schedulers:
        await scheduler.stop()


def open_request(core: VerifierCore, prompt: list[int], max_new_tokens: int = MAX_NEW) -> pb.Open:
    return pb.Open(prompt_ids=prompt, max_new_tokens=max_new_tokens,
                   tokenizer_fingerprint=core.target.fingerprint)


async def opened(core: VerifierCore, prompt: list[int], identity: Identity = DEV_1,
                 max_new_tokens: int = MAX_NEW):
    """A session opened and prefilled, waiting for its device's first draft (as a stream leaves
    it once its Opened is sent)."""
    session = await core.open(None, open_request(core, prompt, max_new_tokens), identity)
    reply = await core.prefill(session, deadline=None)
    session.wait_for_device()
    return session, reply


def in_blocks(core: VerifierCore, tokens: int) -> int:
    """`tokens` rounded up to the pool's whole blocks: what a reservation is charged."""
    return -(-tokens // core.pool.block_tokens) * core.pool.block_tokens


def kv_free(core: VerifierCore) -> bool:
    return core.pool.committed_blocks == 0 and core.pool.held_tokens == 0


async def test_a_session_through_the_core_emits_the_targets_own_greedy_output(
        make_core, models, prompts):
    core = await make_core()
    prompt = prompts[0]
    reference = greedy_reference(models["llama"], prompt, MAX_NEW)
    session, reply = await opened(core, prompt)
    assert reply.session_id == session.id and reply.prompt_tokens == len(prompt)
    assert core.sessions == {session.id: session}
    # charged in whole blocks of the pool, as the cache hands them out
    assert core.ledger.kv_reserved == {DEV_1.key: in_blocks(core, len(prompt) + MAX_NEW)}
    assert core.ledger.quotas.usage[DEV_1.key].sessions == 1
    emitted: list[int] = []
    wrong = (reference[0] + 1) % core.target.vocab_size
    verdict = await core.verify(session, pb.Draft(round=0, token_ids=[wrong, wrong]), None)
    assert (verdict.accepted, list(verdict.emitted_ids)) == (0, reference[:1])   # the correction
    emitted += verdict.emitted_ids
    while not session.finished:
        draft = reference[len(emitted):len(emitted) + 3]
        verdict = await core.verify(session, pb.Draft(round=session.round, token_ids=draft), None)
        assert verdict.accepted == verdict.verified > 0          # the target's own tokens: kept
        assert verdict.suggested_draft_len >= 1
        emitted += verdict.emitted_ids
    assert emitted == reference == session.generated
    assert verdict.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)
    # finished: its KV goes at once, its slot when the stream closes
    assert kv_free(core) and core.ledger.kv_reserved == {} and session.id in core.sessions
    core.close(session)
    assert core.sessions == {} and core.ledger.quotas.usage[DEV_1.key].sessions == 0
    assert kv_free(core) and core.ledger.kv_reserved == {}


def shaped_draft(round: int, right: list[int], wrong: int) -> tuple[list[int], list[int], int]:
    """Round `round`'s draft, one of five shapes in turn, from the target's greedy continuation
    `right` (4 tokens) and a token it does not take: (tokens, parents (none for a chain), draft
    tokens a greedy target accepts).

        a chain accepted whole            a chain rejected at its second token
        a tree whose second branch wins   a tree where a node that is no child of the accepted
        a chain rejected at once          one holds the target's next token (not taken)
    """
    r0, r1, r2, r3 = right
    shapes = [([r0, r1, r2], [], 3),
              ([r0, wrong, r2, r3], [], 1),
              ([wrong, r0, r1, r2], [0, 0, 2, 3], 3),       # root -> wrong; root -> r0 -> r1 -> r2
              ([wrong, r1, r0], [0, 1, 0], 1),              # root -> wrong -> r1; root -> r0
              ([wrong, wrong], [], 0)]
    return shapes[round % len(shapes)]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampling"])
async def test_after_every_round_the_kv_holds_the_prompt_and_output_but_the_last(
        make_core, models, prompts, temperature):
    """Many rounds of chains and trees, accepted whole, rejected, on another branch: after each
    the session's KV length is its prompt and output less the last token (fed with the next
    draft). A rejected token's KV kept, or an accepted one's lost, breaks it at once."""
    core = await make_core()
    prompt, model = prompts[0], models["llama"]
    request = open_request(core, prompt, max_new_tokens=40)
    request.sampling.temperature, request.sampling.top_k, request.sampling.seed = temperature, 3, 7
    session = await core.open(None, request, DEV_1)
    await core.prefill(session, deadline=None)
    judged: list[tuple[int, int]] = []
    while not session.finished:
        right = greedy_reference(model, prompt + session.generated, 4)
        wrong = min(set(range(8)) - set(right))
        tokens, parents, accepts = shaped_draft(session.round, right, wrong)
        verdict = await core.verify(session, pb.Draft(round=session.round, token_ids=tokens,
                                                      parents=parents), None)
        judged.append((verdict.verified, verdict.accepted))
        if session.finished:
            break
        assert session.kv.length == len(prompt) + len(session.generated) - 1, session.round
        if temperature == 0.0:
            assert (verdict.accepted, list(verdict.emitted_ids)) == (accepts, right[:accepts + 1])
    assert len(judged) >= 8
    assert any(accepted < verified for verified, accepted in judged)     # rejections
    assert sum(accepted for _, accepted in judged) > 0
    if temperature == 0.0:
        assert session.generated == greedy_reference(model, prompt, 40)
    assert kv_free(core)
    core.close(session)


def other_token(session, token: int) -> int:
    """A token other than `token` that ends nothing."""
    return next(t for t in range(token + 1, token + 9) if t not in session.end_ids)


# Ways a round's commit goes wrong after its forward (outcome, the session -> the outcome
# committed), each with the words of the fault it is ended for. The draft is the target's own
# 3 tokens: accepted whole, with a bonus.
CORRUPTIONS = {
    "emits one token less than it keeps": (
        lambda o, s: replace(o, emitted=o.emitted[:-1]), "of its prompt and output"),
    "keeps past the tokens its forward wrote": (
        lambda o, s: replace(o, accepted=o.accepted + 1, emitted=[*o.emitted, o.emitted[-1]]),
        "its forward wrote 4 tokens"),
    "its KV grows between its forward and its commit": (
        lambda o, s: s.kv.commit(1) or o, "its forward wrote 4 tokens"),
    "emits a token other than the one whose KV it keeps": (
        lambda o, s: replace(o, emitted=[*o.emitted[:2], other_token(s, o.emitted[2]),
                                         o.emitted[3]]),
        "was fed token"),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
async def test_a_round_whose_kv_is_not_its_output_ends_its_session_only(
        make_core, models, prompts, monkeypatch, caplog, corruption):
    """A round committed wrongly ends its session with INTERNAL (REASON_INTERNAL), naming the
    fault in one line and in the server's log; a session in the same step carries on to the
    target's own output."""
    corrupt, fault = CORRUPTIONS[corruption]
    core = await make_core()
    model = models["llama"]
    broken, _ = await opened(core, prompts[0], max_new_tokens=20)
    healthy, _ = await opened(core, prompts[1], DEV_2)
    verify = core.scheduler.verify

    async def corrupted(session, *args, **kwargs):
        outcome, info = await verify(session, *args, **kwargs)
        return (corrupt(outcome, session) if session is broken else outcome), info

    monkeypatch.setattr(core.scheduler, "verify", corrupted)
    drafts = [pb.Draft(round=0, token_ids=greedy_reference(model, s.prompt_ids, 3))
              for s in (broken, healthy)]
    with caplog.at_level("ERROR", logger="sled.server"):
        refused, verdict = await asyncio.gather(
            *(core.verify(s, d, None) for s, d in zip((broken, healthy), drafts)),
            return_exceptions=True)
    assert isinstance(refused, SessionError), refused
    assert (refused.code, refused.reason, refused.round) == (
        grpc.StatusCode.INTERNAL, Reason.REASON_INTERNAL, 0)
    assert fault in refused.message and broken.id in refused.message, refused.message
    assert "\n" not in refused.message
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [refused.message]
    assert verdict.accepted == 3 and verdict.timings.batch_size == 2     # the same step
    core.close(broken)                      # as the transport does when the stream ends
    while not healthy.finished:
        draft = greedy_reference(model, healthy.prompt_ids + healthy.generated, 3)
        await core.verify(healthy, pb.Draft(round=healthy.round, token_ids=draft), None)
    assert healthy.generated == greedy_reference(model, prompts[1], MAX_NEW)
    core.close(healthy)
    assert core.sessions == {} and kv_free(core)


async def test_a_server_mode_session_decodes_the_targets_greedy_output(make_core, models, prompts):
    core = await make_core()
    prompt = prompts[1]
    request = open_request(core, prompt)
    request.mode = pb.GENERATION_MODE_SERVER
    session = await core.open(None, request, DEV_1)
    await core.prefill(session, deadline=None)
    verdicts = [verdict async for verdict in core.decode(session, clock.now() + 60)]
    assert [t for v in verdicts for t in v.emitted_ids] == greedy_reference(models["llama"],
                                                                            prompt, MAX_NEW)
    core.close(session)
    assert core.sessions == {} and kv_free(core) and core.ledger.kv_reserved == {}


async def test_devices_a_proxy_names_by_certificate_share_the_kv_cache(make_core):
    """Certificates a trusted proxy verified name devices as mutual TLS does: each gets a part
    of the KV cache (a quarter), never all of it; hosts alone are one NAT's devices (all of it)."""
    named = await make_core()
    named.ledger.gate = Gate(proxies=TrustedProxies(("10.0.0.5",), "x-sled-client-cert"))
    block = named.pool.block_tokens
    assert named.ledger.kv_share_tokens() == named.pool.capacity_tokens // 4 // block * block
    named.ledger.gate = Gate(proxies=TrustedProxies(("10.0.0.5",)))      # no header: hosts only
    assert named.ledger.kv_share_tokens() == named.pool.capacity_tokens


async def test_admission_refuses_past_a_devices_share_and_past_the_pool(make_core, prompts):
    core = await make_core(kv_budget_bytes=1 << 20, kv_share=0.5,   # 1008 tokens, 496 a device
                           admission_queue=0)                   # refused at once, no wait
    block = core.pool.block_tokens         # half the pool, in whole blocks
    assert core.ledger.kv_share_tokens() == core.pool.capacity_tokens // 2 // block * block
    first, _ = await opened(core, prompts[0], DEV_1, max_new_tokens=300)
    with pytest.raises(SessionError) as refused:
        await core.open(None, open_request(core, prompts[1], 300), DEV_1)
    assert refused.value.reason == Reason.REASON_KV_BUDGET
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"device dev-1's share of the KV cache is {core.ledger.kv_share_tokens()} tokens" \
        in refused.value.message
    # the refused Open left nothing behind: no session, no quota count, no reservation
    assert list(core.sessions) == [first.id] and core.ledger.quotas.usage[DEV_1.key].sessions == 1
    assert core.ledger.kv_reserved == {DEV_1.key: in_blocks(core, len(prompts[0]) + 300)}
    second, _ = await opened(core, prompts[1], DEV_2, max_new_tokens=300)   # its own share
    assert core.ledger.kv_reserved[DEV_2.key] == in_blocks(core, len(prompts[1]) + 300)
    with pytest.raises(SessionError) as full:          # within its share, not within the pool
        await core.open(None, open_request(core, prompts[2], 450), DEV_3)
    assert full.value.reason == Reason.REASON_KV_BUDGET
    assert "the KV cache is full" in full.value.message
    assert "device dev-3's sessions hold 0 of its share" in full.value.message
    assert set(core.sessions) == {first.id, second.id} and DEV_3.key not in core.ledger.kv_reserved
    assert core.ledger.quotas.usage[DEV_3.key].sessions == 0
    for session in (first, second):
        core.close(session)
    assert kv_free(core) and core.ledger.kv_reserved == {} and core.sessions == {}


async def test_an_idle_session_is_evicted_through_the_core(make_core, prompts):
    core = await make_core(idle_timeout=5.0)
    idle, _ = await opened(core, prompts[0])
    busy, _ = await opened(core, prompts[1], DEV_2)
    busy.heard_from_device()                           # its draft is being verified
    assert core.evict_idle(time.monotonic() + 1) == []
    assert core.evict_idle(time.monotonic() + 6) == [idle]
    assert idle.evicted.is_set() and idle.evicted_after > 5
    assert list(core.sessions) == [busy.id]
    assert core.ledger.kv_reserved == {DEV_2.key: busy.kv_reserved}
    assert core.ledger.quotas.usage[DEV_1.key].sessions == 0
    assert core.metrics.value("sled_evicted_sessions_total") == 1
    with pytest.raises(SessionError) as refused:      # the device comes back: too late
        await core.verify(idle, pb.Draft(round=0, token_ids=[prompts[0][0]]), None)
    assert refused.value.reason == Reason.REASON_EVICTED
    core.close(idle)                                  # its stream ends: nothing is freed twice
    core.close(busy)
    assert core.sessions == {} and kv_free(core) and core.ledger.kv_reserved == {}
    assert core.ledger.quotas.usage[DEV_2.key].sessions == 0


def test_the_core_takes_no_grpc_object():
    """The core and its device ledger work from plain values: no gRPC import, no call context
    in any signature. (verify_server.errors maps refusals to grpc.StatusCode, so grpc itself is
    loaded.)"""
    modules = []
    for module in (core_module, ledger_module):
        tree = ast.parse(Path(module.__file__).read_text())
        modules += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names]
        modules += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert "verify_server.session" in modules          # the walk sees the core's imports
    assert "verify_server.quotas" in modules           # ... and the ledger's
    assert not [module for module in modules if "grpc" in module], modules
    functions = [core_module.round_deadline, ledger_module.hold, ledger_module.release,
                 *(f for _, f in inspect.getmembers(VerifierCore, inspect.isfunction)),
                 *(f for _, f in inspect.getmembers(DeviceLedger, inspect.isfunction))]
    assert len(functions) > 15
    for function in functions:
        for name, parameter in inspect.signature(function).parameters.items():
            assert name not in ("context", "request_iterator", "requests"), function
            assert "grpc" not in str(parameter.annotation), function


def test_a_rounds_deadline_is_the_earlier_of_the_calls_and_its_own():
    now = time.perf_counter()
    assert core_module.round_deadline(None) is None
    assert core_module.round_deadline(now + 10) == now + 10
    assert now + 0.5 <= core_module.round_deadline(None, 500) < now + 5
    assert now + 0.5 <= core_module.round_deadline(now + 10, 500) < now + 5
    assert core_module.round_deadline(now + 0.1, 5000) == now + 0.1
