"""The compose lab: the compose files validate (alone, with the GPU override, with a scenario's
generated override), a device replica claims a slot of its own, and (slow) the whole lab runs in
Docker here: a debootstrap base image, a wheelhouse, the images, broker + server + 3 devices of
two profiles, a short greedy scenario whose outputs all match the target's, and nothing of the
run left behind."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from lab import compose as lab_compose
from lab import device_entry
from lab.scenario import DeviceSlot, load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = {
    "name": "compose-test",
    "target": "gemma3-270m",
    "fleet": [
        {"count": 2, "device": "pi5", "link": "wifi", "drafter": "ngram"},
        {"count": 1, "device": "orin-nano", "link": "ethernet", "drafter": "gguf:gemma3-270m"},
    ],
    "workload": {"source": "humaneval", "limit": 2},
    "requests": 1,
    "max_tokens": 16,
    "sampling": {"temperature": 0.0},
    "centralized": False,
    # the replicas profile: two servers behind HAProxy, the devices dialing the proxy
    "server": {"replicas": 2},
    # through the Docker Engine API from inside the lab container
    "faults": [{"kind": "server_kill", "at_s": 1.0, "down_s": 1.0, "replica": 1}],
}


def compose_variants() -> list[list[str]]:
    variants = []
    if shutil.which("docker-compose"):
        variants.append(["docker-compose"])
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                 capture_output=True).returncode == 0:
        variants.append(["docker", "compose"])
    return variants


def require_compose() -> list[list[str]]:
    variants = compose_variants()
    if not variants:
        pytest.fail("neither docker-compose nor `docker compose` is installed: the compose lab "
                    "cannot be checked (make docker installs them from the Debian packages)")
    return variants


def check_config(compose: list[str], files: list[Path], env_file: Path | None = None) -> None:
    argv = compose + ["--project-directory", str(ROOT)]
    if env_file:
        argv += ["--env-file", str(env_file)]
    for file in files:
        argv += ["-f", str(file)]
    done = subprocess.run(argv + ["--profile", "lab", "--profile", "observe", "config", "-q"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(argv)} config: {done.stderr.strip()}"


@pytest.mark.parametrize("gpu", [False, True])
def test_compose_files_validate(gpu):
    files = [ROOT / "docker-compose.yml"] + ([ROOT / "docker-compose.gpu.yml"] if gpu else [])
    for compose in require_compose():
        check_config(compose, files)


def test_compose_config_shows_the_fleet_services():
    compose = require_compose()[0]
    done = subprocess.run(compose + ["-f", str(ROOT / "docker-compose.yml"), "--profile", "lab",
                                     "--profile", "observe", "config", "--services"],
                          capture_output=True, text=True, cwd=ROOT, check=True)
    assert set(done.stdout.split()) >= {"broker", "server", "device", "lab", "prometheus",
                                        "grafana"}


def test_gpu_override_reserves_a_gpu_for_the_server():
    compose = require_compose()[0]
    done = subprocess.run(compose + ["-f", str(ROOT / "docker-compose.yml"), "-f",
                                     str(ROOT / "docker-compose.gpu.yml"), "config"],
                          capture_output=True, text=True, cwd=ROOT, check=True)
    assert "driver: nvidia" in done.stdout and "--device cuda" in done.stdout.replace("\n", " ")


def run_folder(tmp_path: Path, spec: str | Path) -> lab_compose.ComposeLab:
    scenario = load_scenario(spec)
    lab = lab_compose.ComposeLab(scenario, lab_compose_path(spec), "cfg", tmp_path)
    lab.write_run_folder()
    return lab


def lab_compose_path(spec: str | Path) -> Path:
    from lab.scenario import scenario_path
    return scenario_path(spec)


def test_scenario_override_validates_for_smoke(tmp_path):
    lab = run_folder(tmp_path, "smoke")
    for compose in require_compose():
        check_config(compose, [ROOT / "docker-compose.yml", lab.run_dir / lab_compose.OVERRIDE],
                     lab.run_dir / ".env")
        check_config(compose, [ROOT / "docker-compose.yml", ROOT / "docker-compose.gpu.yml",
                               lab.run_dir / lab_compose.OVERRIDE], lab.run_dir / ".env")
    env = dict(line.split("=", 1) for line in (lab.run_dir / ".env").read_text().splitlines())
    assert env["SLED_TARGET"] == "gemma3-270m"
    assert (lab.run_dir / ".env").stat().st_mode & 0o077 == 0     # it holds a password
    credentials = json.loads((lab.run_dir / "broker" / "credentials.json").read_text())
    assert env["SLED_SERVER_MQTT_PASSWORD"] == credentials["server"]
    assert {"dev-00", "dev-01", "dev-02", "server", "lab"} <= set(credentials)
    assert "/mosquitto/config/passwords" in (lab.run_dir / "broker" / "mosquitto.conf").read_text()


def test_the_replicas_profile_adds_a_second_server_and_the_proxy():
    import yaml

    compose = require_compose()[0]
    done = subprocess.run(compose + ["--project-directory", str(ROOT), "-f",
                                     str(ROOT / "docker-compose.yml"), "--profile", "lab",
                                     "--profile", "replicas", "config"],
                          capture_output=True, text=True, cwd=ROOT, check=True)
    services = yaml.safe_load(done.stdout)["services"]
    assert {"broker", "server", "server-1", "proxy", "device", "lab"} <= set(services)
    profiled = {name for name, service in services.items()
                if "replicas" in (service.get("profiles") or [])}
    assert profiled == {"server-1", "proxy"}
    assert "/usr/local/etc/haproxy" in json.dumps(services["proxy"]["volumes"])


def test_the_replicas_scenario_renders_its_profile(tmp_path):
    """server.replicas 2: the run folder holds an haproxy.cfg over both replicas, both announce
    the proxy's address under their own ids and broker users, the devices dial the proxy, and
    the model with the override validates under the replicas profile."""
    import yaml

    from lab.fleet_compose import ComposeFleet
    from lab.proxy import haproxy_binary

    data = dict(SCENARIO, name="replicas-test", server={"replicas": 2},
                faults=[{"kind": "server_kill", "at_s": 1.0, "down_s": 1.0, "replica": 1}])
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps(data))
    lab = run_folder(tmp_path, path)
    argv = lab.compose("config")
    assert argv[argv.index("replicas") - 1] == "--profile"
    model = yaml.safe_load(subprocess.run(argv, capture_output=True, text=True, cwd=ROOT,
                                          check=True).stdout)
    services = model["services"]
    assert {"server", "server-1", "proxy"} <= set(services)
    for service, user in (("server", "server"), ("server-1", "server-1")):
        command = services[service]["command"]
        assert command[command.index("--announce-endpoint") + 1] == "proxy:50051"
        assert command[command.index("--mqtt-username") + 1] == user
    ids = {services[s]["command"][services[s]["command"].index("--server-id") + 1]
           for s in ("server", "server-1")}
    assert ids == {"lab-server", "lab-server-1"}
    env = dict(line.split("=", 1) for line in (lab.run_dir / ".env").read_text().splitlines())
    credentials = json.loads((lab.run_dir / "broker" / "credentials.json").read_text())
    assert env["SLED_SERVER_1_MQTT_PASSWORD"] == credentials["server-1"]
    assert "lab-server-1" in (lab.run_dir / "broker" / "acl").read_text()
    config = lab.run_dir / "proxy" / "haproxy.cfg"
    assert "server:50051" in config.read_text() and "server-1:50051" in config.read_text()
    if haproxy_binary():
        done = subprocess.run([haproxy_binary(), "-c", "-f", str(config)], capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    slot = load_scenario(path).slots()[0]
    assert json.loads(device_entry.daemon_env(slot, "netem", "pw", tmp_path,
                                              server=device_entry.PROXY)["SLED_DEVICE_SERVERS"]) \
        == ["proxy:50051"]
    fleet = ComposeFleet(load_scenario(path), broker_files=lab.run_dir / "broker")
    assert fleet.server_metrics_urls == ["http://server:9400/metrics",
                                         "http://server-1:9400/metrics"]
    with pytest.raises(lab_compose.BuildError, match="at most 2"):
        lab_compose.replicas_ready(parse_scenario(dict(data, server={"replicas": 3}, faults=[])))
    with pytest.raises(lab_compose.BuildError, match="without --gpu"):
        lab_compose.replicas_ready(load_scenario(path), gpu=True)


def test_override_carries_the_scenarios_server_flags(tmp_path):
    data = dict(SCENARIO, server={"replicas": 2, "args": ["--max-sessions", "7"]})
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(data))
    lab = run_folder(tmp_path, path)
    override = json.loads((lab.run_dir / lab_compose.OVERRIDE).read_text())
    for replica in ("server", "server-1"):
        command = override["services"][replica]["command"]
        assert command[:3] == ["serve", "--model", "gemma3-270m"]
        assert command[-2:] == ["--max-sessions", "7"]


def test_devices_mount_neither_the_broker_files_nor_the_run_folder(tmp_path):
    """A device container sees state/, scenario.yaml and workload/ only: credentials.json
    (every password) stays with the broker's folder and the lab."""
    import yaml

    lab = run_folder(tmp_path, "smoke")
    compose = require_compose()[0]
    argv = compose + ["--project-directory", str(ROOT), "--env-file", str(lab.run_dir / ".env"),
                      "-f", str(ROOT / "docker-compose.yml"), "-f",
                      str(lab.run_dir / lab_compose.OVERRIDE), "config"]
    model = yaml.safe_load(subprocess.run(argv, capture_output=True, text=True, cwd=ROOT,
                                          check=True).stdout)
    volumes = model["services"]["device"]["volumes"]
    sources = [Path(v["source"] if isinstance(v, dict) else v.split(":")[0]) for v in volumes]
    run_dir = lab.run_dir.resolve()
    mounted = sorted(str(p.relative_to(run_dir)) for p in sources if run_dir in p.parents
                     or p == run_dir)
    assert mounted == ["scenario.yaml", "state", "workload"]
    assert "SLED_MQTT_PASSWORD" not in json.dumps(model["services"]["device"])


