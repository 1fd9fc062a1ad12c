"""A server that answers Opened and then stays silent, or drops every draft (a lost stream, an
eviction), costs a device a bounded time: each silence, and each loss with no verdict since the
session opened, is a strike; a session reopens on it silent_retries times (1 by default), a pause
first, and its next strike ends the request with one line naming it: `sled generate` keeps the
committed output and exits 4, the daemon answers 503 (an MQTT request an error) and, after a
silence, its /health says degraded until the server answers a probe. Another compatible server
that did not go silent, where there is one, takes the session first (tests/lying_server.py is
the server)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import aiohttp
import grpc
import pytest

from edge_client import server_choice
from edge_client.daemon import Device, Request
from edge_client.device_status import DeviceState
from edge_client.mqtt import DeviceMqtt
from edge_client.result import LOST, RESUMED, SERVER_FAILED, SERVER_SILENT
from edge_client.server_choice import ServerChoice
from edge_client.server_side import generate_server_side
from edge_client.servers import ServerDirectory
from edge_client.session import PAUSE_S, RoundSettings, SessionHooks, Target, device_session
from edge_client.settings import DeviceSettings
from edge_client.transport import ServerGivenUp, ServerSilent, Silence, VerifyError
from edge_client.wire import SessionRequest
from lying_server import VOCAB, LyingVerifier, serve
from sled.v1 import verifier_pb2_grpc as pb_grpc
from sled.wire.fingerprint import fingerprint_tokenizer
from sled_cli import generate
from test_device_session import PROMPT, CountingDrafter
from test_generate_output import Session
from test_hostile_server import chunked, tokenizer_files  # noqa: F401  (a fixture)
from test_mqtt import connected_until_the_end, quick_backoff, topic
from test_openai_api import post, running_api
from tests.mqtt_broker import Watcher, eventually, mosquitto  # noqa: F401  (a fixture)

VERDICT_S = 0.5        # verdict_timeout_s here: small, so that each silence is short
RECONNECT_S = 5.0
# The default bound: (silent_retries + 1) x verdict_timeout_s, plus the reopening (reconnect_s).
BOUND_S = 2 * VERDICT_S + RECONNECT_S
# What a test waits at most for what must end within its bound (a device that retried for ever
# fails here rather than hang).
GIVE_UP_S = 30.0


@pytest.fixture
async def servers():
    """servers(verifier) -> its address; every server stopped after."""
    started = []

    async def start(verifier: LyingVerifier) -> str:
        server, address = await serve(verifier)
        started.append(server)
        return address

    yield start
    for server in started:
        await server.stop(grace=0)


# -- a session ------------------------------------------------------------------------------
@pytest.mark.parametrize("retries", [0, 1, 2])
async def test_a_session_reopens_on_a_silent_server_silent_retries_times_then_ends(servers, retries):
    verifier = LyingVerifier("silent", lie_at=0)
    events, shown = [], []
    async with grpc.aio.insecure_channel(await servers(verifier)) as channel:
        session = device_session(pb_grpc.VerifierStub(channel), CountingDrafter(),
                                 SessionRequest(PROMPT, 12),
                                 RoundSettings(draft_len=3, reconnect_s=RECONNECT_S,
                                               verdict_timeout_s=VERDICT_S, silent_retries=retries),
                                 target=Target(vocab_size=VOCAB),
                                 hooks=SessionHooks(on_tokens=shown.extend, on_server=events.append))
        started = time.perf_counter()
        with pytest.raises(ServerSilent) as ended:
            await asyncio.wait_for(session.run(), GIVE_UP_S)
        elapsed = time.perf_counter() - started
    assert verifier.opens == retries + 1                    # the first open and one per retry
    assert (retries + 1) * VERDICT_S <= elapsed < (retries + 1) * VERDICT_S + RECONNECT_S
    assert [e.kind for e in events] == [LOST, RESUMED] * retries and all(e.silent for e in events[::2])
    assert ended.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and ended.value.times == retries + 1
    assert "no verdict for round 0 within 0.5 s" in ended.value.naming("gpu-1:50051")
    assert shown == [] and session.result.token_ids == []


async def test_a_server_mode_session_is_bounded_the_same_way(servers):
    verifier = LyingVerifier("silent", lie_at=0)
    async with grpc.aio.insecure_channel(await servers(verifier)) as channel:
        started = time.perf_counter()
        with pytest.raises(ServerSilent, match="went silent 2 times"):
            await asyncio.wait_for(generate_server_side(
                pb_grpc.VerifierStub(channel), SessionRequest(PROMPT, 12), reconnect_s=RECONNECT_S,
                verdict_timeout_s=VERDICT_S, vocab_size=VOCAB), GIVE_UP_S)
        assert time.perf_counter() - started < BOUND_S
    assert verifier.opens == 2


# -- a server that fails every draft --------------------------------------------------------
def one_session(channel, retries: int = 1, events: list | None = None):
    """A drafting session of 12 tokens on `channel`'s server, as the tests here run it; its
    server events go to `events`."""
    return device_session(pb_grpc.VerifierStub(channel), CountingDrafter(),
                          SessionRequest(PROMPT, 12),
                          RoundSettings(draft_len=3, reconnect_s=RECONNECT_S,
                                        verdict_timeout_s=VERDICT_S, silent_retries=retries),
                          target=Target(vocab_size=VOCAB),
                          hooks=SessionHooks(on_server=[].append if events is None else events.append))


@pytest.mark.parametrize("lie, last", [("unavailable", "UNAVAILABLE: the liar drops the stream"),
                                       ("evicted", "ABORTED: the liar evicts every draft")])
async def test_a_server_that_fails_every_draft_has_a_strike_each_time_and_ends_the_session(
        servers, lie, last):
    verifier = LyingVerifier(lie, lie_at=0)
    async with grpc.aio.insecure_channel(await servers(verifier)) as channel:
        session = one_session(channel)
        started = time.perf_counter()
        with pytest.raises(ServerGivenUp) as ended:
            await asyncio.wait_for(session.run(), GIVE_UP_S)
        elapsed = time.perf_counter() - started
    assert verifier.opens == 2 and elapsed < RECONNECT_S       # no reopening in a tight loop
    assert not isinstance(ended.value, ServerSilent) and ended.value.code == grpc.StatusCode.ABORTED
    assert ended.value.naming("gpu-1:50051") == (
        f"the verify server gpu-1:50051 dropped the session without a verdict 2 times (the last: "
        f"{last}), so the request ends")
    assert session.result.token_ids == [] and session.result.resumes == 2


async def test_each_reopening_after_a_strike_waits_longer_than_the_last(servers):
    verifier = LyingVerifier("unavailable", lie_at=0)
    async with grpc.aio.insecure_channel(await servers(verifier)) as channel:
        started = time.perf_counter()
        with pytest.raises(ServerGivenUp, match="4 times"):
            await asyncio.wait_for(one_session(channel, retries=3).run(), GIVE_UP_S)
        elapsed = time.perf_counter() - started
    assert verifier.opens == 4
    assert elapsed >= PAUSE_S * (1 + 2 + 4)                    # 0.05, 0.1 and 0.2 s before each


async def test_a_server_lost_after_a_verdict_each_time_is_no_strike(servers):
    verifier = LyingVerifier("unavailable", lie_at=1)         # answers round 0 of every open
    events = []
    async with grpc.aio.insecure_channel(await servers(verifier)) as channel:
        session = one_session(channel, retries=0, events=events)
        result = await asyncio.wait_for(session.run(), GIVE_UP_S)
    assert result.token_ids == list(range(len(PROMPT), len(PROMPT) + 12)) and result.resumes == 2
    assert verifier.opens == 3 and [e.kind for e in events] == [LOST, RESUMED] * 2


async def test_a_server_mode_session_on_a_server_that_drops_it_ends_the_same_way(servers):
    verifier = LyingVerifier("unavailable", lie_at=0)
    async with grpc.aio.insecure_channel(await servers(verifier)) as channel:
        with pytest.raises(ServerGivenUp, match="dropped the session without a verdict 2 times"):
            await asyncio.wait_for(generate_server_side(
                pb_grpc.VerifierStub(channel), SessionRequest(PROMPT, 12), reconnect_s=RECONNECT_S,
                verdict_timeout_s=VERDICT_S, vocab_size=VOCAB), GIVE_UP_S)
    assert verifier.opens == 2


# -- sled generate --------------------------------------------------------------------------
async def stderr_lines(stream: asyncio.StreamReader) -> list[tuple[float, str]]:
    """Each line of a child's stderr with the perf_counter time it arrived."""
    lines = []
    while line := await stream.readline():
        lines.append((time.perf_counter(), line.decode().rstrip("\n")))
    return lines


