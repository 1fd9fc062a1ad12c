"""`sled lab arm-root`, its fast parts: a machine without the tools or without binfmt_misc gets
one line and exit 2, the mirror comes from this host's apt sources, and a finished root is found
again by its stamp without building. The build itself (minutes under qemu) is not run here."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from lab import arm_root
from tests.conftest import SLED, run_main

INSTALL = "apt-get install debootstrap qemu-user-static binfmt-support"


def test_a_missing_tool_is_one_line_naming_the_packages(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    monkeypatch.setattr(arm_root.shutil, "which",
                        lambda name: None if name == "debootstrap" else f"/usr/bin/{name}")
    code, out, err = run_main(capsys, "lab", "arm-root", "--check")
    assert code == 2 and out == ""
    assert err == f"sled lab arm-root: debootstrap not found: {INSTALL}\n"
    assert not (tmp_path / "arm-root").exists()


def test_with_nothing_on_the_path_the_command_says_what_to_install(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    env = dict(os.environ, PATH=str(empty), SLED_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([*SLED, "lab", "arm-root"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"sled lab arm-root: debootstrap, qemu-aarch64-static, chroot not found: {INSTALL}"]


def test_binfmt_that_cannot_be_registered_is_one_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(arm_root, "_quiet", lambda argv: None)      # mount does nothing
    monkeypatch.setattr(arm_root.os, "geteuid", lambda: 0)
    with pytest.raises(arm_root.Unavailable, match="binfmt_misc cannot be mounted"):
        arm_root.ensure_binfmt(tmp_path)
    monkeypatch.setattr(arm_root.os, "geteuid", lambda: 1000)
    with pytest.raises(arm_root.Unavailable, match="needs root"):
        arm_root.ensure_binfmt(tmp_path)
    (tmp_path / "qemu-aarch64").write_text("enabled\ninterpreter /usr/libexec/qemu-binfmt/"
                                           "aarch64-binfmt-P\nflags: PF\n")
    arm_root.ensure_binfmt(tmp_path)          # registered and enabled: nothing to do


def test_the_mirror_is_the_one_apt_uses_here(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    assert arm_root.debian_mirror(tmp_path) is None          # debootstrap's own default
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.invalid/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb\nURIs: http://mirror.invalid/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n")
    assert arm_root.debian_mirror(tmp_path) == "http://mirror.invalid/debian"
    (tmp_path / "sources.list").write_text(
        "deb http://other.invalid/debian-security bookworm-security main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://other.invalid/debian bookworm main\n")
    assert arm_root.debian_mirror(tmp_path) == "http://other.invalid/debian"


def test_a_finished_root_is_found_again_by_its_stamp(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    monkeypatch.setattr(arm_root, "check_tools", lambda: None)
    monkeypatch.setattr(arm_root, "ensure_binfmt", lambda: None)

    def no_build(root, say):
        raise AssertionError("built again")

    monkeypatch.setattr(arm_root, "build", no_build)
    root = arm_root.root_dir()
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "python3").write_bytes(b"\0" * 4096)
    stamp = {"steps_s": {"debootstrap": 300.0, "packages": 200.0, "ca bundle": 0.0},
             "bytes": 4096, "mirror": "http://mirror.invalid/debian"}
    arm_root.stamp_path(root).write_text(json.dumps(stamp))
    code, out, err = run_main(capsys, "lab", "arm-root")
    assert code == 0 and err == ""
    assert out.startswith(f"arm-root: {root}: ") and "cached, built in debootstrap 300 s" in out
