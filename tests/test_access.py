"""Who may use a server: per-device bearer tokens (missing, wrong, revoked on reload), tokens
pinned to a certificate name, health open to all, reflection that can be turned off, the device
in the metrics, the prefix cache scoped per device, and per-device quotas (sessions, tokens/s)
that refuse one device while the others carry on, losslessly."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import greedy_reference
from drafters.ngram import NgramDrafter
from edge_client.security import AuthorizedStub, ChannelSecurity
from edge_client.session import generate
from edge_client.wire import SessionRequest
from sled.wire.auth import bearer_metadata, bearer_token
from sled.v1 import verifier_pb2 as pb
from sled.v1.verifier_pb2_grpc import VerifierStub
from verify_server.auth import Gate, TokenFileError, read_token_file
from verify_server.auth import Identity
from verify_server.quotas import Quotas, TokenBucket

TOKENS = {"dev-1": "tok-dev-1-aaaaaaaaaaaaaaaa", "dev-2": "tok-dev-2-bbbbbbbbbbbbbbbb",
          "cam-3": "tok-cam-3-cccccccccccccccc"}
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def token_file(path, devices=TOKENS, extra: dict[str, str] | None = None):
    lines = ["# DEVICE_ID TOKEN [cert=NAME] [sessions=N] [tokens_per_s=R]"]
    lines += [f"{d} {t} {(extra or {}).get(d, '')}".rstrip() for d, t in devices.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def stub_of(server, token: str = ""):
    channel = grpc.aio.insecure_channel(server.address)
    return channel, ChannelSecurity(token=token).stub(channel)


async def refused(call_coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call_coro
    return caught.value


# --- the token file and the header -------------------------------------------------------------

def test_bearer_metadata_round_trips_and_ignores_other_schemes():
    assert bearer_token(bearer_metadata("abc")) == "abc"
    assert bearer_token([("authorization", "bearer  xyz ")]) == "xyz"
    assert bearer_token([("authorization", "Basic xyz")]) is None
    assert bearer_token([("x-other", "Bearer xyz")]) is None
    assert bearer_token([("authorization", "Bearer " + "x" * 600)]) is None
    assert bearer_metadata("") == ()


@pytest.mark.parametrize("line, why", [
    ("dev-1", "expected DEVICE_ID TOKEN"),
    ("dev-1 short", "shorter than 16"),
    ("../x tok-aaaaaaaaaaaaaaaaaaaa", "device id"),
    ("dev-1 tok-aaaaaaaaaaaaaaaaaaaa colour=red", "unknown option"),
    ("dev-1 tok-aaaaaaaaaaaaaaaaaaaa sessions=0", "sessions must be >= 1"),
    ("dev-1 tok-aaaaaaaaaaaaaaaaaaaa tokens_per_s=fast", "could not convert"),
])
def test_a_bad_token_line_names_its_line_never_the_token(tmp_path, line, why):
    path = tmp_path / "tokens"
    path.write_text("# devices\n" + line + "\n")
    with pytest.raises(TokenFileError) as caught:
        read_token_file(path)
    assert f"{path}:2" in str(caught.value) and why in str(caught.value)
    assert "tok-aaaa" not in str(caught.value)


def test_a_device_or_token_listed_twice_is_refused(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("a tok-aaaaaaaaaaaaaaaaaaaa\nb tok-aaaaaaaaaaaaaaaaaaaa\n")
    with pytest.raises(TokenFileError, match="listed twice"):
        read_token_file(path)


def test_a_reload_that_fails_keeps_the_tokens_in_force(tmp_path):
    path = token_file(tmp_path / "tokens")
    gate = Gate(path)
    path.write_text("broken\n")
    assert gate.reload() is False
    assert {g.device for g in gate.grants} == set(TOKENS)


# --- tokens on a live server ---------------------------------------------------------------------

@pytest.fixture
async def guarded(serve, models, tmp_path):
    """A server that wants device tokens; reflection off."""
    path = token_file(tmp_path / "tokens")
    server = await serve(models["llama"], auth_tokens=str(path), reflection=False)
    server.tokens_path = path
    return server


async def test_a_missing_or_wrong_token_is_unauthenticated_on_every_call(guarded):
    for token, says in (("", "wants a device token"), ("not-a-token-of-anyone-x", "not known")):
        channel, stub = stub_of(guarded, token)
        async with channel:
            error = await refused(stub.GetModelInfo(pb.GetModelInfoRequest()))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED and says in error.details()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.GetTokenizer(pb.GetTokenizerRequest()):
                    pass
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call, reply = await open_session(stub, guarded.service.core.target.fingerprint)
            assert reply.error.reason == pb.ErrorDetail.REASON_UNAUTHENTICATED
            assert await call.code() == grpc.StatusCode.UNAUTHENTICATED
    assert guarded.metrics.value("sled_auth_refusals_total", {"reason": "unauthenticated"}) == 6
    assert not guarded.service.core.sessions


async def test_a_known_token_generates_losslessly_and_names_its_device(guarded, models):
    channel, stub = stub_of(guarded, TOKENS["dev-1"])
    async with channel:
        result = await generate(stub, NgramDrafter(), SessionRequest(PROMPT, max_new_tokens=8))
    assert result.token_ids == greedy_reference(models["llama"], PROMPT, 8)
    assert guarded.metrics.value("sled_device_sessions_total", {"device": "dev-1"}) == 1
    assert guarded.metrics.value("sled_device_tokens_total", {"device": "dev-1"}) > len(PROMPT)
    assert guarded.metrics.value("sled_device_sessions_total", {"device": "dev-2"}) == 0


async def test_a_revoked_token_is_refused_after_the_reload_and_the_others_go_on(guarded, models):
    token_file(guarded.tokens_path, {d: t for d, t in TOKENS.items() if d != "dev-2"})
    assert guarded.service.core.ledger.gate.reload()   # what SIGHUP runs (tests/test_tls.py sends one)
    channel, revoked = stub_of(guarded, TOKENS["dev-2"])
    async with channel:
        error = await refused(revoked.GetModelInfo(pb.GetModelInfoRequest()))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    channel, kept = stub_of(guarded, TOKENS["dev-1"])
    async with channel:
        result = await generate(kept, NgramDrafter(), SessionRequest(PROMPT, max_new_tokens=6))
    assert result.token_ids == greedy_reference(models["llama"], PROMPT, 6)


async def test_health_needs_no_token_and_reflection_can_be_off(guarded):
    async with grpc.aio.insecure_channel(guarded.address) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        requests = [reflection_pb2.ServerReflectionRequest(list_services="")]
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter(requests))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_pinned_tokens_without_mutual_tls_stop_start_up(serve, models, tmp_path):
    """Only mutual TLS proves a certificate name: a server that could never honour a pin says
    so when it starts, instead of denying every call of that device (tests/test_tls.py holds a
    pinned token over the wrong certificate: PERMISSION_DENIED)."""
    path = token_file(tmp_path / "tokens", extra={"dev-1": "cert=dev-1"})
    with pytest.raises(TokenFileError, match="pins 1 tokens to client certificates .* "
                                             "add --tls-client-ca"):
        await serve(models["llama"], auth_tokens=str(path))


async def test_the_prefix_cache_is_shared_within_a_device_never_across(guarded):
    """Same host, same salt: only the same device's second session hits the cache."""
    prompt = list(range(40, 120)) + [5]

    async def cached(token: str) -> int:
        channel, stub = stub_of(guarded, token)
        async with channel:
            call = stub.Generate()
            await call.write(pb.DeviceMessage(open=pb.Open(
                prompt_ids=prompt, max_new_tokens=2,
                tokenizer_fingerprint=guarded.service.core.target.fingerprint)))
            opened = (await call.read()).opened
            call.cancel()
            return opened.cached_prompt_tokens

    assert await cached(TOKENS["dev-1"]) == 0
    assert await cached(TOKENS["dev-2"]) == 0           # another device: no hit
    assert await cached(TOKENS["dev-1"]) > 0            # the same device: a hit