def test_each_device_gets_only_its_own_password(tmp_path, monkeypatch):
    for slot in slots():
        device_entry.write_slot_file(tmp_path, slot, "user-space")
    calls = []
    monkeypatch.setattr(lab_compose, "run_step",
                        lambda step, argv, **kw: calls.append((argv, kw["input"])))
    credentials = {"dev-00": "a", "dev-01": "b", "dev-02": "c", "lab": "L", "server": "S"}
    lab_compose.deliver_passwords(tmp_path, 3, credentials)
    hosts = [json.loads((tmp_path / f"{i}.json").read_text())["container"] for i in range(3)]
    assert [(argv[:4], password) for argv, password in calls] == [
        (["docker", "exec", "-i", host], password) for host, password in zip(hosts, "abc")]
    assert all(device_entry.PASSWORD_FILE in argv[-1] for argv, _ in calls)


def test_device_waits_for_its_password_file(tmp_path):
    path = tmp_path / "pw"
    assert device_entry.wait_password(path, timeout_s=0.2) is None
    path.write_text("secret\n")
    assert device_entry.wait_password(path, timeout_s=0.2) == "secret"


def test_a_prompt_file_workload_is_copied_into_the_run_folder(tmp_path):
    folder = tmp_path / "scenarios"
    folder.mkdir()
    (folder / "prompts.txt").write_text("def add(a, b):\n")
    path = folder / "s.yaml"
    path.write_text(json.dumps(dict(SCENARIO, workload={"source": "prompts.txt"})))
    lab = run_folder(tmp_path, path)
    copied = load_scenario(lab.run_dir / "scenario.yaml")
    assert copied.workload.source == "/lab/workload/prompts.txt"
    assert (lab.run_dir / "workload" / "prompts.txt").read_text() == "def add(a, b):\n"


