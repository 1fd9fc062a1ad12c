"""`sled lab arm-wheel`, its fast parts: the flags each board gets, the retag of a wheel pip named
for the host (Tag, RECORD and name), the ELF check of its libraries, a machine without the cross
compiler (one line, exit 2), and a cached wheel found again without a build. The cross-compile
itself (minutes) is not run here."""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import zipfile

import pytest

from lab import arm_wheel
from sled import llama_build
from tests.conftest import run_main

INSTALL = "apt-get install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu"


@pytest.fixture(autouse=True)
def no_extra_cmake_args(monkeypatch):
    monkeypatch.delenv(llama_build.EXTRA_ARGS_ENV, raising=False)


@pytest.mark.parametrize("board, march", [("pi5", "armv8.2-a+dotprod+fp16"),
                                          ("pi4", "armv8-a"),
                                          ("orin", "armv8.2-a+dotprod+fp16")])
def test_each_board_gets_the_flags_sled_llama_build_gives_its_cpuinfo(board, march):
    assert arm_wheel.board_flags(arm_wheel.board_cpuinfo(board)) == [
        "-DGGML_NATIVE=OFF", f"-DGGML_CPU_ARM_ARCH={march}"]


def test_the_cache_key_follows_the_version_and_the_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    pi5 = arm_wheel.board_flags(arm_wheel.board_cpuinfo("pi5"))
    pi4 = arm_wheel.board_flags(arm_wheel.board_cpuinfo("pi4"))
    folder = arm_wheel.wheel_folder("pi5", "0.3.36", pi5)
    assert folder.parent == tmp_path / "arm-root" / "wheels" / "pi5"
    assert folder.name.startswith("0.3.36-")
    assert folder == arm_wheel.wheel_folder("pi5", "0.3.36", list(pi5))
    assert folder.name != arm_wheel.wheel_folder("pi5", "0.3.37", pi5).name
    assert folder.name != arm_wheel.wheel_folder("pi5", "0.3.36", pi4).name


def _sha256(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _fake_wheel(path, files: dict[str, bytes]):
    """A wheel as pip wheel writes one: its files, then WHEEL and RECORD (with every hash)."""
    info = "llama_cpp_python-0.3.36.dist-info"
    files = {**files, f"{info}/WHEEL": (b"Wheel-Version: 1.0\nGenerator: scikit-build-core 0.11\n"
                                        b"Root-Is-Purelib: false\nTag: py3-none-linux_x86_64\n")}
    rows = [[name, _sha256(data), str(len(data))] for name, data in files.items()]
    record = "".join(",".join(row) + "\n" for row in rows) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out:
        for name, data in {**files, f"{info}/RECORD": record.encode()}.items():
            out.writestr(name, data)
    return path


def _elf(machine: int) -> bytes:
    return b"\x7fELF\x02\x01\x01" + bytes(11) + machine.to_bytes(2, "little") + bytes(40)


def test_retag_rewrites_the_tag_the_record_line_and_the_name(tmp_path):
    library = _elf(arm_wheel.EM_AARCH64)
    built = _fake_wheel(tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl",
                        {"llama_cpp/__init__.py": b"", "llama_cpp/lib/libllama.so": library})
    (tmp_path / "out").mkdir()
    wheel = arm_wheel.retag(built, out_dir=tmp_path / "out")
    assert wheel == tmp_path / "out" / "llama_cpp_python-0.3.36-py3-none-linux_aarch64.whl"
    info = "llama_cpp_python-0.3.36.dist-info"
    with zipfile.ZipFile(wheel) as made, zipfile.ZipFile(built) as source:
        assert made.namelist() == source.namelist()
        metadata = made.read(f"{info}/WHEEL").decode()
        assert "Tag: py3-none-linux_aarch64" in metadata.splitlines()
        assert "linux_x86_64" not in metadata and "Root-Is-Purelib: false" in metadata
        assert made.read("llama_cpp/lib/libllama.so") == library
        rows = list(csv.reader(io.StringIO(made.read(f"{info}/RECORD").decode())))
        for name, digest, size in rows:      # every line, the rewritten one too, verifies
            if name != f"{info}/RECORD":
                assert (digest, size) == (_sha256(made.read(name)), str(len(made.read(name))))
        assert [row[0] for row in rows] == [row[0] for row in csv.reader(
            io.StringIO(source.read(f"{info}/RECORD").decode()))]
    assert arm_wheel.check_aarch64(wheel) == 1


def test_a_library_built_for_the_host_is_refused(tmp_path):
    built = _fake_wheel(tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl",
                        {"llama_cpp/lib/libllama.so": _elf(62),
                         "llama_cpp/lib/libggml.so": _elf(arm_wheel.EM_AARCH64)})
    assert arm_wheel.elf_machines(built) == {"llama_cpp/lib/libllama.so": 62,
                                             "llama_cpp/lib/libggml.so": arm_wheel.EM_AARCH64}
    with pytest.raises(arm_wheel.StepFailed, match="libllama.so is not aarch64"):
        arm_wheel.check_aarch64(built)


def test_a_missing_cross_compiler_is_one_line_naming_the_packages(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    monkeypatch.setattr(arm_wheel.shutil, "which", lambda name: (
        None if name == "aarch64-linux-gnu-g++" else f"/usr/bin/{name}"))
    code, out, err = run_main(capsys, "lab", "arm-wheel", "--board", "pi4")
    assert code == 2 and out == ""
    assert err == f"sled lab arm-wheel: aarch64-linux-gnu-g++ not found: {INSTALL}\n"
    assert not (tmp_path / "arm-root").exists()


def test_a_cached_wheel_is_found_again_without_a_download_or_a_build(monkeypatch, capsys,
                                                                     tmp_path):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    monkeypatch.setattr(arm_wheel.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(arm_wheel.subprocess, "Popen", None)      # no pip wheel
    monkeypatch.setattr(arm_wheel, "_run", None)                  # no pip download
    sdists = arm_wheel.sdist_dir(llama_build.spec())
    sdists.mkdir(parents=True)
    (sdists / "llama_cpp_python-0.3.36.tar.gz").write_bytes(b"")
    flags = arm_wheel.board_flags(arm_wheel.board_cpuinfo("pi5"))
    folder = arm_wheel.wheel_folder("pi5", "0.3.36", flags)
    folder.mkdir(parents=True)
    name = "llama_cpp_python-0.3.36-py3-none-linux_aarch64.whl"
    (folder / name).write_bytes(b"x" * 1000)
    assert arm_wheel.cached_wheel("pi5") is None
    (folder / "build.json").write_text(json.dumps({
        "wheel": name, "flags": flags, "requirement": llama_build.spec(), "version": "0.3.36",
        "libraries": 4, "compiler": "12.2.0", "jobs": 1, "build_s": 410.0}))
    assert arm_wheel.cached_wheel("pi5") == (folder / name, flags)
    assert arm_wheel.cached_wheel("pi4") is None
    code, out, err = run_main(capsys, "lab", "arm-wheel", "--out", str(tmp_path / "out"))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"arm-wheel: {tmp_path / 'out' / name} (0.0 MB; 4 ELF files, all aarch64)"
    assert lines[1] == ("arm-wheel: flags: -DGGML_NATIVE=OFF "
                        "-DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16 "
                        "(Raspberry Pi 5 Model B Rev 1.0)")
    assert lines[2].startswith("arm-wheel: cached, built in 6 min 50 s with aarch64-linux-gnu-gcc")
    assert (tmp_path / "out" / name).read_bytes() == b"x" * 1000