def test_the_stub_adds_the_token_to_calls_that_bring_their_own_metadata():
    seen = {}

    class Fake:
        def GetModelInfo(self, request, metadata=None, **kwargs):
            seen.update(metadata=metadata, **kwargs)

    AuthorizedStub(Fake(), bearer_metadata("t0k")).GetModelInfo(None, metadata=(("x", "1"),),
                                                               timeout=3)
    assert seen == {"metadata": (("x", "1"), ("authorization", "Bearer t0k")), "timeout": 3}


# --- quotas ----------------------------------------------------------------------------------------

def test_the_token_bucket_holds_work_until_it_can_pay():
    bucket = TokenBucket(rate=100.0, capacity=200.0, stamp=0.0)
    assert bucket.wait_s(150, 0.0) == 0.0
    bucket.charge(150, 0.0)
    assert bucket.wait_s(150, 0.0) == pytest.approx(1.0)      # 50 held, 100 more to come
    assert bucket.wait_s(500, 0.0) == pytest.approx(1.5)      # more than it holds: a full one
    bucket.charge(500, 2.0)                                    # paid ahead: 300 in debt at most
    assert bucket.wait_s(1, 2.0) == pytest.approx(3.01)
    assert bucket.full(10.0)
    bucket.retune(10.0, 20.0, 10.0)                            # SIGHUP: a lower rate
    assert bucket.level == 20.0 and bucket.wait_s(20, 10.0) == 0.0


