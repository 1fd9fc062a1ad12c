"""A real Mosquitto broker for the MQTT tests, on a free loopback port, and a watcher that records
what is published. `make test` installs Mosquitto; without it these tests fail and say so."""
from __future__ import annotations

import asyncio
import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import aiomqtt
import pytest

from sled.mqtt import Broker
from sled.wire.topics import decode

CANDIDATES = ("mosquitto", "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")


def mosquitto_binary() -> str:
    for candidate in CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    pytest.fail("Mosquitto is not installed, and the MQTT tests need a real broker: `make test` "
                "installs it (Debian: apt-get install -y mosquitto)", pytrace=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Mosquitto:
    port: int
    process: subprocess.Popen
    log: Path
    users: dict[str, str]

    def broker(self, username: str = "", password: str = "", **options) -> Broker:
        options.setdefault("keepalive_s", 5)
        return Broker("127.0.0.1", self.port, username=username, password=password, **options)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(5)


def start_mosquitto(folder: Path, users: dict[str, str] | None = None, tls: bool = False) -> Mosquitto:
    """Write a config (anonymous, or a password file for `users`; TLS with a CA of its own at
    folder/ca.crt), start, wait until it listens."""
    binary, port = mosquitto_binary(), _free_port()
    lines = [f"listener {port} 127.0.0.1", "persistence false", f"log_dest file {folder / 'mosquitto.log'}",
             "log_type all"]
    if tls:
        make_certificates(folder)
        lines += [f"cafile {folder / 'ca.crt'}", f"certfile {folder / 'server.crt'}",
                  f"keyfile {folder / 'server.key'}"]
    if os.geteuid() == 0:
        lines.append(f"user {getpass.getuser()}")     # stay root: the files here are root's
    if users:
        passwords = folder / "passwords"
        for i, (user, password) in enumerate(users.items()):
            flags = ["-b", "-c"] if i == 0 else ["-b"]
            subprocess.run([shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd", *flags,
                            str(passwords), user, password], check=True, capture_output=True)
        lines += ["allow_anonymous false", f"password_file {passwords}"]
    else:
        lines.append("allow_anonymous true")
    config = folder / "mosquitto.conf"
    config.write_text("\n".join(lines) + "\n")
    process = subprocess.Popen([binary, "-c", str(config)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    broker = Mosquitto(port, process, folder / "mosquitto.log", dict(users or {}))
    _wait_listening(broker)
    return broker


def make_certificates(folder: Path) -> None:
    """A throwaway CA and a broker certificate for 127.0.0.1 signed by it (openssl)."""
    openssl = shutil.which("openssl") or pytest.fail("the TLS test needs the openssl command", pytrace=False)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=folder, check=True, capture_output=True)

    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "2", "-subj", "/CN=sled test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "san.ext")


def _wait_listening(broker: Mosquitto, timeout: float = 10.0) -> None:
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if broker.process.poll() is not None:
            err = broker.process.stderr.read().decode(errors="replace")
            pytest.fail(f"mosquitto exited with {broker.process.returncode}: {err}", pytrace=False)
        try:
            socket.create_connection(("127.0.0.1", broker.port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    broker.stop()
    pytest.fail(f"mosquitto did not listen on 127.0.0.1:{broker.port} within {timeout:g} s", pytrace=False)


@pytest.fixture
def mosquitto(tmp_path):
    broker = start_mosquitto(tmp_path)
    yield broker
    broker.stop()


@pytest.fixture
def mosquitto_with_passwords(tmp_path):
    broker = start_mosquitto(tmp_path, users={"device": "s3cret", "watcher": "w4tch"})
    yield broker
    broker.stop()


@pytest.fixture
def mosquitto_tls(tmp_path):
    broker = start_mosquitto(tmp_path, tls=True)
    yield broker
    broker.stop()


@dataclass
class Seen:
    topic: str
    payload: dict | None          # None: an empty payload
    retain: bool


class Watcher:
    """Subscribes to topic filters and keeps every message; `wait_for` finds the first one after
    a mark that matches a filter and a predicate.

        async with Watcher(broker, "sled/#") as watcher:
            status = await watcher.wait_for("sled/devices/d1/status", lambda m: m["online"])
    """

    def __init__(self, broker: Broker, *filters: str) -> None:
        self.client = broker.client(f"watcher-{id(self)}")
        self.filters = filters
        self.seen: list[Seen] = []
        self._arrived = asyncio.Condition()
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "Watcher":
        await self.client.__aenter__()
        await self.client.subscribe([(f, 1) for f in self.filters])
        self._task = asyncio.create_task(self._collect())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.client.__aexit__(None, None, None)

    async def _collect(self) -> None:
        async for message in self.client.messages:
            payload = _parse(message.payload)
            async with self._arrived:
                self.seen.append(Seen(message.topic.value, payload, bool(message.retain)))
                self._arrived.notify_all()

    def mark(self) -> int:
        return len(self.seen)

    async def publish(self, topic: str, payload: bytes | str, retain: bool = False) -> None:
        await self.client.publish(topic, payload, qos=1, retain=retain)

    async def wait_for(self, topic_filter: str, where=lambda payload: True, since: int = 0,
                       timeout: float = 15.0) -> Seen:
        def found() -> Seen | None:
            for seen in self.seen[since:]:
                if aiomqtt.Topic(seen.topic).matches(topic_filter) and where(seen.payload):
                    return seen
            return None

        async with self._arrived:
            try:
                await asyncio.wait_for(self._arrived.wait_for(lambda: found() is not None), timeout)
            except asyncio.TimeoutError:
                recent = [(s.topic, s.payload) for s in self.seen[since:]][-8:]
                raise AssertionError(f"nothing on {topic_filter} matched within {timeout:g} s; "
                                     f"last seen: {recent}") from None
            return found()


def _parse(payload) -> dict | None:
    if not payload:
        return None
    try:
        return decode(payload)
    except ValueError:
        return {"raw": bytes(payload).decode(errors="replace")}   # what the tests sent as garbage


async def eventually(check, timeout: float = 15.0, what: str = "the condition") -> None:
    """Poll `check()` until true (device state that follows MQTT messages asynchronously)."""
    give_up = time.monotonic() + timeout
    while not check():
        if time.monotonic() > give_up:
            raise AssertionError(f"{what} did not hold within {timeout:g} s")
        await asyncio.sleep(0.05)
