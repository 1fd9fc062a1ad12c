"""Child processes for the demo and benchmarks: a `sled serve` on a free loopback port."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import urllib.request
from collections import deque

import grpc

from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerLog:
    """The server child's stderr, read as it comes: its log lines would otherwise fill the pipe
    and block the server on its next one. The last lines are kept for a crash report."""

    def __init__(self, stream, keep: int = 12) -> None:
        self.lines: deque[str] = deque(maxlen=keep)
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in iter(stream.readline, b""):
            self.lines.append(line.decode(errors="replace").rstrip())

    def tail(self) -> str:
        from sled.printable import printable

        return printable(" | ".join(self.lines), 2000)


class ServerProcess:
    """`async with ServerProcess(model) as server:` a ready server at server.address."""

    def __init__(self, model: str, *extra: str, startup_timeout: float = 300.0,
                 security=None) -> None:
        """extra: more `sled serve` flags; security (edge_client.security.ChannelSecurity): how
        to reach a server started with TLS or device tokens."""
        self.security = security
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "sled_cli.main", "serve", "--model", model,
                     "--port", str(self.port), "--metrics-port", str(self.metrics_port), *extra]
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log: ServerLog | None = None     # its stderr, read as it comes

    async def __aenter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.log = ServerLog(self.proc.stderr)
        async with self._channel() as channel:
            stub = self.security.stub(channel) if self.security else pb_grpc.VerifierStub(channel)
            try:
                await stub.GetModelInfo(pb.GetModelInfoRequest(), wait_for_ready=True,
                                        timeout=self.startup_timeout)
            except grpc.aio.AioRpcError:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
                await asyncio.sleep(0.1)          # the reader takes the last lines
                raise RuntimeError(f"sled serve did not start: {self.log.tail()}") from None
        return self

    def _channel(self) -> grpc.aio.Channel:
        if self.security is None:
            return grpc.aio.insecure_channel(self.address)
        return self.security.channel(self.address)

    async def __aexit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def metric(self, name: str) -> float:
        """One unlabelled sample from the server's /metrics, e.g. sled_forward_passes_total."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read()
        for line in text.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)