async def test_idle_devices_are_swept_from_the_quota_table():
    quotas = Quotas(tokens_per_s=1e6)
    for host in range(50):
        identity = Identity("anonymous", False, f"host:10.0.0.{host}")
        quotas.open(identity)
        await quotas.pace(identity, 10)
        quotas.close(identity)
    busy = Identity("dev-1", True, "device:dev-1")
    quotas.open(busy)
    await asyncio.sleep(0.01)           # the buckets refill (1e6 tokens/s)
    quotas.sweep()
    assert list(quotas.usage) == ["device:dev-1"]


async def open_session(stub, fingerprint: str, prompt=PROMPT, max_new_tokens: int = 64):
    """An opened device-drafts session's call (or the AioRpcError/VerifyError it ended with)."""
    call = stub.Generate()
    await call.write(pb.DeviceMessage(open=pb.Open(prompt_ids=prompt, max_new_tokens=max_new_tokens,
                                                   ignore_eos=True, tokenizer_fingerprint=fingerprint)))
    return call, await call.read()


async def test_a_device_at_its_session_quota_is_refused_while_others_open(serve, models, tmp_path):
    path = token_file(tmp_path / "tokens", extra={"cam-3": "sessions=1"})
    server = await serve(models["llama"], auth_tokens=str(path), quota_sessions=2)
    fingerprint = server.service.core.target.fingerprint
    channel, greedy = stub_of(server, TOKENS["dev-1"])
    async with channel:
        held = [await open_session(greedy, fingerprint) for _ in range(3)]
        assert [reply.WhichOneof("kind") for _, reply in held] == ["opened", "opened", "error"]
        third = held[2][0]
        assert await third.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert held[2][1].error.reason == pb.ErrorDetail.REASON_QUOTA
        assert "device dev-1 has 2 sessions open, its quota" in await third.details()
        other_channel, other = stub_of(server, TOKENS["dev-2"])
        async with other_channel:
            result = await generate(other, NgramDrafter(), SessionRequest(PROMPT, max_new_tokens=6))
        assert result.token_ids == greedy_reference(models["llama"], PROMPT, 6)
        for call, _ in held[:2]:
            call.cancel()
        await asyncio.sleep(0.2)
        again, reply = await open_session(greedy, fingerprint)   # closing gave the slots back
        assert reply.WhichOneof("kind") == "opened"
        again.cancel()
    cam_channel, cam = stub_of(server, TOKENS["cam-3"])         # its own line: 1 session
    async with cam_channel:
        first, _ = await open_session(cam, fingerprint)
        second, reply = await open_session(cam, fingerprint)
        assert reply.error.reason == pb.ErrorDetail.REASON_QUOTA
        first.cancel()


async def greedy_rounds(stub, fingerprint: str, seconds: float) -> int:
    """A device sending the longest drafts it may, as fast as it can, for `seconds`: rounds done."""
    call, reply = await open_session(stub, fingerprint, max_new_tokens=1000)
    assert reply.WhichOneof("kind") == "opened", reply
    rounds, stop = 0, time.monotonic() + seconds
    while time.monotonic() < stop:
        await call.write(pb.DeviceMessage(draft=pb.Draft(round=rounds, token_ids=[7] * 4)))
        verdict = await call.read()
        assert verdict.WhichOneof("kind") == "verdict", verdict
        rounds += 1
    call.cancel()
    return rounds


async def test_a_greedy_device_is_held_to_its_rate_while_two_others_stay_lossless(
        serve, models, tmp_path):
    """dev-1 floods rounds of 4-token drafts; its tokens through the target stay within what
    its bucket allows (burst + rate x time), and dev-2 and cam-3 get the target's own output.
    Their round latency is printed, not asserted (a timed assert fails on a busy machine)."""
    rate, burst_s, seconds = 60.0, 1.0, 3.0
    path = token_file(tmp_path / "tokens", extra={"dev-1": f"tokens_per_s={rate:g}"})
    server = await serve(models["llama"], auth_tokens=str(path), max_draft_tokens=4,
                         quota_burst_s=burst_s, quota_wait_s=5.0)
    fingerprint = server.service.core.target.fingerprint
    channels = [stub_of(server, TOKENS[d]) for d in ("dev-1", "dev-2", "cam-3")]
    started = time.monotonic()
    flood = asyncio.create_task(greedy_rounds(channels[0][1], fingerprint, seconds))
    results = await asyncio.gather(*(generate(stub, NgramDrafter(),
                                              SessionRequest(PROMPT, max_new_tokens=24))
                                     for _, stub in channels[1:]))
    rounds = await flood
    elapsed = time.monotonic() - started
    for channel, _ in channels:
        await channel.close()
    assert all(r.token_ids == greedy_reference(models["llama"], PROMPT, 24) for r in results)
    spent = server.metrics.value("sled_device_tokens_total", {"device": "dev-1"})
    # the bucket admits work while it is out of debt, so it overspends by one charge at most
    allowed = rate * burst_s + rate * elapsed + max(len(PROMPT), 4 + 1)
    print(f"dev-1: {rounds} rounds, {spent:.0f} tokens in {elapsed:.1f} s (allowed {allowed:.0f}); "
          f"others: {[r.rounds for r in results]} rounds")
    assert spent <= allowed, f"dev-1 spent {spent} tokens, its quota allows {allowed:.0f}"
    assert rounds * 5 >= rate * seconds * 0.5, "the quota held dev-1 far below its rate"


