"""`sled lab arm-device` before it touches the root: a bad drafter is one line and exit 2, and a
machine without the root is told the command that builds it (exit 2). The run itself is minutes
under emulation and is not part of the suite (BENCHMARKS.md, "The device side on aarch64")."""
from __future__ import annotations

import pytest

from conftest import run_main
from lab import arm_device, arm_root
from lab.bench import harness


def test_a_drafter_the_root_does_not_run_is_one_line_and_exit_2(capsys):
    code, _, err = run_main(capsys, "lab", "arm-device", "--drafters", "ngram,hf")
    errors = [line for line in err.splitlines() if not line.startswith(("usage:", " "))]
    assert code == 2 and len(errors) == 1 and "'hf' is not one of ngram, onnx, gguf" in errors[0]


def test_without_the_root_it_names_the_command_that_builds_it(monkeypatch, tmp_path):
    monkeypatch.setattr(arm_root, "root_dir", lambda: tmp_path / "bookworm-arm64")
    monkeypatch.setattr(arm_root, "check_tools", lambda: None)
    monkeypatch.setattr(arm_root, "ensure_binfmt", lambda: None)
    with pytest.raises(harness.Stop, match="sled lab arm-root") as stop:
        arm_device._ready_root()
    assert stop.value.code == harness.BAD_FLAGS


def test_a_machine_without_qemu_is_told_what_to_install(monkeypatch):
    def missing():
        raise arm_root.Unavailable(f"qemu-aarch64-static is not installed: {arm_root.INSTALL}")

    monkeypatch.setattr(arm_root, "check_tools", missing)
    with pytest.raises(harness.Stop, match="apt-get install debootstrap qemu-user-static"):
        arm_device._ready_root()


def test_every_board_the_wheel_is_built_for_runs_on_a_core_qemu_models():
    from lab import arm_wheel

    assert set(arm_device.QEMU_CPUS) == set(arm_wheel.BOARDS)
    assert arm_device.QEMU_CPUS["pi4"] == "cortex-a72" and arm_device.QEMU_CPUS["pi5"] == "cortex-a76"
    env = arm_device.root_env("cortex-a72")
    assert "QEMU_CPU=cortex-a72" in env and "HOME=/root" in env
