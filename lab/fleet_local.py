"""LocalFleet: the scenario's fleet as processes on this machine: a Mosquitto with the lab's
broker files, a real `sled serve` announcing itself over MQTT, and one `sled device` per slot,
each with its device and link profile emulated in the daemon (user-space links: no netem here).

Every process logs to a file under the run folder; stop() ends them all, also after a failed
start and on Ctrl-C (the runner calls it in a finally).
"""
from __future__ import annotations

import asyncio
import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import aiohttp
import grpc

from lab.broker import CONFIG_USER, LAB_USER, SERVER_USER, BrokerFiles
from lab.fleet import DeviceHandle, FleetStartError
from lab.scenario import DeviceSlot
from lab.server_process import free_port
from lab.traces.calibrated import trace_spec
from lab.waiting import wait_until
from sled.mqtt import Broker
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc

HOST = "127.0.0.1"
# A free port is closed again before its device binds it; in a large fleet another process's
# outgoing connection sometimes takes it first. That device starts again on another port.
PORT_TAKEN = "address already in use"
REBINDS = 3
BROKER_START_S = 15.0
MOSQUITTO = ("mosquitto", "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")


def mosquitto_binary() -> str:
    for candidate in MOSQUITTO:
        if shutil.which(candidate):
            return shutil.which(candidate)
    raise FleetStartError("Mosquitto is not installed (Debian: apt-get install mosquitto)")


def background_priority() -> None:
    """This process runs only when nothing else wants a core (Linux SCHED_IDLE; elsewhere the
    lowest nice)."""
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)


