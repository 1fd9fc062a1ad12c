"""A device checks what a server tells it: against a real gRPC server that lies (tests/
lying_server.py), each lie ends the session with BrokenVerdict (or, for silence, as a lost
server) within its deadline, nothing of the lying verdict is committed or shown, and a silent
server is failed over like a lost one. The rules themselves, one verdict at a time:
tests/test_verdict_check.py."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import grpc
import pytest

from edge_client.daemon import Device, DeviceError, Request
from edge_client.result import LOST, RESUMED
from edge_client.server_side import generate_server_side
from edge_client.session import RoundSettings, SessionHooks, Target, device_session
from edge_client.settings import DeviceSettings
from edge_client.transport import ServerLost, VerifyError
from edge_client.verdict_check import BrokenVerdict
from edge_client.wire import SessionRequest
from lying_server import LIES, VOCAB, LyingVerifier, serve
from sled.v1 import verifier_pb2_grpc as pb_grpc
from sled.wire.fingerprint import fingerprint_tokenizer
from test_device_session import PROMPT, CountingDrafter
from test_hostile_server import chunked

ROUND_0 = [2, 3, 4, 5]         # what the honest first round commits: 3 drafts and a bonus
PROBLEMS = {
    "undrafted": "are not what the device drafted",
    "too_many": "emits 15000 tokens where 8 are left",
    "huge": "emits 500000 tokens where 8 are left",
    "wrong_round": "answers round 6, the device waits for round 1",
    "out_of_vocab": f"outside the target's vocabulary of {VOCAB}",
    "loose": "loosely in a session that asked for exact verification",
    "unfinished": "reaches max_new_tokens (8 tokens left) without finishing",
}


@pytest.fixture
async def liars():
    """liars(verifier) -> (a stub to it, the verifier); every server and channel closed after."""
    opened = []

    async def start(verifier: LyingVerifier):
        server, address = await serve(verifier)
        channel = grpc.aio.insecure_channel(address)
        opened.append((server, channel))
        return pb_grpc.VerifierStub(channel)

    yield start
    for server, channel in opened:
        await channel.close()
        await server.stop(grace=0)


def drafting(stub, shown: list[int], **settings):
    return device_session(stub, CountingDrafter(), SessionRequest(PROMPT, 12),
                          RoundSettings(draft_len=3, reconnect_s=0, **settings),
                          target=Target(vocab_size=VOCAB),
                          hooks=SessionHooks(on_tokens=shown.extend))


@pytest.mark.parametrize("lie", sorted(PROBLEMS))
async def test_a_lying_verdict_ends_the_session_and_nothing_of_it_is_kept(liars, lie):
    stub = await liars(LyingVerifier(lie, lie_at=1))
    shown: list[int] = []
    session = drafting(stub, shown)
    started = time.perf_counter()
    with pytest.raises(BrokenVerdict) as refused:
        await session.run()
    assert time.perf_counter() - started < 5
    assert PROBLEMS[lie] in refused.value.problem and "nothing of it was kept" in str(refused.value)
    assert refused.value.code == grpc.StatusCode.DATA_LOSS
    assert session.result.token_ids == shown == ROUND_0      # the honest round alone


async def test_the_server_modes_check_their_verdicts_too(liars):
    stub = await liars(LyingVerifier("out_of_vocab", lie_at=0))
    shown: list[int] = []
    with pytest.raises(BrokenVerdict, match="outside the target's vocabulary"):
        await generate_server_side(stub, SessionRequest(PROMPT, 12),
                                   hooks=SessionHooks(on_tokens=shown.extend), vocab_size=VOCAB)
    assert shown == []


async def test_a_silent_server_is_lost_within_the_verdict_deadline(liars):
    stub = await liars(LyingVerifier("silent", lie_at=1))
    shown: list[int] = []
    started = time.perf_counter()
    with pytest.raises(ServerLost):
        await drafting(stub, shown, verdict_timeout_s=0.5).run()
    assert 0.5 <= time.perf_counter() - started < 5
    assert shown == ROUND_0


async def test_a_server_that_never_opens_is_refused_within_the_open_deadline(liars):
    stub = await liars(LyingVerifier("silent_open"))
    started = time.perf_counter()
    with pytest.raises(VerifyError, match="no Opened within 0.5 s: it went silent") as lost:
        await drafting(stub, [], open_timeout_s=0.5).run()
    assert lost.value.code == grpc.StatusCode.UNAVAILABLE
    assert time.perf_counter() - started < 5


async def test_a_silent_server_is_failed_over_and_the_output_is_the_targets(liars):
    silent = await liars(LyingVerifier("silent", lie_at=1))
    honest_verifier = LyingVerifier()
    honest = await liars(honest_verifier)
    events, shown = [], []
    session = device_session(silent, CountingDrafter(), SessionRequest(PROMPT, 12),
                             RoundSettings(draft_len=3, reconnect_s=10, verdict_timeout_s=0.5),
                             target=Target(vocab_size=VOCAB),
                             hooks=SessionHooks(reopen_on=lambda: honest, on_tokens=shown.extend,
                                                on_server=events.append))
    # the first open goes to the stub it was given (the silent one); after the loss, reopen_on
    result = await session.run()
    assert result.token_ids == shown == list(range(2, 14)) and result.resumes == 1
    assert [e.kind for e in events] == [LOST, RESUMED] and "went silent" in events[0].detail
    assert honest_verifier.opens == 1


async def test_the_daemon_gives_up_on_a_silent_tokenizer_within_its_deadline(tmp_path, monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    server, address = await serve(LyingVerifier("silent_tokenizer", fingerprint="sha256:" + "0" * 64))
    device = Device(DeviceSettings(id="liar-test", servers=[address], drafter="ngram",
                                   tokenizer_timeout_s=0.5))
    started = time.perf_counter()
    try:
        await device.start()
        assert time.perf_counter() - started < 10
        assert device.state == "waiting" and address in device.reason, device.reason
        assert "DEADLINE_EXCEEDED" in device.reason or "deadline" in device.reason.lower()
    finally:
        await device.close()
        await server.stop(grace=0)


async def test_the_daemon_names_the_server_whose_verdict_broke_the_rules(tokenizer, tmp_path,
                                                                         monkeypatch):
    """The daemon's request fails (503's kind) naming the server and the rule, and nothing of
    the lying verdict reaches the caller."""
    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    server, address = await serve(LyingVerifier("too_many", lie_at=0,
                                                fingerprint=fingerprint_tokenizer(tokenizer)))
    device = Device(DeviceSettings(id="liar-test", servers=[address], drafter="ngram"),
                    tokenizer=tokenizer)
    got: list[int] = []
    try:
        await device.start()
        assert device.state == "ready", device.reason
        with pytest.raises(DeviceError) as refused:
            async for chunk in device.stream(Request([5, 6, 7], max_tokens=12)):
                got.extend(chunk.token_ids)
    finally:
        await device.close()
        await server.stop(grace=0)
    assert refused.value.kind == "unavailable" and got == []
    assert f"the verify server {address} sent a verdict that breaks the protocol" in str(refused.value)
    assert "emits 15000 tokens where 12 are left" in str(refused.value)


async def test_sled_generate_says_which_server_broke_the_rules_and_shows_nothing_of_it(
        liars, tokenizer, tmp_path):
    fingerprint = fingerprint_tokenizer(tokenizer)
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    server, address = await serve(LyingVerifier("too_many", lie_at=0, fingerprint=fingerprint,
                                                chunks=chunked(fingerprint, files)))
    try:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sled_cli.main", "generate", "--server", address, "--prompt",
            "def", "--max-new-tokens", "12", "--drafter", "ngram", "--json",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "SLED_CACHE": str(tmp_path / "cache"),
                 "PYTHONPATH": os.pathsep.join(sys.path)})
        out, err = await asyncio.wait_for(child.communicate(), 120)
    finally:
        await server.stop(grace=0)
    lines = [line for line in err.decode().splitlines() if line.startswith("sled generate:")]
    assert child.returncode == 4, err.decode()
    assert len(lines) == 1 and address in lines[0] and "breaks the protocol" in lines[0], err.decode()
    assert "emits 15000 tokens where 12 are left" in lines[0]
    assert b"lossless" not in out


def test_every_lie_of_the_kit_is_tested():
    # a server that drops every draft: tests/test_silent_server.py
    assert set(LIES) == set(PROBLEMS) | {"silent", "silent_open", "silent_tokenizer", "unavailable",
                                         "evicted"}
