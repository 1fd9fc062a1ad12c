"""`sled broker-config`: against a real Mosquitto running the generated files, each device
writes only its own topics, each server announces only its own id, an operator reaches every
device, a wrong password is refused, and with --tls-dir (a `sled certs` folder) clients log in
over TLS with the CA and only with it. Bad ids are one line and exit 2, before any file."""
from __future__ import annotations

import asyncio
import getpass
import json
import os
import stat
import subprocess
from pathlib import Path
from types import SimpleNamespace

import aiomqtt
import pytest

from lab.broker import BrokerFiles
from lab.server_process import free_port
from sled.mqtt import Broker
from sled.pki import make_certs
from sled_cli.main import main
from tests.mqtt_broker import Mosquitto, _wait_listening, mosquitto_binary
from tests.test_lab_run import collect


def broker_config(folder: Path, *flags: str) -> tuple[BrokerFiles, int]:
    """`sled broker-config` for dev-1, dev-2, servers gpu-1, gpu-2 and operator app, on a free
    loopback port (as root, Mosquitto stays root: the test's files are root's)."""
    port = free_port()
    run_as = ["--run-as", getpass.getuser()] if os.geteuid() == 0 else []
    assert main(["broker-config", str(folder), "--devices", "dev-1,dev-2", "--servers",
                 "gpu-1,gpu-2", "--operators", "app", "--bind", "127.0.0.1", "--port", str(port),
                 *run_as, *flags]) == 0
    return BrokerFiles.read(folder), port


