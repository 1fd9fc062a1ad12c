"""Child processes of the demo, the benchmarks and the lab: one process with its log file
(Child), and a `sled serve` child on free loopback ports, started and waited for in one way
(serve_command, wait_serving; ServerProcess for `async with`)."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import grpc

from lab.fleet import FleetStartError
from lab.waiting import wait_until
from sled.printable import printable
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def background_priority() -> None:
    """This process runs only when nothing else wants a core (Linux SCHED_IDLE; elsewhere the
    lowest nice)."""
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)


class Child:
    """One child process writing to its log file (a file, never a pipe the child could fill and
    block on); start() again reuses the same command line."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict[str, str] | None = None,
                 background: bool = False):
        self.name, self.args, self.log, self.env = name, args, Path(log), env
        self.background = background
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         preexec_fn=background_priority if self.background else None)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, chars: int = 600) -> str:
        """The end of its log on one line (for a crash report)."""
        try:
            text = self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""
        return printable(" | ".join(line for line in text.splitlines() if line.strip())[-chars:],
                         chars)

    def started_or_fail(self) -> None:
        """FleetStartError with the end of its log when it died while starting."""
        if not self.alive():
            raise FleetStartError(f"{self.name} exited at start: {self.tail()}")

    async def kill(self, sig: int = signal.SIGKILL, grace_s: float = 5.0) -> None:
        """Send `sig`, wait; SIGKILL whatever is still there after grace_s."""
        if not self.alive():
            return
        self.proc.send_signal(sig)
        try:
            await asyncio.to_thread(self.proc.wait, grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait, 5)


async def wait_for(check, timeout_s: float, what: str, interval_s: float,
                   log: Child | None = None):
    """lab.waiting.wait_until, its timeout a FleetStartError (with the end of LOG's log)."""
    try:
        return await wait_until(check, timeout_s, what, interval_s)
    except TimeoutError as exc:
        raise FleetStartError(f"{exc}: {log.tail()}" if log else str(exc)) from None


async def wait_listening(child: Child, port: int, timeout_s: float) -> None:
    """Until CHILD accepts TCP connections on loopback PORT; FleetStartError with the end of its
    log if it exits first or does not listen in time."""
    async def listens() -> bool | None:
        child.started_or_fail()
        try:
            socket.create_connection((HOST, port), timeout=0.5).close()
        except OSError:
            return None
        return True
    await wait_for(listens, timeout_s, f"{child.name} did not listen on {HOST}:{port}", 0.05,
                   child)


def serve_command(model: str, port: int, metrics_port: int, *extra: str) -> list[str]:
    """The `sled serve` command line of a child on loopback `port`."""
    return [sys.executable, "-m", "sled_cli.main", "serve", "--model", model, "--host", HOST,
            "--port", str(port), "--metrics-port", str(metrics_port), *extra]


# What a server that is still starting answers; any other status is the server's answer.
NOT_YET = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def wait_serving(child: Child, stub, address: str, timeout_s: float) -> None:
    """Until the `sled serve` CHILD answers GetModelInfo through STUB at ADDRESS; FleetStartError
    with the end of its log if it exits first or does not answer in time, and at once with the
    server's status if it refuses (a wrong token or certificate)."""
    async def answers() -> bool | None:
        child.started_or_fail()
        try:
            await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in NOT_YET:
                return None
            raise FleetStartError(f"{child.name} on {address} refused: {exc.code().name}: "
                                  f"{exc.details()}") from None
        return True
    await wait_for(answers, timeout_s, f"{child.name} did not answer on {address}", 0.3, child)


class ServerProcess:
    """`async with ServerProcess(model) as server:` a ready server at server.address."""

    def __init__(self, model: str, *extra: str, startup_timeout: float = 300.0,
                 security=None) -> None:
        """extra: more `sled serve` flags; security (edge_client.security.ChannelSecurity): how
        to reach a server started with TLS or device tokens."""
        self.security = security
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"{HOST}:{self.port}"
        self.args = serve_command(model, self.port, self.metrics_port, *extra)
        self.startup_timeout = startup_timeout
        self.folder: tempfile.TemporaryDirectory | None = None
        self.child: Child | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.child.proc if self.child else None

    async def __aenter__(self) -> "ServerProcess":
        self.folder = tempfile.TemporaryDirectory(prefix="sled-serve-")
        self.child = Child("sled serve", self.args, Path(self.folder.name) / "server.log")
        self.child.start()
        try:
            async with self._channel() as channel:
                stub = self.security.stub(channel) if self.security else pb_grpc.VerifierStub(channel)
                await wait_serving(self.child, stub, self.address, self.startup_timeout)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    def _channel(self) -> grpc.aio.Channel:
        if self.security is None:
            return grpc.aio.insecure_channel(self.address)
        return self.security.channel(self.address)

    async def __aexit__(self, *exc) -> None:
        if self.child is not None:
            await self.child.kill(signal.SIGTERM, grace_s=10)
        if self.folder is not None:
            self.folder.cleanup()
            self.folder = None

    def metric(self, name: str) -> float:
        """One unlabelled sample from the server's /metrics, e.g. sled_forward_passes_total."""
        text = urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=5).read()
        for line in text.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)
