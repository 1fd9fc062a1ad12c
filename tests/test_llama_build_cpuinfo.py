"""llama.cpp's flags from the whole /proc/cpuinfo of real boards, as their aarch64 kernels print it
(one block per core, then the board lines a Raspberry Pi kernel adds; a Jetson adds none): the
rule in sled.llama_build gives each board the -march its cores support, and no more."""
from __future__ import annotations

import pytest

from lab.arm_wheel import CPUINFO_DIR as CPUINFO   # lab/cpuinfo/, the boards arm-wheel builds for
from sled import llama_build
from sled.llama_build import build_flags, cpu_features, cpu_name

# board file -> (cores, its name as sled doctor prints it, the -march it gets)
BOARDS = {
    # Cortex-A76 (Armv8.2-A): dot product and half-precision arithmetic, no i8mm (Armv8.6-A).
    "raspberry-pi-5.txt": (4, "Raspberry Pi 5 Model B Rev 1.0", "armv8.2-a+dotprod+fp16"),
    # Cortex-A72 (Armv8.0-A): NEON only.
    "raspberry-pi-4.txt": (4, "Raspberry Pi 4 Model B Rev 1.4", "armv8-a"),
    # Cortex-A78AE (Armv8.2-A with some Armv8.4-A features: uscat, ilrcpc, flagm): dot product
    # and fp16 as the A76; no i8mm, no SVE.
    "jetson-orin-nano.txt": (6, "Cortex-A78AE", "armv8.2-a+dotprod+fp16"),
}


@pytest.fixture(autouse=True)
def no_extra_cmake_args(monkeypatch):
    monkeypatch.delenv(llama_build.EXTRA_ARGS_ENV, raising=False)


def blocks(text: str) -> list[dict[str, str]]:
    """The per-core blocks of a cpuinfo text: field -> value, only those with a "processor"."""
    found = []
    for chunk in text.split("\n\n"):
        fields = dict((name.strip(), value.strip()) for name, _, value in
                      (line.partition(":") for line in chunk.splitlines()))
        if "processor" in fields:
            found.append(fields)
    return found


@pytest.mark.parametrize("board", sorted(BOARDS))
def test_each_board_gets_exactly_the_march_its_cores_support(board):
    text = (CPUINFO / board).read_text()
    cores, name, march = BOARDS[board]
    assert build_flags(cpu_features(text), arch="aarch64") == [
        "-DGGML_NATIVE=OFF", f"-DGGML_CPU_ARM_ARCH={march}"]
    assert build_flags(cpu_features(text), arch="aarch64", portable=True) == [
        "-DGGML_NATIVE=OFF", "-DGGML_CPU_ARM_ARCH=armv8-a"]
    assert cpu_name(text) == name
    assert len(blocks(text)) == cores


@pytest.mark.parametrize("board", sorted(BOARDS))
def test_the_fixtures_are_cpuinfo_as_the_aarch64_kernel_prints_it(board):
    """Every core's block has the kernel's fields in its order, and all cores report the same
    Features (the kernel prints the system-wide hwcaps for each): the first line is enough."""
    text = (CPUINFO / board).read_text()
    per_core = blocks(text)
    assert [list(core) for core in per_core] == [[
        "processor", "BogoMIPS", "Features", "CPU implementer", "CPU architecture",
        "CPU variant", "CPU part", "CPU revision"]] * len(per_core)
    assert [core["processor"] for core in per_core] == [str(i) for i in range(len(per_core))]
    assert {core["Features"] for core in per_core} == {per_core[0]["Features"]}
    assert cpu_features(text) == frozenset(per_core[0]["Features"].split())
    assert {core["CPU implementer"] for core in per_core} == {"0x41"}
    assert "CPU architecture: 8\n" in text and "flags" not in text


def test_sve_and_i8mm_are_taken_only_where_reported():
    """A core newer than the boards (i8mm and SVE reported): +i8mm is added, SVE stays out."""
    orin = (CPUINFO / "jetson-orin-nano.txt").read_text()
    newer = orin.replace("asimddp", "asimddp sve i8mm")
    assert build_flags(cpu_features(newer), arch="aarch64")[1] == \
        "-DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16+i8mm"