def start(files: BrokerFiles, port: int) -> Mosquitto:
    process = subprocess.Popen([mosquitto_binary(), "-c", str(files.conf)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    broker = Mosquitto(port, process, files.folder / "mosquitto.log", files.credentials)
    _wait_listening(broker)
    return broker


def login(files: BrokerFiles, port: int, user: str, password: str | None = None,
          ca: Path | None = None) -> aiomqtt.Client:
    broker = Broker("127.0.0.1", port, username=user, timeout_s=3,
                    password=files.password(user) if password is None else password,
                    ca_file=str(ca) if ca else None)
    return broker.client(f"acl-test-{user}")


@pytest.fixture
def fleet_broker(tmp_path):
    files, port = broker_config(tmp_path / "broker")
    broker = start(files, port)
    yield files, port
    broker.stop()


async def test_each_device_and_each_server_writes_only_its_own_topics(fleet_broker):
    files, port = fleet_broker
    app_seen, dev_1_seen, dev_2_seen = [], [], []
    last = ("sled/servers/gpu-1", b"announced")
    async with login(files, port, "app") as app, login(files, port, "dev-1") as dev_1, \
            login(files, port, "dev-2") as dev_2, login(files, port, "gpu-1") as gpu_1:
        await app.subscribe("sled/#", qos=1)
        await dev_1.subscribe([("sled/devices/dev-2/config", 1), ("sled/servers/#", 1)])
        await dev_2.subscribe([("sled/devices/dev-2/config", 1), ("sled/servers/#", 1)])
        for topic in ("sled/devices/dev-2/config", "sled/devices/dev-2/status",
                      "sled/servers/x", "sled/servers/dev-1", "sled/devices/dev-1/requests"):
            await dev_1.publish(topic, b"forbidden", qos=1)
        await dev_1.publish("sled/devices/dev-1/status", b"mine", qos=1)
        for topic in ("sled/servers/gpu-2", "sled/devices/dev-2/config"):
            await gpu_1.publish(topic, b"forbidden", qos=1)
        await app.publish("sled/devices/dev-2/config", b"from the operator", qos=1)
        await gpu_1.publish(*last, qos=1)
        for client, seen in ((app, app_seen), (dev_1, dev_1_seen), (dev_2, dev_2_seen)):
            await asyncio.wait_for(collect(client, seen, last), 10)
    assert not [m for m in app_seen + dev_2_seen if m[1] == b"forbidden"], app_seen + dev_2_seen
    assert ("sled/devices/dev-1/status", b"mine") in app_seen
    assert ("sled/devices/dev-2/config", b"from the operator") in dev_2_seen
    assert dev_1_seen == [last]           # another device's config never reaches dev-1


async def test_a_forged_client_id_takes_over_no_connection_and_fires_no_will(fleet_broker):
    """dev-2 logs in with its own password under dev-1's and gpu-1's client ids (the ones
    sled device and sled serve use, and their user names): dev-1 and gpu-1 stay connected, and
    gpu-1's last will (the server offline) is never published."""
    files, port = fleet_broker
    will = aiomqtt.Will("sled/servers/gpu-1", b"offline", qos=1, retain=True)
    gpu_1 = Broker("127.0.0.1", port, username="gpu-1", password=files.password("gpu-1"),
                   timeout_s=3).client("sled-server-gpu-1", will)
    dev_1 = Broker("127.0.0.1", port, username="dev-1", password=files.password("dev-1"),
                   timeout_s=3).client("sled-device-dev-1")
    forger = Broker("127.0.0.1", port, username="dev-2", password=files.password("dev-2"),
                    timeout_s=3)
    seen, last = [], ("sled/servers/gpu-1", b"still announcing")
    async with login(files, port, "app") as app, gpu_1, dev_1:
        await app.subscribe("sled/#", qos=1)
        for forged in ("sled-device-dev-1", "sled-server-gpu-1", "dev-1", "gpu-1"):
            async with forger.client(forged) as client:
                await client.publish("sled/devices/dev-2/status", forged.encode(), qos=1)
        await dev_1.publish("sled/devices/dev-1/status", b"still here", qos=1)
        await gpu_1.publish(*last, qos=1)
        await asyncio.wait_for(collect(app, seen, last), 10)
    assert ("sled/devices/dev-1/status", b"still here") in seen
    assert ("sled/servers/gpu-1", b"offline") not in seen, seen
    # the forger's own logins worked: only its own id was in play
    assert ("sled/devices/dev-2/status", b"sled-server-gpu-1") in seen


def test_the_password_file_is_0600_and_the_brokers(fleet_broker):
    files, _ = fleet_broker
    mode = stat.S_IMODE((files.folder / "passwords").stat().st_mode)
    assert mode == 0o600, oct(mode)
    # --run-as is the test's own user (as root) or none: the file is that user's
    assert (files.folder / "passwords").stat().st_uid == os.geteuid()


def test_as_root_the_password_file_goes_to_the_user_mosquitto_becomes(tmp_path, monkeypatch):
    """Mosquitto 2 started as root reads the file after becoming its own user: the file must be
    that user's, or the broker cannot start."""
    from lab import broker

    chowned = []
    monkeypatch.setattr(broker.os, "geteuid", lambda: 0)
    monkeypatch.setattr(broker.os, "chown", lambda path, uid, gid: chowned.append((uid, gid)))
    monkeypatch.setattr(broker.pwd, "getpwnam", lambda name: SimpleNamespace(
        pw_uid={"mosquitto": 105, "svc": 200}[name], pw_gid=7))
    broker.give_to_broker_user(tmp_path / "passwords", None)
    broker.give_to_broker_user(tmp_path / "passwords", "svc")
    assert chowned == [(105, 7), (200, 7)]


async def test_a_wrong_password_is_refused(fleet_broker):
    files, port = fleet_broker
    with pytest.raises(aiomqtt.MqttError):
        async with login(files, port, "dev-1", password=files.password("dev-2")):
            pass


async def test_over_tls_clients_log_in_with_the_ca_of_the_certs_folder(tmp_path):
    pki = make_certs(tmp_path / "certs", [])
    files, port = broker_config(tmp_path / "broker", "--tls-dir", str(pki.folder))
    broker = start(files, port)
    seen = []
    try:
        async with login(files, port, "app", ca=pki.ca) as app, \
                login(files, port, "dev-1", ca=pki.ca) as dev_1:
            await app.subscribe("sled/devices/dev-1/status", qos=1)
            await dev_1.publish("sled/devices/dev-1/status", b"over TLS", qos=1)
            await asyncio.wait_for(collect(app, seen, ("sled/devices/dev-1/status", b"over TLS")), 10)
        stranger = make_certs(tmp_path / "stranger", [])
        for ca in (None, stranger.ca):       # plaintext, or a CA that did not sign server.pem
            with pytest.raises(aiomqtt.MqttError):
                async with login(files, port, "dev-1", ca=ca):
                    pass
    finally:
        broker.stop()


def test_with_a_certs_folder_the_listener_speaks_tls_on_8883(tmp_path):
    pki = make_certs(tmp_path / "certs", [])
    assert main(["broker-config", str(tmp_path / "tls"), "--devices", "dev-1",
                 "--tls-dir", str(pki.folder)]) == 0
    lines = (tmp_path / "tls" / "mosquitto.conf").read_text().splitlines()
    assert {"listener 8883", f"cafile {pki.ca.resolve()}", f"certfile {pki.server_cert.resolve()}",
            f"keyfile {pki.server_key.resolve()}", "require_certificate false",
            "allow_anonymous false"} <= set(lines)
    assert main(["broker-config", str(tmp_path / "plain"), "--devices", "dev-1"]) == 0
    lines = (tmp_path / "plain" / "mosquitto.conf").read_text().splitlines()
    assert "listener 1883" in lines
    assert not [line for line in lines if line.split()[0] in ("cafile", "certfile", "keyfile")]
    credentials = tmp_path / "plain" / "credentials.json"
    assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
    assert set(json.loads(credentials.read_text())) == {"dev-1"}       # no lab user here


@pytest.mark.parametrize("flags", [
    ["--devices", "dev-1,a/b"],
    ["--devices", "dev-1", "--servers", "dev-1"],
    ["--devices", "dev-1", "--servers", "gpu+1"],
    ["--devices", "dev-1", "--tls-dir", "no-such-folder"],
])
def test_a_bad_input_is_one_line_and_exit_2_before_any_file(flags, tmp_path, capsys):
    assert main(["broker-config", str(tmp_path / "broker"), *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("sled broker-config: "), err
    assert not (tmp_path / "broker").exists()