class Child:
    """One child process with its log file; start() again reuses the same command line."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict[str, str] | None = None,
                 background: bool = False):
        self.name, self.args, self.log, self.env = name, args, log, env
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
        try:
            text = self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""
        return " | ".join(line for line in text.splitlines() if line.strip())[-chars:]

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


class LocalFleet:
    mode = "local"

    def __init__(self, target: str, folder: Path, *, server_args: list[str] = (),
                 prefix: str = "sled", startup_timeout_s: float = 300.0,
                 devices_in_background: bool = False) -> None:
        self.target, self.folder, self.prefix = target, Path(folder), prefix
        self.devices_in_background = devices_in_background
        self.server_args = list(server_args)
        self.startup_timeout_s = startup_timeout_s
        self.broker_port, self.server_port, self.metrics_port = free_port(), free_port(), free_port()
        self.server_metrics_url = f"http://{HOST}:{self.metrics_port}/metrics"
        self.traces_dir = self.folder / "traces"
        self.devices: list[DeviceHandle] = []
        self.files: BrokerFiles | None = None
        self.broker: Broker | None = None
        self.config_broker: Broker | None = None
        self._broker: Child | None = None
        self._server: Child | None = None
        self._devices: list[Child] = []
        self._stopped = False

    # -- the whole fleet -------------------------------------------------------------------

    async def start(self, slots: list[DeviceSlot]) -> None:
        (self.folder / "logs").mkdir(parents=True, exist_ok=True)
        self.files = BrokerFiles.write(self.folder / "broker", slots, self.prefix,
                                       port=self.broker_port, bind=HOST,
                                       run_as=getpass.getuser() if os.geteuid() == 0 else None,
                                       log=str(self.folder / "logs" / "mosquitto.log"))
        self.broker = Broker(HOST, self.broker_port, username=LAB_USER,
                             password=self.files.password(LAB_USER), keepalive_s=5)
        self.config_broker = replace(self.broker, username=CONFIG_USER,
                                     password=self.files.password(CONFIG_USER))
        self._broker = Child("mosquitto", [mosquitto_binary(), "-c", str(self.files.conf)],
                             self.folder / "logs" / "mosquitto.out")
        self._server = Child("sled serve", self._server_args(), self.folder / "logs" / "server.log",
                             {**os.environ, "SLED_MQTT_PASSWORD": self.files.password(SERVER_USER)})
        await self.start_broker()
        await self.start_server()
        for slot in slots:
            handle, child = self._device_child(slot)
            self.devices.append(handle)
            self._devices.append(child)
        for child in self._devices:
            child.start()
        await asyncio.gather(*(self._wait_device(i) for i in range(len(slots))))

    async def stop(self) -> None:
        """Devices first (a clean MQTT goodbye), then the server and the broker."""
        await asyncio.gather(*(child.kill(signal.SIGTERM) for child in self._devices),
                             return_exceptions=True)
        for child in (self._server, self._broker):
            if child is not None:
                await child.kill(signal.SIGTERM)
        self._stopped = True
        if self.files is not None:
            self.files.forget_passwords()     # the run's folder keeps no broker password

    def _refuse_after_stop(self) -> None:
        if self._stopped:
            raise FleetStartError("the fleet was stopped; nothing starts again after stop()")

    def link_emulation(self) -> dict[str, str]:
        return {handle.id: "user-space" for handle in self.devices}

    # -- the server ---------------------------------------------------------------------------

    def _server_args(self) -> list[str]:
        return [sys.executable, "-m", "sled_cli.main", "serve", "--model", self.target,
                "--host", HOST, "--port", str(self.server_port),
                "--metrics-port", str(self.metrics_port),
                "--mqtt-host", HOST, "--mqtt-port", str(self.broker_port),
                "--mqtt-username", SERVER_USER,     # the password travels in SLED_MQTT_PASSWORD
                "--mqtt-topic-prefix", self.prefix, "--server-id", self.files.server_id,
                "--announce-endpoint", f"{HOST}:{self.server_port}", *self.server_args]

    async def kill_server(self) -> None:
        await self._server.kill(signal.SIGKILL)

    async def start_server(self) -> None:
        self._refuse_after_stop()
        self._server.start()
        address = f"{HOST}:{self.server_port}"
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.VerifierStub(channel)

            async def answers() -> bool | None:
                self._started_or_fail(self._server, "sled serve")
                try:
                    await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=2.0)
                except grpc.aio.AioRpcError:
                    return None
                return True
            await self._wait(answers, self.startup_timeout_s,
                             f"sled serve did not answer on {address}", 0.3)

    # -- the broker ---------------------------------------------------------------------------

    async def stop_broker(self) -> None:
        await self._broker.kill(signal.SIGTERM)

    async def start_broker(self) -> None:
        self._refuse_after_stop()
        self._broker.start()

        async def listens() -> bool | None:
            self._started_or_fail(self._broker, "mosquitto")
            try:
                socket.create_connection((HOST, self.broker_port), timeout=0.5).close()
            except OSError:
                return None
            return True
        await self._wait(listens, BROKER_START_S,
                         f"mosquitto did not listen on {HOST}:{self.broker_port}", 0.05)

    @staticmethod
    def _started_or_fail(child: Child, what: str) -> None:
        """FleetStartError with the end of its log when CHILD died while starting."""
        if not child.alive():
            raise FleetStartError(f"{what} exited at start: {child.tail()}")

    @staticmethod
    async def _wait(check, timeout_s: float, what: str, interval_s: float, log: Child | None = None):
        """lab.waiting.wait_until, its timeout a FleetStartError (with the end of LOG's log)."""
        try:
            return await wait_until(check, timeout_s, what, interval_s)
        except TimeoutError as exc:
            raise FleetStartError(f"{exc}: {log.tail()}" if log else str(exc)) from None

    # -- the devices --------------------------------------------------------------------------

    def _device_child(self, slot: DeviceSlot) -> tuple[DeviceHandle, Child]:
        port = free_port()
        handle = DeviceHandle(slot, f"http://{HOST}:{port}", f"http://{HOST}:{port}/metrics")
        env = {**os.environ, **self._device_env(slot, port)}
        return handle, Child(slot.id, [sys.executable, "-m", "sled_cli.main", "device"],
                             self.folder / "logs" / f"{slot.id}.log", env,
                             self.devices_in_background)

    def _device_env(self, slot: DeviceSlot, port: int) -> dict[str, str]:
        return {"SLED_DEVICE_ID": slot.id,
                "SLED_DEVICE_DRAFTER": trace_spec(slot.drafter, self.traces_dir),
                "SLED_DEVICE_HOST": HOST, "SLED_DEVICE_PORT": str(port),
                "SLED_DEVICE_SERVERS": json.dumps([f"{HOST}:{self.server_port}"]),
                "SLED_DEVICE_MQTT__HOST": HOST, "SLED_DEVICE_MQTT__PORT": str(self.broker_port),
                "SLED_DEVICE_MQTT__USERNAME": slot.id,
                "SLED_DEVICE_MQTT__PASSWORD": self.files.password(slot.id),
                "SLED_DEVICE_MQTT__TOPIC_PREFIX": self.prefix,
                "SLED_DEVICE_MQTT__TELEMETRY_S": "2",
                "SLED_DEVICE_EMULATION__DEVICE": slot.device,
                "SLED_DEVICE_EMULATION__LINK": slot.link}

    async def _wait_device(self, index: int) -> None:
        """Until device INDEX's /health says ready (200) and its MQTT link is up. A device whose
        free port another process took before it could bind it starts again on another one."""
        slot, rebinds = self.devices[index].slot, 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
            async def ready() -> bool | None:
                nonlocal rebinds
                child = self._devices[index]
                if not child.alive() and PORT_TAKEN in child.tail() and rebinds < REBINDS:
                    self.devices[index], self._devices[index] = self._device_child(slot)
                    self._devices[index].start()
                    rebinds += 1
                self._started_or_fail(self._devices[index], f"device {slot.id}")
                return True if await _ready(http, self.devices[index].api_url + "/health") else None
            await self._wait(ready, self.startup_timeout_s, f"device {slot.id} was not ready",
                             0.5, self._devices[index])


async def _ready(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(url) as response:
            if response.status != 200:
                return False
            status = await response.json()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return False
    mqtt = status.get("mqtt") or {}
    return status.get("state") == "ready" and mqtt.get("connected", True) is not False
