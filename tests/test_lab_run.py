"""`sled lab run`: the broker's ACL really confines devices (a real Mosquitto), a bad scenario is
one line and exit 2, and the smoke scenario runs end to end, fault steps included, with every
greedy output equal to the target's and no token lost or duplicated."""
from __future__ import annotations

import asyncio
import getpass
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import aiomqtt
import pytest
import yaml

from lab.broker import BrokerFiles, Listener
from lab.scenario import DeviceSlot
from lab.server_process import free_port
from sled.mqtt import Broker
from tests.mqtt_broker import Mosquitto, _wait_listening, mosquitto_binary

ROOT = Path(__file__).resolve().parents[1]
SLOTS = [DeviceSlot(i, f"dev-0{i}", "pi5", "wifi", "ngram", 0) for i in range(2)]


@pytest.fixture
def lab_broker(tmp_path):
    port = free_port()
    files = BrokerFiles.write(tmp_path / "broker", SLOTS, "sled", Listener(
        port=port, bind="127.0.0.1", run_as=getpass.getuser() if os.geteuid() == 0 else None,
        log=str(tmp_path / "mosquitto.log")))
    process = subprocess.Popen([mosquitto_binary(), "-c", str(files.conf)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    broker = Mosquitto(port, process, tmp_path / "mosquitto.log", files.credentials)
    _wait_listening(broker)
    yield files, port
    broker.stop()


def login(files: BrokerFiles, port: int, user: str, password: str | None = None) -> aiomqtt.Client:
    broker = Broker("127.0.0.1", port, username=user,
                    password=files.password(user) if password is None else password)
    return broker.client(f"acl-test-{user}")


async def collect(client: aiomqtt.Client, seen: list, until: tuple[str, bytes]) -> None:
    """Every message until `until` (a marker its publisher sent last, so nothing before it is
    still on the way)."""
    async for message in client.messages:
        seen.append((message.topic.value, bytes(message.payload)))
        if seen[-1] == until:
            return


def test_broker_files(lab_broker):
    files, _ = lab_broker
    assert stat.S_IMODE((files.folder / "credentials.json").stat().st_mode) == 0o600
    assert set(json.loads((files.folder / "credentials.json").read_text())) == \
        {"dev-00", "dev-01", "server", "lab", "lab-config"}
    conf = files.conf.read_text()
    assert "allow_anonymous false" in conf and f"acl_file {files.folder.resolve()}/acl" in conf
    container = BrokerFiles.write(files.folder.parent / "c", SLOTS, "sled",
                                  Listener(root="/mosquitto/config"))
    assert "password_file /mosquitto/config/passwords" in container.conf.read_text()


async def test_the_acl_confines_devices_and_the_server(lab_broker):
    files, port = lab_broker
    lab_seen, dev_seen = [], []
    async with login(files, port, "lab") as lab, login(files, port, "dev-00") as dev, \
            login(files, port, "server") as server:
        await lab.subscribe("sled/#", qos=1)
        await dev.subscribe([("sled/devices/dev-01/requests", 1), ("sled/devices/dev-00/requests", 1),
                             ("sled/servers/#", 1), ("sled/devices/dev-01/config", 1)])
        # a device: not another device's topics, not a server's, not its own requests
        for topic in ("sled/devices/dev-01/status", "sled/devices/dev-01/responses/r1",
                      "sled/servers/evil", "sled/devices/dev-00/requests"):
            await dev.publish(topic, b"forbidden", qos=1)
        await dev.publish("sled/devices/dev-00/status", b"mine", qos=1)
        # the server: only its announcement
        for topic in ("sled/servers/other", "sled/devices/dev-00/requests", "sled/devices/dev-00/config"):
            await server.publish(topic, b"forbidden", qos=1)
        await server.publish(f"sled/servers/{files.server_id}", b"announced", qos=1)
        # the lab: every device's requests and config
        await lab.publish("sled/devices/dev-01/requests", b"for dev-01", qos=1)
        await lab.publish("sled/devices/dev-01/config", b"for dev-01", qos=1)
        await lab.publish("sled/devices/dev-00/requests", b"for dev-00", qos=1)
        await asyncio.wait_for(collect(dev, dev_seen, ("sled/devices/dev-00/requests", b"for dev-00")), 10)
        await asyncio.wait_for(collect(lab, lab_seen, ("sled/devices/dev-00/requests", b"for dev-00")), 10)
    assert not [m for m in lab_seen if m[1] == b"forbidden"], lab_seen
    assert ("sled/devices/dev-00/status", b"mine") in lab_seen
    assert ("sled/servers/lab-server", b"announced") in lab_seen
    assert ("sled/servers/lab-server", b"announced") in dev_seen      # devices read announcements
    assert not [m for m in dev_seen if "dev-01" in m[0]], dev_seen    # nor another's requests


async def test_a_wrong_password_is_refused(lab_broker):
    files, port = lab_broker
    with pytest.raises(aiomqtt.MqttError):
        async with login(files, port, "dev-00", password="guess"):
            pass


def sled(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """Run the CLI in its own process group: on a timeout the run, its server, broker and
    devices all go (Ctrl-C first, so the run takes its fleet down itself)."""
    command = [sys.executable, "-m", "sled_cli.main", *args]
    proc = subprocess.Popen(command, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def test_a_bad_scenario_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntarget: gemma3-270m\nrequests: 1\nfleet:\n"
                   "  - {count: 1, device: pi9, link: wifi, drafter: ngram}\n")
    done = sled("lab", "run", str(bad), "--out", str(tmp_path), timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "fleet.0.device" in lines[0] and str(bad) in lines[0], done.stderr
    assert not (tmp_path / "x").exists()


def test_a_beside_run_without_a_report_is_one_line_and_exit_2(tmp_path):
    done = sled("lab", "run", "smoke", "--out", str(tmp_path), "--beside", str(tmp_path / "none"),
                timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds no lab report" in lines[0], done.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.serial    # a fleet on both cores, with fault steps at set times: run alone
@pytest.mark.slow
def test_smoke_runs_end_to_end_with_its_fault_steps(tmp_path):
    done = sled("lab", "run", "smoke", "--out", str(tmp_path), "--run", "smoke", timeout=480)
    folder = tmp_path / "smoke"
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((folder / "report.json").read_text())
    assert report["lossless"] is True
    assert (folder / "report.html").stat().st_size > 0
    results = json.loads((folder / "results.json").read_text())
    assert [(p["system"], p["fleet_size"]) for p in results["phases"]] == [("sled", 3), ("centralized", 3)]
    requests = [r for p in results["phases"] for r in p["requests"]]
    assert len(requests) == 12 and all(r["error"] is None and r["lossless"] for r in requests)
    assert sum(r["lost_tokens"] + r["duplicated_tokens"] for r in requests) == 0
    assert sorted(f["kind"] for f in results["faults"]) == ["link_cut", "server_kill"]
    assert all(f["ok"] for f in results["faults"]), results["faults"]
    # the faults hit live traffic: a request of the cut device was open across its cut, and
    # requests were still open when the killed server came back
    sled_phase = results["phases"][0]["requests"]
    for fault in results["faults"]:
        end = fault["at_s"] + fault["down_s"]
        hit = [r for r in sled_phase if r["sent_at"] < end and r["done_at"] > fault["at_s"]
               and fault["device"] in (None, r["device"])]
        assert hit, f"no request was open during {fault}"
    kill = next(f for f in results["faults"] if f["kind"] == "server_kill")
    assert max(r["done_at"] for r in sled_phase) > kill["at_s"] + kill["down_s"]
    assert set(results["link_emulation"].values()) == {"user-space"}
    assert results["phases"][0]["server"]["forward_passes"] > 0


def test_a_lost_connection_is_not_taken_for_refused_credentials():
    """A broker that goes away (paho's 'not connected', code 4) is retried at the normal pace; only
    a CONNACK refusing the login waits the long refusal delay, or a broker restart left every
    device off the broker for half a minute."""
    from aiomqtt.exceptions import MqttConnectError

    from sled.mqtt import refused_credentials

    assert not refused_credentials(aiomqtt.MqttCodeError(4, "The client is not currently connected."))
    assert refused_credentials(MqttConnectError(4))
    assert refused_credentials(MqttConnectError(5))


def _finished_run(tmp_path, record: dict, faults: list[dict] | None = None) -> int:
    """lab.run.finish on a one-request run: the exit status the run ends with."""
    from lab.results import Results
    from lab.run import finish
    from lab.scenario import load_scenario

    results = Results("exit-status", "local", load_scenario("smoke"))
    base = {"device": "dev-00", "profile": "pi5", "link": "wifi", "drafter": "ngram",
            "system": "sled", "fleet_size": 1, "prompt_index": 0, "sent_at": 0.0,
            "first_token_at": 0.5, "done_at": 1.0, "token_ids": [5, 6], "text": "ab", "chunks": 1,
            "duplicated_chunks": [], "missing_chunks": [], "error": None, "attempts": 1,
            "lossless": True, "complete": True, "lost_tokens": 0, "duplicated_tokens": 0,
            "differing_tokens": 0}
    results.phases.append({"system": "sled", "fleet_size": 1, "wall_s": 1.0,
                           "requests": [{**base, **record}], "server": {}, "devices": {}})
    results.faults += faults or []
    return finish(results, tmp_path)


def test_the_exit_status_tells_a_mismatch_from_a_failure(tmp_path):
    assert _finished_run(tmp_path, {}) == 0
    assert _finished_run(tmp_path, {"lossless": False, "differing_tokens": 1}) == 1
    # an error whose tokens are a prefix of the reference is a failure, not a losslessness verdict
    assert _finished_run(tmp_path, {"lossless": None, "complete": False, "error": "timeout"}) == 3
    failed = {"kind": "server_kill", "at_s": 1.0, "device": None, "down_s": 1.0,
              "done_at_s": None, "ok": False, "note": "did not come back"}
    assert _finished_run(tmp_path, {}, [failed]) == 3


@pytest.mark.serial    # an emulated server's pace is what it measures: run alone
@pytest.mark.slow
def test_an_emulated_fleet_of_calibrated_devices_runs_end_to_end(tmp_path):
    """fleet-h100 in small: devices drafting like the cross-family pair from traces the run
    writes, against the tiny target held to the H100 profile; every output is the target's."""
    scenario = yaml.safe_load((ROOT / "lab" / "scenarios" / "fleet-h100.yaml").read_text())
    scenario.update(name="h100-small", fleet_sizes=[1, 2], requests=1, max_tokens=16,
                    workload={"source": "humaneval", "limit": 2})
    scenario["fleet"] = scenario["fleet"][:2]
    for group in scenario["fleet"]:
        group["count"] = 1
    path = tmp_path / "h100-small.yaml"
    path.write_text(yaml.safe_dump(scenario))
    done = sled("lab", "run", str(path), "--out", str(tmp_path), "--run", "small", timeout=300)
    folder = tmp_path / "small"
    assert done.returncode == 0, done.stderr[-3000:]
    assert (folder / "traces" / "smollm2-xtok.jsonl").is_file()
    report = json.loads((folder / "report.json").read_text())
    assert report["lossless"] is True
    emulated = report["server_emulation"]
    assert emulated["profile"] == "h100-llama8b-hf-graph" and emulated["steps"] > 0
    assert [(p["system"], p["fleet_size"]) for p in emulated["phases"]] == \
        [("sled", 1), ("centralized", 1), ("sled", 2), ("centralized", 2)]
    accepted = report["acceptance"]["calibrated:smollm2-xtok"]
    assert 0.3 < accepted["rate"] < 0.95, accepted      # drafted like the pair, not perfectly
    assert "EMULATED SERVER" in (folder / "report.html").read_text()


def test_devices_beside_an_emulated_server_run_in_the_background(tmp_path):
    """A device child of an emulated run takes a core only when nothing else wants it, so the
    server keeps the profile's pace; other children keep the normal priority."""
    from lab.server_process import Child
    from lab.run import make_fleet
    from lab.scenario import load_scenario

    probe = [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"]
    for background, policy in ((True, os.SCHED_IDLE), (False, os.SCHED_OTHER)):
        child = Child("probe", probe, tmp_path / f"{background}.log", background=background)
        child.start()
        child.proc.wait(30)
        assert child.log.read_text().strip() == str(policy)
    assert make_fleet("local", load_scenario("fleet-h100"), tmp_path).devices_in_background
    assert not make_fleet("local", load_scenario("smoke"), tmp_path).devices_in_background