def test_a_target_path_is_refused(tmp_path):
    scenario = parse_scenario(dict(SCENARIO, target=str(tmp_path)))
    with pytest.raises(lab_compose.BuildError, match="built-in target"):
        lab_compose.target_ready(scenario)
    lab_compose.target_ready(parse_scenario(SCENARIO))


def test_the_wheelhouse_python_must_be_the_base_images():
    from lab import images

    images.python_ready(images.BASE_PYTHON)
    with pytest.raises(lab_compose.BuildError, match="Python 3.11"):
        images.python_ready((3, 12))


def test_each_image_requires_its_extras_and_the_device_no_torch(tmp_path):
    from lab import images

    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "sled"\ndependencies = ["numpy"]\n'
                         '[project.optional-dependencies]\nserver = ["torch", "numpy"]\n'
                         'lab = ["psutil"]\nall = ["sled[server,lab]", "rich"]\n')
    assert images.requirements(("all",), pyproject) == ["numpy", "rich", "psutil", "torch"]
    wanted = images.image_requirements()
    assert not any(r.startswith(("torch", "transformers")) for r in wanted["device"])
    assert any(r.startswith("llama-cpp-python") for r in wanted["device"])
    assert images.TORCH in wanted["server"]


def test_the_wheelhouse_key_follows_what_each_image_requires(monkeypatch):
    from lab import images

    before = images.wheelhouse_key()
    assert images.wheelhouse_key() == before
    monkeypatch.setattr(images, "SERVER_EXTRA_PACKAGES", ("openai>=1.50,<4",))
    assert images.wheelhouse_key() != before


