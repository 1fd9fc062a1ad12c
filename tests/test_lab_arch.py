"""Devices of another architecture in the compose lab, the fast parts: a fleet group's `arch`
(a bad one refused with the choices), the compose model that gives arm64 groups the device-arm64
service (platform linux/arm64, the arm64 image), each replica claiming only its own
architecture's slots, the arm64 wheelhouse's platform tags, and the one line (exit 2) of a
machine without qemu-aarch64 in binfmt_misc. Building the arm64 image and running the fleet
(minutes under qemu) are not done here."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from lab import arch, compose as lab_compose, device_entry, images_arm64
from lab.images import BuildError
from lab.results import Results
from lab.scenario import ScenarioError, load_scenario, parse_scenario, scenario_path
from tests.conftest import run_main

ROOT = Path(__file__).resolve().parent.parent
INSTALL = "apt-get install qemu-user-static binfmt-support"


def mixed(arm64: str | None = "arm64") -> dict:
    return {"name": "mixed", "target": "gemma3-270m", "requests": 1,
            "fleet": [{"count": 2, "device": "pi5", "link": "wifi", "drafter": "ngram"},
                      {"count": 2, "device": "pi5", "link": "wifi", "drafter": "ngram",
                       "arch": arm64}]}


@pytest.fixture
def on_amd64(monkeypatch):
    """This machine is x86-64, whatever runs the tests."""
    monkeypatch.setattr(arch.platform, "machine", lambda: "x86_64")


def test_a_groups_arch_goes_to_its_slots():
    slots = parse_scenario(mixed()).slots()
    assert [slot.arch for slot in slots] == [None, None, "arm64", "arm64"]
    assert [s.arch for s in load_scenario("mixed-arch").slots()] == ["amd64"] * 2 + ["arm64"] * 2


@pytest.mark.parametrize("value, hint", [("aarch64", " (write arm64)"), ("riscv64", "")])
def test_a_bad_arch_is_refused_with_the_choices(value, hint):
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(mixed(value))
    assert str(caught.value) == (f"<scenario>: fleet.1.arch: unknown architecture {value!r}{hint}"
                                 ": arch is one of amd64, arm64 (the device containers' platform, "
                                 "linux/ARCH)")


def test_the_machine_names_map_to_architectures(on_amd64):
    assert arch.machine_arch() == "amd64" and arch.machine_arch("aarch64") == "arm64"
    slots = parse_scenario(mixed()).slots()
    assert [s.id for s in arch.foreign_slots(slots)] == ["dev-02", "dev-03"]
    assert arch.foreign_slots(slots, host="arm64") == []      # unset: the host's own
    explicit = load_scenario("mixed-arch").slots()
    assert [s.id for s in arch.foreign_slots(explicit, host="arm64")] == ["dev-00", "dev-01"]
    assert (arch.service("amd64"), arch.service("arm64")) == ("device", "device-arm64")


def compose_lab(tmp_path: Path, spec="mixed-arch") -> lab_compose.ComposeLab:
    lab = lab_compose.ComposeLab(load_scenario(spec), scenario_path(spec), "cfg", tmp_path)
    lab.tags = {"device": "sled-lab-device:x", "device-arm64": "sled-lab-device-arm64:y"}
    lab.write_run_folder()
    return lab


def test_arm64_groups_get_their_own_service_and_profile(tmp_path, on_amd64, monkeypatch):
    lab = compose_lab(tmp_path)
    assert lab.device_services == {"device": 2, "device-arm64": 2}
    ran = []
    monkeypatch.setattr(lab_compose, "run_step", lambda step, argv, **kw: ran.append(argv))
    monkeypatch.setattr(lab_compose, "compose_command", lambda: ["docker-compose"])
    lab.up()
    argv = ran[0]
    assert argv[argv.index("--profile", argv.index("lab")):][:2] == ["--profile", "arm64"]
    assert argv[argv.index("up"):] == ["up", "-d", "--no-build", "--scale", "device=2",
                                       "--scale", "device-arm64=2", "broker", "server", "device",
                                       "device-arm64"]
    env = dict(line.split("=", 1) for line in (lab.run_dir / ".env").read_text().splitlines())
    assert env["SLED_DEVICE_ARM64_IMAGE"] == "sled-lab-device-arm64:y"
    override = json.loads((lab.run_dir / lab_compose.OVERRIDE).read_text())["services"]
    assert override["device-arm64"]["labels"]["sled.lab.scenario"] == "mixed-arch"
    # the containers' copy names every group's arch: each replica claims its own
    copy = yaml.safe_load((lab.run_dir / "scenario.yaml").read_text())
    assert [group["arch"] for group in copy["fleet"]] == ["amd64", "arm64"]


def test_a_fleet_of_the_hosts_arch_has_no_arm64_service(tmp_path, on_amd64):
    lab = compose_lab(tmp_path, "smoke")
    assert lab.device_services == {"device": 3}
    assert "arm64" not in lab.compose("config")
    copy = yaml.safe_load((lab.run_dir / "scenario.yaml").read_text())
    assert {group["arch"] for group in copy["fleet"]} == {"amd64"}


def test_the_compose_model_runs_arm64_devices_as_linux_arm64(tmp_path, on_amd64):
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed")
    lab = compose_lab(tmp_path)
    argv = ["docker-compose", "--project-directory", str(ROOT), "--env-file",
            str(lab.run_dir / ".env"), "-f", str(ROOT / "docker-compose.yml"), "-f",
            str(lab.run_dir / lab_compose.OVERRIDE), "--profile", "lab", "--profile", "arm64",
            "config"]
    services = yaml.safe_load(subprocess.run(argv, capture_output=True, text=True, cwd=ROOT,
                                             check=True).stdout)["services"]
    arm, native = services["device-arm64"], services["device"]
    assert (arm["platform"], arm["image"]) == ("linux/arm64", "sled-lab-device-arm64:y")
    assert "platform" not in native and native["image"] == "sled-lab-device:x"
    assert arm["volumes"] == native["volumes"] and arm["cap_add"] == native["cap_add"]
    assert arm["tmpfs"] == ["/sys/devices/system/cpu:ro"] and "tmpfs" not in native


def test_replicas_claim_only_their_own_architectures_slots(tmp_path):
    slots, folder = load_scenario("mixed-arch").slots(), tmp_path / "slots"   # amd64 x2, arm64 x2
    arm64 = [device_entry.claim_slot(folder, slots, f"a{i}", "arm64") for i in range(3)]
    amd64 = [device_entry.claim_slot(folder, slots, f"x{i}", "amd64") for i in range(3)]
    assert [slot and slot.index for slot in arm64] == [2, 3, None]
    assert [slot and slot.index for slot in amd64] == [0, 1, None]


def test_the_slot_file_and_the_results_say_each_devices_machine(tmp_path):
    slot = load_scenario("mixed-arch").slots()[2]
    info = json.loads(device_entry.write_slot_file(tmp_path, slot, "netem").read_text())
    assert info["machine"] == arch.platform.machine()
    results = Results("r", "compose", load_scenario("mixed-arch"))
    results.device_machines = {"dev-02": "aarch64"}
    assert results.document()["device_machines"] == {"dev-02": "aarch64"}


def no_binfmt(monkeypatch, tmp_path) -> None:
    """binfmt_misc without qemu-aarch64, and no root to register it."""
    monkeypatch.setattr(arch, "BINFMT", tmp_path / "binfmt_misc")
    monkeypatch.setattr(arch.arm_root.os, "geteuid", lambda: 1000)


@pytest.mark.parametrize("command", [["lab", "compose"], ["lab", "run"]])
def test_without_binfmt_arm64_devices_are_one_line_and_exit_2(command, monkeypatch, tmp_path,
                                                              capsys, on_amd64):
    no_binfmt(monkeypatch, tmp_path)
    code, out, err = run_main(capsys, *command, "mixed-arch", "--out", str(tmp_path / "out"))
    assert code == 2 and out == ""
    assert err == (f"sled {' '.join(command)}: the arm64 devices (dev-02, dev-03) run under "
                   "qemu-user through binfmt_misc, which this machine lacks (qemu-aarch64 is not "
                   f"registered in binfmt_misc, and registering it needs root); install it: "
                   f"{INSTALL}\n")


def test_a_fleet_of_the_hosts_arch_needs_no_binfmt(monkeypatch, tmp_path, on_amd64):
    no_binfmt(monkeypatch, tmp_path)
    arch.emulation_ready(load_scenario("smoke").slots())       # nothing foreign: no check


def test_arm64_devices_run_in_containers_not_as_local_processes(monkeypatch, tmp_path, capsys,
                                                                on_amd64):
    monkeypatch.setattr(arch.arm_root, "ensure_binfmt", lambda binfmt: None)
    code, _, err = run_main(capsys, "lab", "run", "mixed-arch", "--out", str(tmp_path))
    assert code == 2
    assert err == ("sled lab run: the arm64 devices (dev-02, dev-03) run in containers of their "
                   "platform, not as processes here: sled lab compose mixed-arch\n")


def test_the_arm64_wheelhouse_takes_every_manylinux_of_bookworm():
    tags = images_arm64.platform_tags()
    assert {"manylinux_2_36_aarch64", "manylinux_2_28_aarch64", "manylinux_2_17_aarch64",
            "manylinux2014_aarch64", "linux_aarch64"} <= set(tags)
    assert not any("x86_64" in tag or "manylinux_2_37" in tag for tag in tags)


def test_without_the_cross_built_llama_wheel_the_arm64_image_says_how_to_build_it(
        tmp_path, monkeypatch):
    from lab import arm_wheel

    monkeypatch.setattr(arm_wheel, "cached_wheel", lambda board: None)
    with pytest.raises(BuildError, match="no aarch64 llama-cpp-python wheel for pi5 .*"
                                         "sled lab arm-wheel --board pi5"):
        images_arm64.llama_wheel()
    wheel = tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_aarch64.whl"
    wheel.write_bytes(b"wheel")
    monkeypatch.setattr(arm_wheel, "cached_wheel",
                        lambda board: (wheel, ["-DGGML_NATIVE=OFF"]) if board == "pi5" else None)
    assert images_arm64.llama_wheel() == wheel
    assert len(images_arm64.wheelhouse_key(wheel)) == 16
