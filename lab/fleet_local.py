"""LocalFleet: the scenario's fleet as processes on this machine: a Mosquitto with the lab's
broker files, a real `sled serve` announcing itself over MQTT, and one `sled device` per slot,
each with its device and link profile emulated in the daemon (user-space links: no netem here).
With server.replicas > 1, that many `sled serve` replicas behind one HAProxy (lab.proxy): the
devices dial the proxy, and every replica announces the proxy's address under its own id.

Every process logs to a file under the run folder; stop() ends them all, also after a failed
start and on Ctrl-C (the runner calls it in a finally).
"""
from __future__ import annotations

import asyncio
import getpass
import json
import os
import platform
import shutil
import signal
import sys
from dataclasses import replace
from pathlib import Path

import grpc

from lab.broker import CONFIG_USER, LAB_USER, BrokerFiles, Listener, replica_login
from lab.fleet import DeviceHandle, FleetStartError
from lab.health import wait_health
from lab.proxy import ProxyProcess
from lab.scenario import DeviceSlot
from lab.server_process import (HOST, Child, free_port, serve_command, wait_listening,
                                wait_serving)
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
                 devices_in_background: bool = False, replicas: int = 1) -> None:
        self.target, self.folder, self.prefix = target, Path(folder), prefix
        self.devices_in_background = devices_in_background
        self.server_args = list(server_args)
        self.startup_timeout_s = startup_timeout_s
        self.broker_port = free_port()
        self.server_ports = [free_port() for _ in range(replicas)]
        self.metrics_ports = [free_port() for _ in range(replicas)]
        self.server_metrics_urls = [f"http://{HOST}:{port}/metrics" for port in self.metrics_ports]
        self.server_metrics_url = self.server_metrics_urls[0]
        # what the devices dial and the servers announce: the one server, or the proxy
        self.server_port = self.server_ports[0] if replicas == 1 else free_port()
        self.traces_dir = self.folder / "traces"
        self.devices: list[DeviceHandle] = []
        self.files: BrokerFiles | None = None
        self.broker: Broker | None = None
        self.config_broker: Broker | None = None
        self._broker: Child | None = None
        self._servers: list[Child] = []
        self._proxy: ProxyProcess | None = None
        self._devices: list[Child] = []
        self._stopped = False

    # -- the whole fleet -------------------------------------------------------------------

    async def start(self, slots: list[DeviceSlot]) -> None:
        (self.folder / "logs").mkdir(parents=True, exist_ok=True)
        listener = Listener(port=self.broker_port, bind=HOST,
                            run_as=getpass.getuser() if os.geteuid() == 0 else None,
                            log=str(self.folder / "logs" / "mosquitto.log"))
        self.files = BrokerFiles.write(self.folder / "broker", slots, self.prefix, listener,
                                       replicas=len(self.server_ports))
        self.broker = Broker(HOST, self.broker_port, username=LAB_USER,
                             password=self.files.password(LAB_USER), keepalive_s=5)
        self.config_broker = replace(self.broker, username=CONFIG_USER,
                                     password=self.files.password(CONFIG_USER))
        self._broker = Child("mosquitto", [mosquitto_binary(), "-c", str(self.files.conf)],
                             self.folder / "logs" / "mosquitto.out")
        self._servers = [self._server_child(i) for i in range(len(self.server_ports))]
        await self.start_broker()
        await asyncio.gather(*(self.start_server(i) for i in range(len(self._servers))))
        if len(self._servers) > 1:
            self._proxy = ProxyProcess([f"{HOST}:{port}" for port in self.server_ports],
                                       self.folder / "logs" / "proxy", port=self.server_port)
            await self._proxy.start()
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
        if self._proxy is not None:
            await self._proxy.stop()
        for child in (*self._servers, self._broker):
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

    def device_machines(self) -> dict[str, str]:
        return {handle.id: platform.machine() for handle in self.devices}

    # -- the server ---------------------------------------------------------------------------

    def _server_child(self, index: int) -> Child:
        """Replica INDEX (the one server when there is one), announcing what devices dial."""
        user, server_id = replica_login(index, self.files.server_id)
        log = "server.log" if len(self.server_ports) == 1 else f"server-{index}.log"
        args = serve_command(self.target, self.server_ports[index], self.metrics_ports[index],
                             "--mqtt-host", HOST, "--mqtt-port", str(self.broker_port),
                             "--mqtt-username", user,     # its password: SLED_MQTT_PASSWORD
                             "--mqtt-topic-prefix", self.prefix, "--server-id", server_id,
                             "--announce-endpoint", f"{HOST}:{self.server_port}",
                             *self.server_args)
        name = "sled serve" if len(self.server_ports) == 1 else f"sled serve (replica {index})"
        return Child(name, args, self.folder / "logs" / log,
                     {**os.environ, "SLED_MQTT_PASSWORD": self.files.password(user)})

    async def kill_server(self, replica: int = 0) -> None:
        await self._servers[replica].kill(signal.SIGKILL)

    async def start_server(self, replica: int = 0) -> None:
        self._refuse_after_stop()
        child = self._servers[replica]
        child.start()
        address = f"{HOST}:{self.server_ports[replica]}"
        async with grpc.aio.insecure_channel(address) as channel:
            await wait_serving(child, pb_grpc.VerifierStub(channel), address,
                               self.startup_timeout_s)

    # -- the broker ---------------------------------------------------------------------------

    async def stop_broker(self) -> None:
        await self._broker.kill(signal.SIGTERM)

    async def start_broker(self) -> None:
        self._refuse_after_stop()
        self._broker.start()
        await wait_listening(self._broker, self.broker_port, BROKER_START_S)

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