def test_a_change_to_the_project_rebuilds_only_its_own_layer(tmp_path):
    """The dependencies images are keyed by the wheelhouse and the base alone: a new project
    wheel gives new server and device tags over the same dependencies images."""
    import zipfile

    from lab import images

    wheels = []
    for n, text in enumerate(["a = 1\n", "a = 2\n"]):
        wheel = tmp_path / str(n) / "sled-0.1.0-py3-none-any.whl"
        wheel.parent.mkdir()
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("sled/x.py", text)
        wheels.append(wheel)
    house = tmp_path / "0123456789abcdef"
    one, two = (images.image_tags("sled-base:bookworm", house, wheel) for wheel in wheels)
    for name in ("server-deps", "device-deps", "broker"):
        assert one[name] == two[name]
    for name in ("server", "device"):
        assert one[name] != two[name]
    other = images.image_tags("sled-base:bookworm", tmp_path / "fedcba9876543210", wheels[0])
    assert other["server-deps"] != one["server-deps"] and other["server"] != one["server"]


def test_compose_without_the_compose_files_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(lab_compose, "COMPOSE_FILE", tmp_path / "docker-compose.yml")
    args = SimpleNamespace(scenario="smoke")
    assert lab_compose.run(args) == 2
    assert "docker-compose.yml not found" in capsys.readouterr().err


def test_observe_ports_are_published_on_loopback_only():
    import yaml

    model = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name in ("prometheus", "grafana"):
        assert all(port.startswith("127.0.0.1:") for port in model["services"][name]["ports"])


def test_dashboard_metrics_exist():
    """Every metric a Grafana panel queries is one the server or the device daemon exports."""
    exported = set(re.findall(r'"(sled_[a-z_]+)"', (ROOT / "verify_server" / "metrics.py")
                              .read_text() + (ROOT / "edge_client" / "device_status.py").read_text()))
    queried = set()
    for board in (ROOT / "docker" / "grafana" / "dashboards").glob("*.json"):
        queried |= set(re.findall(r"\bsled_[a-z_]+", board.read_text()))
    assert queried
    unknown = sorted(name for name in queried
                     if re.sub(r"_(total|bucket|sum|count)$", "", name) not in exported
                     and name not in exported)
    assert not unknown, f"dashboard metrics no component exports: {unknown}"


def slots():
    return parse_scenario(SCENARIO).slots()