async def test_sled_generate_ends_on_a_silent_server_with_its_output_exit_4_and_one_line(
        servers, tokenizer, tokenizer_files, tmp_path):  # noqa: F811
    fingerprint = fingerprint_tokenizer(tokenizer)
    verifier = LyingVerifier("silent", lie_at=1, fingerprint=fingerprint,     # answers round 0
                             chunks=chunked(fingerprint, tokenizer_files))
    address = await servers(verifier)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sled_cli.main", "generate", "--server", address, "--prompt", "def",
        "--max-new-tokens", "12", "--drafter", "ngram", "--verdict-timeout-s", str(VERDICT_S),
        "--reconnect-s", str(RECONNECT_S), "--json", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "SLED_CACHE": str(tmp_path / "cache"),
             "PYTHONPATH": os.pathsep.join(sys.path)})
    (out, lines), _ = await asyncio.wait_for(asyncio.gather(
        asyncio.gather(child.stdout.read(), stderr_lines(child.stderr)), child.wait()), 120)
    said = [(at, line) for at, line in lines if line.startswith("sled generate:")]
    text = "\n".join(line for _, line in lines)
    assert child.returncode == 4, text                      # as for a broken verdict
    (lost_at, lost), (_, back), (ended_at, ended) = said     # the retry, then the end
    assert "(it went silent)" in lost and "resumed after 1 token" in back, text
    assert ended == (f"sled generate: the verify server {address} went silent 2 times (the last: no "
                     f"verdict for round 1 within {VERDICT_S:g} s), so the request ends"), text
    # from the first silence on: one reopening and one more silence
    assert ended_at - lost_at < VERDICT_S + RECONNECT_S and verifier.opens == 2
    body = json.loads(out)                                   # what round 0 of each open committed
    start = len(tokenizer("def").input_ids)
    assert body["finish_reason"] == "server_silent" and len(body["token_ids"]) >= 2, body
    assert body["token_ids"] == list(range(start, start + len(body["token_ids"])))
    assert body["text"] == tokenizer.decode(body["token_ids"])


