"""A server lost in the middle of `sled generate` (kill -9): the loss is said at once; a server
that comes back on the same address takes the session back (a drafting session or a server mode)
and the output is the uninterrupted run's, token for token; with none back in time the committed
tokens are kept (exit 5)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest

from conftest import SLED
from lab.server_process import free_port
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc
from test_terminal import PROMPT, TARGET, reference

MAX_NEW = 80
# The loss is said from the broken stream, not found by keepalive: well under the channel's 30 s
# keepalive ping (edge_client.security), with room for a loaded machine.
SAID_WITHIN_S = 15.0


class Served:
    """`sled serve` processes on one fixed port, started and killed as the test says."""

    def __init__(self) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.whole: tuple[list[int], str] | None = None   # the uninterrupted run: ids, text

    async def uninterrupted(self) -> tuple[list[int], str]:
        """The greedy run of the test's prompt with nothing lost (asked of the server once)."""
        if self.whole is None:
            self.whole = await reference(self, MAX_NEW)
        return self.whole

    async def start(self) -> None:
        self.proc = subprocess.Popen([*SLED, "serve", "--model", TARGET, "--port", str(self.port),
                                      "--metrics-port", str(self.metrics_port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        async with grpc.aio.insecure_channel(self.address) as channel:
            await pb_grpc.VerifierStub(channel).GetModelInfo(
                pb.GetModelInfoRequest(), wait_for_ready=True, timeout=240)

    def kill(self) -> None:
        """kill -9: no goodbye on any stream."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def emitted(self) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read()
        line = next(l for l in text.decode().splitlines() if l.startswith("sled_emitted_tokens_total "))
        return float(line.split()[1])


class Generation:
    """`sled generate` as a child process; its stdout and stderr are read as they come, each
    stderr line with the monotonic time it arrived."""

    def __init__(self, address: str, *flags: str, drafter: str = "ngram") -> None:
        self.proc = subprocess.Popen([*SLED, "generate", "--server", address, "--drafter", drafter,
                                      "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW), *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.stdout = b""
        self.lines: list[tuple[float, str]] = []
        self.readers = [threading.Thread(target=self._read_stdout, daemon=True),
                        threading.Thread(target=self._read_stderr, daemon=True)]
        for reader in self.readers:
            reader.start()

    def _read_stdout(self) -> None:
        while chunk := os.read(self.proc.stdout.fileno(), 65536):
            self.stdout += chunk

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.decode(errors="replace")))

    @property
    def stderr(self) -> str:
        return "".join(line for _, line in self.lines)

    def said(self, phrase: str) -> float | None:
        """When a stderr line with `phrase` arrived (None: not yet)."""
        return next((at for at, line in self.lines if phrase in line), None)

    async def until(self, done, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline and self.proc.poll() is None, self.stderr[-3000:]
            await asyncio.sleep(0.05)

    async def wait(self, timeout: float) -> int:
        code = await asyncio.to_thread(self.proc.wait, timeout)
        for reader in self.readers:
            reader.join(5)
        return code


@pytest.fixture(scope="module")
async def served():
    served = Served()
    yield served
    served.kill()


async def killed_and_back(served, run, text: str) -> None:
    """Kill the server under RUN: the loss is said at once; a server started again on its
    address takes the session back and the output is the uninterrupted run's TEXT."""
    served.kill()
    died = time.monotonic()
    await run.until(lambda: run.said("lost the server at"), 30)
    assert run.said("lost the server at") - died < SAID_WITHIN_S, run.stderr
    assert f"lost the server at {served.address} after" in run.stderr
    assert "waiting up to 300 s for it (or another) to resume" in run.stderr
    await served.start()
    code = await run.wait(240)
    assert code == 0, run.stderr[-3000:]
    assert "resumed after" in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stdout.decode() == text + "\n"      # the uninterrupted run's, token for token


@pytest.mark.slow
async def test_a_server_back_on_the_same_address_finishes_the_generation(served):
    await served.start()
    _, text = await served.uninterrupted()
    run = Generation(served.address, "--reconnect-s", "300")
    try:
        await run.until(lambda: b"The dragon" in run.stdout, 120)
        await killed_and_back(served, run, text)
    finally:
        run.proc.kill()


@pytest.mark.slow
async def test_a_server_mode_generation_resumes_on_a_server_back_on_the_same_address(served):
    """--drafter server: the server generates alone, and a lost one is waited for all the same;
    the output is the uninterrupted greedy run's, token for token."""
    if served.proc is None or served.proc.poll() is not None:
        await served.start()
    _, text = await served.uninterrupted()
    before = served.emitted()
    run = Generation(served.address, "--reconnect-s", "300", drafter="server")
    try:
        await run.until(lambda: served.emitted() >= before + 4, 120)
        await killed_and_back(served, run, text)
    finally:
        run.proc.kill()


@pytest.mark.slow
async def test_no_server_back_keeps_the_partial_output_and_exits_5(served):
    if served.proc is None or served.proc.poll() is not None:
        await served.start()
    token_ids, _ = await served.uninterrupted()
    before = served.emitted()
    run = Generation(served.address, "--reconnect-s", "2", "--json")
    try:
        await run.until(lambda: served.emitted() >= before + 8, 120)
        served.kill()
        died = time.monotonic()
        await run.until(lambda: run.said("lost the server at"), 30)
        assert run.said("lost the server at") - died < SAID_WITHIN_S, run.stderr
        code = await run.wait(60)
    finally:
        run.proc.kill()
    assert code == 5, run.stderr[-3000:]
    assert "did not come back" in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "server refused" not in run.stderr
    body = json.loads(run.stdout)
    assert body["finish_reason"] == "server_lost" and len(body["token_ids"]) >= 8
    assert f"{len(body['token_ids'])} tokens kept" in run.stderr
    # the kept tokens are the target's own: the first ones of the whole run
    assert body["token_ids"] == token_ids[:len(body["token_ids"])]


async def test_the_daemon_logs_the_lost_server_and_the_resume(models, drafter_models, tokenizer,
                                                              prompts, caplog):
    """One WARNING line when a request's server goes, one INFO line when a server on the same
    address takes the session back; the output stays the target's own."""
    from edge_client.daemon import Request
    from tests.conftest import greedy_reference
    from tests.test_device import make_device
    from verify_server.server import start_server
    from verify_server.settings import ServerSettings
    from verify_server.target import Target

    caplog.set_level(logging.INFO, logger="sled.device")
    target = Target.from_model(models["llama"], tokenizer, "tiny")
    settings, port = ServerSettings(kv_budget=64 << 20), free_port()
    running = [await start_server(target, settings, "127.0.0.1", port)]
    device = make_device([running[0].address], drafter_models["llama"], tokenizer, reconnect_s=30,
                         policy={"draft_len": 2})
    await device.start()
    tokens = []
    try:
        async for chunk in device.stream(Request(prompts[0], max_tokens=40, ignore_eos=True,
                                                 request_id="req-lost")):
            tokens.extend(chunk.token_ids)
            if len(running) == 1:      # after the first verdict: the server goes, then comes back
                await running[0].stop(grace=0)
                running.append(await start_server(target, settings, "127.0.0.1", port))
    finally:
        await device.close()
        await running[-1].stop(grace=0)
    assert tokens == greedy_reference(models["llama"], prompts[0], 40)
    lost = [r for r in caplog.records if "lost the verify server" in r.getMessage()]
    resumed = [r for r in caplog.records if "resumed on" in r.getMessage()]
    assert len(lost) == 1 and lost[0].levelno == logging.WARNING, caplog.text
    assert "req-lost" in lost[0].getMessage() and f"127.0.0.1:{port}" in lost[0].getMessage()
    assert len(resumed) == 1 and resumed[0].levelno == logging.INFO, caplog.text


class ServerGoesOnce:
    """Stream.open, keeping each session's Open: after the first verdict the server is stopped
    (no goodbye on any stream) and a new one starts on the same address `down_s` later."""

    def __init__(self, running: list, start, down_s: float) -> None:
        self.running, self.start, self.down_s = running, start, down_s
        self.opens: list[pb.Open] = []

    def transport(self, stub, **options):
        from edge_client.transport import Stream

        outer = self

        class Watched(Stream):
            async def send(self, msg):
                if msg.WhichOneof("kind") == "open":
                    outer.opens.append(msg.open)
                await super().send(msg)

            async def receive(self):
                msg = await super().receive()
                if msg.WhichOneof("kind") == "verdict" and len(outer.running) == 1:
                    await outer.running[0].stop(grace=0)
                    outer.running.append(asyncio.create_task(outer.restart()))
                return msg

        return Watched.open(stub, **options)

    async def restart(self):
        await asyncio.sleep(self.down_s)
        return await self.start()


@pytest.mark.parametrize("mode", [pb.GENERATION_MODE_SERVER, pb.GENERATION_MODE_SERVER_SAT])
async def test_a_server_mode_session_resumes_on_a_server_back_on_the_same_address(
        models, tokenizer, prompts, mode):
    """A server mode waits for a lost server as a drafting session does: said at once, reopened
    with the prompt + the committed tokens for the tokens left, the output the target's own."""
    from edge_client.result import LOST, RESUMED
    from edge_client.server_side import generate_server_side
    from edge_client.session import SessionHooks
    from edge_client.wire import SessionRequest
    from test_sdsat_serving import adapter_spec
    from tests.conftest import greedy_reference
    from verify_server.server import start_server
    from verify_server.settings import ServerSettings
    from verify_server.target import Target

    sat = adapter_spec(models["llama"]) if mode == pb.GENERATION_MODE_SERVER_SAT else None
    target = Target.from_model(models["llama"], tokenizer, "tiny", sat=sat)
    port, max_new = free_port(), 60

    async def start():
        return await start_server(target, ServerSettings(kv_budget=64 << 20), "127.0.0.1", port)

    running = [await start()]
    server, events, streamed = ServerGoesOnce(running, start, down_s=1.5), [], []
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        result = await generate_server_side(
            pb_grpc.VerifierStub(channel), SessionRequest(prompts[0], max_new, ignore_eos=True, mode=mode),
            transport=server.transport, reconnect_s=60,
            hooks=SessionHooks(on_tokens=streamed.extend, on_server=events.append))
    finally:
        await channel.close()
        last = running[-1]
        await (await last if isinstance(last, asyncio.Task) else last).stop(grace=0)
    assert result.token_ids == streamed == greedy_reference(models["llama"], prompts[0], max_new)
    assert result.resumes == 1 and [e.kind for e in events] == [LOST, RESUMED], events
    committed = events[0].committed
    assert 0 < committed < max_new
    resumed = server.opens[-1]
    assert list(resumed.prompt_ids) == prompts[0] + result.token_ids[:committed]
    assert resumed.max_new_tokens == max_new - committed and resumed.mode == mode
