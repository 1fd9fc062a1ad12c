"""Child processes for the demo and benchmarks: a `sled serve` on a free loopback port."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import urllib.request

import grpc

from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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

    async def __aenter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        async with self._channel() as channel:
            stub = self.security.stub(channel) if self.security else pb_grpc.VerifierStub(channel)
            try:
                await stub.GetModelInfo(pb.GetModelInfoRequest(), wait_for_ready=True,
                                        timeout=self.startup_timeout)
            except grpc.aio.AioRpcError:
                self.proc.kill()
                err = self.proc.stderr.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"sled serve did not start: {err}") from None
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