@pytest.mark.parametrize("given_up, finish_reason", [
    (ServerSilent(2, Silence("verdict for round 3", VERDICT_S), 2), SERVER_SILENT),
    (ServerGivenUp(2, VerifyError(grpc.StatusCode.UNAVAILABLE, "gone")), SERVER_FAILED)])
def test_sled_generate_keeps_the_committed_text_of_a_server_given_up(tokenizer, capsys, given_up,
                                                                     finish_reason):
    split = tokenizer("é").input_ids                         # a character in two byte tokens
    assert len(split) == 2 and tokenizer.decode(split[:1]) != "é"
    for json_output in (False, True):
        shown = generate.Shown(SimpleNamespace(json=json_output, server="gpu-1:50051"))
        shown.tokenizer, shown.session = tokenizer, Session([5, 6, split[0]])
        shown.stream([5, 6, split[0]])
        assert shown.given_up(given_up) == 4
        out, err = capsys.readouterr()
        if json_output:
            body = json.loads(out)
            assert body["finish_reason"] == finish_reason and body["token_ids"] == [5, 6, split[0]]
        else:                                       # the held-back byte too, then a newline
            assert out == tokenizer.decode([5, 6, split[0]]) + "\n"
        assert err == f"sled generate: {given_up.naming('gpu-1:50051')}\n"