def test_replicas_claim_distinct_slots(tmp_path):
    """Twelve claimants race for three slots: each slot goes to exactly one."""
    folder, won, lock = tmp_path / "slots", [], threading.Lock()

    def claim(host):
        slot = device_entry.claim_slot(folder, slots(), host)
        with lock:
            won.append(None if slot is None else slot.index)

    threads = [threading.Thread(target=claim, args=(f"c{i}",)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(i for i in won if i is not None) == [0, 1, 2]
    assert won.count(None) == 9


def test_a_restarted_replica_gets_its_own_slot_back(tmp_path):
    folder = tmp_path / "slots"
    first = device_entry.claim_slot(folder, slots(), "aaa")
    second = device_entry.claim_slot(folder, slots(), "bbb")
    assert (first.index, second.index) == (0, 1)
    assert device_entry.claim_slot(folder, slots(), "bbb").index == 1


def test_netem_arguments_follow_the_link_profile():
    from lab.profiles import link_profile

    argv = device_entry.netem_args("wifi:rtt_ms=20", "eth0")
    assert argv[:7] == ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem"]
    assert argv[7:9] == ["delay", "20ms"]
    if link_profile("wifi").bandwidth_mbps:
        assert "rate" in argv


def test_device_environment_uses_the_slot_and_user_space_link(tmp_path, monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"GGUF")
    slot = slots()[2]
    env = device_entry.daemon_env(slot, "user-space", "pw", Path("traces"))
    assert env["SLED_DEVICE_ID"] == "dev-02"
    assert env["SLED_DEVICE_DRAFTER"] == f"gguf:{tmp_path}/gguf/gemma-3-270m-q4_k_m.gguf"
    assert env["SLED_DEVICE_EMULATION__DEVICE"] == "orin-nano"
    assert env["SLED_DEVICE_EMULATION__LINK"] == "ethernet"
    assert env["SLED_DEVICE_MQTT__USERNAME"] == "dev-02"
    assert json.loads(env["SLED_DEVICE_SERVERS"]) == ["server:50051"]
    assert "SLED_DEVICE_EMULATION__LINK" not in device_entry.daemon_env(slot, "netem", "pw", Path("traces"))


def test_a_calibrated_device_drafts_from_the_runs_trace_file(tmp_path):
    slot = DeviceSlot(0, "dev-00", "pi5", "wifi", "calibrated:smollm2-xtok", 0)
    env = device_entry.daemon_env(slot, "user-space", "pw", tmp_path / "traces")
    assert env["SLED_DEVICE_DRAFTER"] == f"trace:{tmp_path}/traces/smollm2-xtok.jsonl"
    assert device_entry.wait_file(tmp_path / "traces" / "smollm2-xtok.jsonl", 0.2) is None


def test_slot_file_says_which_link_emulation_ran(tmp_path):
    path = device_entry.write_slot_file(tmp_path, slots()[1], "user-space")
    info = json.loads(path.read_text())
    assert (info["id"], info["link_emulation"], info["port"]) == ("dev-01", "user-space", 8000)


def test_limits_follow_each_slots_device_profile(tmp_path, monkeypatch):
    from lab.profiles import device_profile

    for slot in slots():
        device_entry.write_slot_file(tmp_path, slot, "user-space")
    calls = []
    monkeypatch.setattr(lab_compose, "run_step", lambda step, argv: calls.append(argv))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    lab_compose.apply_limits(tmp_path, 3)
    assert len(calls) == 3
    orin = device_profile("orin-nano")
    assert calls[2][:6] == ["docker", "update", "--cpus", f"{orin.cpus:g}", "--memory",
                            f"{orin.memory_mb}m"]
    assert calls[0][3] == f"{device_profile('pi5').cpus:g}"


def test_missing_models_stop_before_any_build(tmp_path, monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    with pytest.raises(lab_compose.BuildError, match="sled models prepare"):
        lab_compose.models_ready(parse_scenario(SCENARIO))


# The real run ------------------------------------------------------------------------------

def docker_or_fail() -> None:
    if shutil.which("docker") is None:
        pytest.fail("docker is not installed: the compose lab cannot run (make docker)")
    done = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"the Docker engine does not answer ({done.stderr.strip()[-200:]}); "
                    "start dockerd (make docker does as root)")


def project_leftovers(project: str) -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={project}"
    found = {}
    for kind, argv in (("containers", ["docker", "ps", "-aq", "--filter", label]),
                       ("networks", ["docker", "network", "ls", "-q", "--filter", label]),
                       ("volumes", ["docker", "volume", "ls", "-q", "--filter", label]),
                       ("build stages", ["docker", "images", "-q", "--filter",
                                         "label=sled.lab.stage=build"])):
        found[kind] = subprocess.run(argv, capture_output=True, text=True).stdout.split()
    return found


def remove_project(project: str) -> None:
    """Everything a compose project made, found by its label, whether or not its `down` ran."""
    label = f"label=com.docker.compose.project={project}"
    for listing, remove in ((["docker", "ps", "-aq"], ["docker", "rm", "-f", "-v"]),
                            (["docker", "network", "ls", "-q"], ["docker", "network", "rm"]),
                            (["docker", "volume", "ls", "-q"], ["docker", "volume", "rm", "-f"])):
        found = subprocess.run(listing + ["--filter", label], capture_output=True,
                               text=True).stdout.split()
        if found:
            subprocess.run(remove + found, capture_output=True)


@pytest.mark.serial    # a fleet on both cores, with fault steps at set times: run alone
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_compose_lab_runs_a_fleet_losslessly(tmp_path):
    docker_or_fail()
    child = None
    scenario = tmp_path / "compose-test.yaml"
    scenario.write_text(json.dumps(SCENARIO))
    out = tmp_path / "lab-results"
    log = tmp_path / "compose.log"
    try:
        with log.open("w") as sink:
            child = subprocess.Popen([sys.executable, "-m", "sled_cli.main", "lab", "compose",
                                      str(scenario), "--build-base", "--out", str(out), "--run",
                                      "ct"], stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     start_new_session=True)
            returncode = child.wait()
        tail = "\n".join(log.read_text().splitlines()[-40:])
        leftovers = project_leftovers("sledlabct")
    finally:
        # a timeout or an error here must not leave the fleet running
        if child is not None and child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        remove_project("sledlabct")
    done = SimpleNamespace(returncode=returncode)
    assert done.returncode == 0, f"sled lab compose exited {done.returncode}:\n{tail}"
    report = json.loads((out / "ct" / "report.json").read_text())
    assert report["lossless"] is True, tail
    results = json.loads((out / "ct" / "results.json").read_text())
    records = [r for phase in results["phases"] for r in phase["requests"]]
    assert len(records) == 3 and all(r["lossless"] is True and not r["error"] for r in records)
    assert set(results["link_emulation"]) == {"dev-00", "dev-01", "dev-02"}
    assert [(f["kind"], f["replica"], f["ok"]) for f in results["faults"]] == \
        [("server_kill", 1, True)], tail
    assert [row["replica"] for row in report["replicas"]] == [0, 1]    # each replica's load
    assert not any(leftovers.values()), f"left behind: {leftovers}"
    assert not (out / ".compose-ct").exists()
    assert "serving gemma3-270m" in (out / "ct" / "logs" / "compose.log").read_text()
    assert_device_image_is_slim()


def assert_device_image_is_slim() -> None:
    """The device image has the drafters' runtimes and neither torch nor transformers."""
    tags = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}",
                           "sled-lab-device"], capture_output=True, text=True).stdout.split()
    assert len(tags) == 1, f"expected one cached device image, found {tags}"
    probe = ("import importlib.util as u; "
             "print([m for m in ('torch', 'transformers', 'llama_cpp', 'onnxruntime_genai') "
             "if u.find_spec(m)])")
    done = subprocess.run(["docker", "run", "--rm", "--entrypoint", "/opt/sled/bin/python",
                           tags[0], "-c", probe], capture_output=True, text=True)
    assert done.stdout.strip() == "['llama_cpp', 'onnxruntime_genai']", done.stderr
