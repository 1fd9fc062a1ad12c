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
import sys
from dataclasses import replace
from pathlib import Path

import grpc

from lab.broker import CONFIG_USER, LAB_USER, SERVER_USER, BrokerFiles, Listener
from lab.fleet import DeviceHandle, FleetStartError
from lab.health import wait_health
from lab.scenario import DeviceSlot
from lab.server_process import HOST, Child, free_port, serve_command, wait_for, wait_serving
from lab.traces.calibrated import trace_spec
from sled.mqtt import Broker
from sled.v1 import verifier_pb2_grpc as pb_grpc

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
        listener = Listener(port=self.broker_port, bind=HOST,
                            run_as=getpass.getuser() if os.geteuid() == 0 else None,
                            log=str(self.folder / "logs" / "mosquitto.log"))
        self.files = BrokerFiles.write(self.folder / "broker", slots, self.prefix, listener)
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
        return serve_command(self.target, self.server_port, self.metrics_port,
                             "--mqtt-host", HOST, "--mqtt-port", str(self.broker_port),
                             "--mqtt-username", SERVER_USER,     # its password: SLED_MQTT_PASSWORD
                             "--mqtt-topic-prefix", self.prefix, "--server-id", self.files.server_id,
                             "--announce-endpoint", f"{HOST}:{self.server_port}", *self.server_args)

    async def kill_server(self) -> None:
        await self._server.kill(signal.SIGKILL)

    async def start_server(self) -> None:
        self._refuse_after_stop()
        self._server.start()
        address = f"{HOST}:{self.server_port}"
        async with grpc.aio.insecure_channel(address) as channel:
            await wait_serving(self._server, pb_grpc.VerifierStub(channel), address,
                               self.startup_timeout_s)

    # -- the broker ---------------------------------------------------------------------------

    async def stop_broker(self) -> None:
        await self._broker.kill(signal.SIGTERM)

    async def start_broker(self) -> None:
        self._refuse_after_stop()
        self._broker.start()

        async def listens() -> bool | None:
            self._broker.started_or_fail()
            try:
                socket.create_connection((HOST, self.broker_port), timeout=0.5).close()
            except OSError:
                return None
            return True
        await wait_for(listens, BROKER_START_S,
                         f"mosquitto did not listen on {HOST}:{self.broker_port}", 0.05)

    # -- the devices --------------------------------------------------------------------------

    def _device_child(self, slot: DeviceSlot) -> tuple[DeviceHandle, Child]:
        port = free_port()
        handle = DeviceHandle(slot, f"http://{HOST}:{port}", f"http://{HOST}:{port}/metrics")
        env = {**os.environ, **self._device_env(slot, port)}
        return handle, Child(f"device {slot.id}", [sys.executable, "-m", "sled_cli.main", "device"],
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

        def api_url() -> str:
            nonlocal rebinds
            child = self._devices[index]
            if not child.alive() and PORT_TAKEN in child.tail() and rebinds < REBINDS:
                self.devices[index], self._devices[index] = self._device_child(slot)
                self._devices[index].start()
                rebinds += 1
            self._devices[index].started_or_fail()
            return self.devices[index].api_url
        try:
            await wait_health(api_url, lambda health: health.ready,
                              f"device {slot.id} was not ready", self.startup_timeout_s, 0.5)
        except TimeoutError as exc:
            raise FleetStartError(f"{exc}: {self._devices[index].tail()}") from None