# -- the daemon -----------------------------------------------------------------------------
def silent_device(addresses: list[str], tokenizer, device_id: str = "silent-test", **settings) -> Device:
    return Device(DeviceSettings(id=device_id, servers=addresses, drafter="ngram",
                                 verdict_timeout_s=VERDICT_S, reconnect_s=RECONNECT_S, **settings),
                  tokenizer=tokenizer)


async def health(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/health") as response:
            return response.status, await response.json()


async def test_the_daemon_answers_503_and_is_degraded_until_the_server_answers_again(
        servers, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(server_choice, "PROBE_S", 3600.0)     # no probe: it answers a request
    verifier = LyingVerifier("silent", lie_at=0, fingerprint=fingerprint_tokenizer(tokenizer))
    address = await servers(verifier)
    request = json.dumps({"model": "liar", "prompt": "x", "max_tokens": 6, "temperature": 0})
    async with running_api(silent_device([address], tokenizer)) as (_, url):
        assert (await health(url))[0] == 200
        started = time.perf_counter()
        status, _, body = await asyncio.wait_for(post(url, "/v1/completions", request), GIVE_UP_S)
        assert time.perf_counter() - started < BOUND_S
        assert status == 503 and verifier.opens == 2, body
        assert body["error"]["message"].startswith(f"the verify server {address} went silent 2 times")
        status, said = await health(url)
        assert status == 503 and said["state"] == "degraded" and address in said["reason"], said
        assert "no verdict for round 0" in said["servers"][0]["silent"]

        verifier.lie = ""                                    # it answers again
        status, _, body = await post(url, "/v1/completions", request)
        assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
        status, said = await health(url)
        assert status == 200 and said["state"] == "ready" and said["servers"][0]["silent"] == ""


async def test_the_daemon_answers_503_naming_a_server_that_drops_every_session(
        servers, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    verifier = LyingVerifier("evicted", lie_at=0, fingerprint=fingerprint_tokenizer(tokenizer))
    address = await servers(verifier)
    request = json.dumps({"model": "liar", "prompt": "x", "max_tokens": 6, "temperature": 0})
    async with running_api(silent_device([address], tokenizer)) as (_, url):
        status, _, body = await asyncio.wait_for(post(url, "/v1/completions", request), GIVE_UP_S)
        assert status == 503 and verifier.opens == 2, body
        assert body["error"]["message"] == (
            f"the verify server {address} dropped the session without a verdict 2 times (the "
            "last: ABORTED: the liar evicts every draft), so the request ends")


async def health_until(url: str, status: int) -> dict:
    """/health once it answers `status` (AssertionError when it has not within GIVE_UP_S)."""
    give_up = time.perf_counter() + GIVE_UP_S
    while (said := await health(url))[0] != status:
        assert time.perf_counter() < give_up, said
        await asyncio.sleep(0.05)
    return said[1]


async def test_a_probe_the_silent_server_answers_ends_degraded_without_a_request(
        servers, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(server_choice, "PROBE_S", 0.2)
    verifier = LyingVerifier("silent", lie_at=0, fingerprint=fingerprint_tokenizer(tokenizer))
    address = await servers(verifier)
    request = json.dumps({"model": "liar", "prompt": "x", "max_tokens": 6, "temperature": 0})
    async with running_api(silent_device([address], tokenizer)) as (_, url):
        status, _, body = await asyncio.wait_for(post(url, "/v1/completions", request), GIVE_UP_S)
        assert status == 503, body
        said = await health_until(url, 200)                  # no request reaches it meanwhile
        assert said["state"] == "ready" and "answered probes since" in said["reason"], said
        # it still comes after any server that did not go silent, until it sends a verdict
        assert "no verdict for round 0" in said["servers"][0]["silent"] and verifier.opens == 2


async def test_a_silent_server_is_failed_over_and_the_request_completes(servers, tokenizer, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    fingerprint = fingerprint_tokenizer(tokenizer)
    silent, honest = LyingVerifier("silent", lie_at=0, fingerprint=fingerprint), \
        LyingVerifier(fingerprint=fingerprint)
    silent_at, honest_at = await servers(silent), await servers(honest)
    device = silent_device([silent_at, honest_at], tokenizer)
    await device.start()
    try:
        device.directory.announce("busy-gpu", honest_at, load=0.9)   # the silent one comes first
        assert device.directory.pick().endpoint == silent_at
        tokens, finish, lossless = await asyncio.wait_for(
            device.complete(Request([5, 6, 7], max_tokens=8)), GIVE_UP_S)
        assert tokens == list(range(3, 11)) and finish == "length" and lossless
        assert (silent.opens, honest.opens) == (1, 1)
        assert device.state == "ready" and "busy-gpu" in device.reason, device.reason
        entries = {s["endpoint"]: s for s in device.status()["servers"]}
        assert entries[silent_at]["silent"] and not entries[honest_at]["silent"]
    finally:
        await device.close()


async def test_an_mqtt_request_to_a_silent_server_gets_an_error_response(
        servers, tokenizer, tmp_path, monkeypatch, mosquitto):  # noqa: F811
    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    verifier = LyingVerifier("silent", lie_at=0, fingerprint=fingerprint_tokenizer(tokenizer))
    address = await servers(verifier)
    device = silent_device([address], tokenizer, "dev-1", mqtt={
        "host": "127.0.0.1", "port": mosquitto.port, "keepalive_s": 2, "telemetry_s": 0.2})
    await device.start()
    try:
        async with connected_until_the_end(DeviceMqtt(device, backoff=quick_backoff())) as control, \
                Watcher(mosquitto.broker(), topic("responses/#"), topic("status")) as watcher:
            await eventually(lambda: control.connected, what="the MQTT connection")
            await watcher.publish(topic("requests"), json.dumps(
                {"request_id": "quiet", "prompt_ids": [5, 6, 7], "max_tokens": 6}))
            seen = await watcher.wait_for(topic("responses/quiet"), lambda m: "error" in m,
                                          timeout=GIVE_UP_S)
            assert seen.payload["kind"] == "unavailable" and seen.payload["request_id"] == "quiet"
            assert seen.payload["error"].startswith(f"the verify server {address} went silent 2 times")
            status = await watcher.wait_for(topic("status"), lambda m: m and m.get("state") == "degraded")
            assert address in status.payload["reason"]
    finally:
        await device.close()
    assert verifier.opens == 2


# -- the device's servers -------------------------------------------------------------------
@pytest.fixture
async def answering(servers):
    """answering(count) -> a directory of `count` honest servers, probed; closed after."""
    made = []

    async def directory(count: int) -> ServerDirectory:
        made.append(ServerDirectory([await servers(LyingVerifier()) for _ in range(count)]))
        await made[-1].probe_all()
        return made[-1]

    yield directory
    for each in made:
        await each.close()


async def test_a_silent_server_is_unheard_until_a_probe_and_comes_last_until_a_verdict(answering):
    directory = await answering(2)
    quiet, busy = directory.servers.values()
    busy.load = 0.9
    assert directory.pick() is quiet
    directory.silent(quiet, "no verdict for round 0 within 0.5 s")
    assert quiet.unheard and directory.pick() is busy
    await directory.probe(quiet)
    assert not quiet.unheard and quiet.silent and directory.pick() is busy
    directory.answered(quiet)
    assert not quiet.silent and directory.pick() is quiet


async def test_failover_passes_over_a_server_that_went_silent(answering):
    directory = await answering(3)
    lost, quiet, other = directory.servers.values()
    directory.silent(quiet, "no verdict for round 0 within 0.5 s")
    choice = ServerChoice(directory, DeviceState("silent-test"), DeviceSettings)
    assert choice.failover(lost) is other
    directory.silent(other, "no verdict for round 0 within 0.5 s")
    assert choice.failover(lost) is lost              # it may be restarting: the others went silent
    directory.silent(lost, "no verdict for round 0 within 0.5 s")
    assert choice.failover(lost) is not lost                # all silent: another than the lost one


def test_a_negative_silent_retries_is_refused():
    with pytest.raises(ValueError, match="silent_retries must be >= 0"):
        RoundSettings(silent_retries=-1)
    with pytest.raises(ValueError, match="silent_retries"):
        DeviceSettings(silent_retries=-1)