async def test_work_far_over_the_rate_is_refused_naming_the_quota(serve, models, tmp_path):
    """10 tokens/s, 1 s of burst, 0.5 s of wait (15 tokens at once): a 40-token prompt can never be paid and is
    refused as its session opens, holding no KV; a 10-token one empties the bucket and the
    next session's prefill, which would wait 1 s, is refused at once; a session that opened
    still finishes, its rounds paced."""
    path = token_file(tmp_path / "tokens", extra={"dev-1": "tokens_per_s=10"})
    server = await serve(models["llama"], auth_tokens=str(path), quota_burst_s=1.0,
                         quota_wait_s=0.5)
    fingerprint = server.service.core.target.fingerprint
    channel, stub = stub_of(server, TOKENS["dev-1"])
    async with channel:
        huge, reply = await open_session(stub, fingerprint, prompt=list(range(5, 45)))
        assert reply.error.reason == pb.ErrorDetail.REASON_QUOTA
        assert "takes at most 15 tokens at once and this prompt has 40" in await huge.details()
        assert server.service.core.pool.committed_blocks == 0 and not server.service.core.sessions
        first, reply = await open_session(stub, fingerprint, prompt=list(range(5, 15)),
                                          max_new_tokens=3)
        assert reply.WhichOneof("kind") == "opened"
        second, reply = await open_session(stub, fingerprint, prompt=list(range(5, 20)))
        assert reply.error.reason == pb.ErrorDetail.REASON_QUOTA
        assert await second.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "device dev-1 is over its quota of 10 tokens/s" in await second.details()
        for round in range(3):     # 2 tokens a round at 10/s: paced, never refused
            await first.write(pb.DeviceMessage(draft=pb.Draft(round=round, token_ids=[7])))
            reply = await first.read()
            assert reply.WhichOneof("kind") == "verdict", reply
            if reply.verdict.finish_reason:
                break
        assert reply.verdict.finish_reason == pb.FINISH_REASON_LENGTH
    other_channel, other = stub_of(server, TOKENS["dev-2"])
    async with other_channel:
        result = await generate(other, NgramDrafter(), SessionRequest(PROMPT, max_new_tokens=4))
    assert result.token_ids == greedy_reference(models["llama"], PROMPT, 4)


def test_a_device_holds_a_quarter_of_the_sessions_by_default():
    from verify_server.settings import ServerSettings

    assert ServerSettings().device_sessions() == 64                   # of 256
    assert ServerSettings(max_sessions=2).device_sessions() == 1      # at least one
    assert ServerSettings(quota_sessions=0).device_sessions() == 0    # only max_sessions
    assert ServerSettings(max_sessions=8, quota_sessions=5).device_sessions() == 5


async def test_by_default_two_devices_cannot_hold_every_session(serve, models, tmp_path):
    """max_sessions 8, no --quota-sessions: a device with a token holds 2; the others open."""
    server = await serve(models["llama"], auth_tokens=str(token_file(tmp_path / "tokens")),
                         max_sessions=8)
    fingerprint = server.service.core.target.fingerprint
    held = []
    for device in ("dev-1", "dev-2"):
        channel, stub = stub_of(server, TOKENS[device])
        held.append(channel)
        replies = [await open_session(stub, fingerprint) for _ in range(3)]
        assert [reply.WhichOneof("kind") for _, reply in replies] == ["opened", "opened", "error"]
        assert f"device {device} has 2 sessions open, its quota" in replies[2][1].error.message
    channel, cam = stub_of(server, TOKENS["cam-3"])
    async with channel:
        result = await generate(cam, NgramDrafter(), SessionRequest(PROMPT, max_new_tokens=4))
    assert result.token_ids == greedy_reference(models["llama"], PROMPT, 4)
    for channel in held:
        await channel.close()
