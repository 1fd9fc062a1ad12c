"""ComposeFleet: the Fleet of a compose run, seen from inside the lab container.

`sled lab compose` has brought up broker, server and the device replicas; each replica took a
slot and wrote <state>/slots/<index>.json (lab.device_entry). This fleet waits for those files
and for every device's /health, reaches the server's metrics at http://server:9400/metrics (and
with server.replicas 2 replica 1's at http://server-1:9400/metrics, both behind the proxy) and
logs in to the broker as "lab" (and as "lab-config" to change settings). Fault steps kill, stop
and start the server and broker containers through the Docker Engine API on the mounted unix
socket (no docker CLI in the image); the containers are found by compose's labels (project and
service).
"""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import aiohttp

from lab.broker import CONFIG_USER, LAB_USER
from lab.device_entry import TRACES, wait_slot_files
from lab.fleet import DeviceHandle, FleetStartError
from lab.health import wait_health
from lab.scenario import DeviceSlot
from lab.waiting import wait_until
from sled.mqtt import Broker

SOCKET = "/var/run/docker.sock"
SERVER_HOST, SERVER_PORT, SERVER_METRICS_PORT = "server", 50051, 9400
BROKER_HOST, BROKER_PORT = "broker", 1883
READY_S = 300.0     # the devices load their drafters and find the server
RESTART_S = 180.0   # the server loads its target again


class ComposeFleet:
    mode = "compose"

    def __init__(self, scenario=None, folder: Path | None = None, *,
                 state: str | Path | None = None,
                 broker_files: str | Path | None = None, project: str | None = None) -> None:
        self.state = Path(state or os.environ.get("SLED_LAB_STATE", "/lab/state"))
        self.traces_dir = self.state / TRACES
        folder = Path(broker_files or os.environ.get("SLED_LAB_BROKER", "/lab/broker"))
        self.project = project or os.environ.get("COMPOSE_PROJECT_NAME", "sled")
        credentials = json.loads((folder / "credentials.json").read_text())
        self.broker = Broker(BROKER_HOST, BROKER_PORT, LAB_USER, credentials[LAB_USER])
        self.config_broker = Broker(BROKER_HOST, BROKER_PORT, CONFIG_USER,
                                    credentials[CONFIG_USER])
        replicas = scenario.server.replicas if scenario is not None else 1
        self.server_hosts = [SERVER_HOST] + [f"{SERVER_HOST}-{i}" for i in range(1, replicas)]
        self.server_metrics_urls = [f"http://{host}:{SERVER_METRICS_PORT}/metrics"
                                    for host in self.server_hosts]
        self.server_metrics_url = self.server_metrics_urls[0]
        self.devices: list[DeviceHandle] = []
        self._slot_files: dict[str, dict] = {}

    async def start(self, slots: list[DeviceSlot]) -> None:
        """Wait for each slot's device replica and its /health; the fleet is already up."""
        files = await self._wait_slot_files(len(slots))
        self._slot_files = {f["id"]: f for f in files}
        self.devices = []
        for slot in slots:
            info = self._slot_files.get(slot.id)
            if info is None:
                raise FleetStartError(f"no device container took slot {slot.id}")
            url = f"http://{info['host']}:{info['port']}"
            self.devices.append(DeviceHandle(slot, url, url + "/metrics"))
        await asyncio.gather(*(self._wait_ready(d) for d in self.devices))
        for host in self.server_hosts:
            await wait_port(host, SERVER_PORT, READY_S, f"the verify server ({host})")

    async def stop(self) -> None:
        """Nothing to tear down from inside: `sled lab compose` takes the project down."""

    async def kill_server(self, replica: int = 0) -> None:
        await self._engine(self.server_hosts[replica], "kill?signal=SIGKILL")

    async def start_server(self, replica: int = 0) -> None:
        host = self.server_hosts[replica]     # a replica's service and host name are one
        await self._engine(host, "start")
        await wait_port(host, SERVER_PORT, RESTART_S, f"the restarted verify server ({host})")

    async def stop_broker(self) -> None:
        await self._engine("broker", "stop?t=2")

    async def start_broker(self) -> None:
        await self._engine("broker", "start")
        await wait_port(BROKER_HOST, BROKER_PORT, 60.0, "the restarted broker")

    def link_emulation(self) -> dict[str, str]:
        return {device_id: info["link_emulation"] for device_id, info in self._slot_files.items()}

    def device_machines(self) -> dict[str, str]:
        """What each device container's platform.machine() said in its slot file."""
        return {device_id: info.get("machine", "unknown")
                for device_id, info in self._slot_files.items()}

    async def _wait_slot_files(self, count: int) -> list[dict]:
        try:
            return await asyncio.to_thread(wait_slot_files, self.state / "slots", count, READY_S)
        except TimeoutError as exc:
            raise FleetStartError(str(exc)) from None

    async def _wait_ready(self, device: DeviceHandle) -> None:
        """GET /health until 200 (the daemon answers 503 until its drafter and server are up)."""
        try:
            await wait_health(device.api_url, lambda health: health.code == 200,
                              f"device {device.id} was not ready", READY_S, interval_s=1.0,
                              request_timeout_s=5.0)
        except TimeoutError as exc:
            raise FleetStartError(f"{exc} ({device.api_url}/health)") from None

    async def _engine(self, service: str, action: str) -> None:
        """POST /containers/<id>/<action> for the service's container(s) of this project."""
        connector = aiohttp.UnixConnector(path=SOCKET)
        async with aiohttp.ClientSession(connector=connector) as docker:
            for container in await containers(docker, self.project, service):
                async with docker.post(f"http://docker/containers/{container}/{action}") as r:
                    if r.status >= 400 and r.status != 304:   # 304: already in that state
                        raise RuntimeError(f"docker {action} {service}: {r.status} "
                                           f"{(await r.text()).strip()}")


async def containers(docker: aiohttp.ClientSession, project: str, service: str) -> list[str]:
    """The ids of a compose service's containers, running or not."""
    labels = [f"com.docker.compose.project={project}", f"com.docker.compose.service={service}"]
    params = {"all": "1", "filters": json.dumps({"label": labels})}
    async with docker.get("http://docker/containers/json", params=params) as response:
        found = [c["Id"] for c in await response.json()]
    if not found:
        raise RuntimeError(f"no container of service {service} in compose project {project}")
    return found


async def wait_port(host: str, port: int, timeout_s: float, what: str) -> None:
    """Until host:port accepts a TCP connection."""
    async def accepts() -> bool | None:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 3)
        except (OSError, asyncio.TimeoutError):
            return None
        writer.close()
        return True
    try:
        await wait_until(accepts, timeout_s, f"{what} did not accept connections on {host}:{port}", 1.0)
    except TimeoutError as exc:
        raise FleetStartError(str(exc)) from None
