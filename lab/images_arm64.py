"""The arm64 device image of the compose lab, built on an x86-64 host with qemu-aarch64 in
binfmt_misc: the devices of a fleet group with `arch: arm64` run it as linux/arm64 containers.

    arm64_images(wheel) -> {"base-arm64": "sled-base:bookworm-arm64-HASH",
                            "device-arm64-deps": "sled-lab-device-arm64-deps:KEY",
                            "device-arm64": "sled-lab-device-arm64:KEY"}

The base is the amd64 base's packages, debootstrapped for arm64 and built FROM scratch as a
linux/arm64 image. The wheelhouse (<cache>/wheelhouse-arm64/KEY) holds the device's dependencies as aarch64
wheels for CPython 3.11, downloaded on the host (pip download --platform, binary only), and
llama-cpp-python, which publishes no aarch64 wheel, from the one `sled lab arm-wheel` cross-built
for a Pi 5 (lab.arm_wheel.cached_wheel). deps.Dockerfile and device.Dockerfile then
build the dependencies image and the device image for linux/arm64, as for the host's images,
each cached by its tag.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from lab import arm_wheel
from lab.images import (BASE_PYTHON, BASE_TAG, IMAGE_PREFIX, BuildError, _base_id, _dockerfile,
                        _hash, base_image, build_image, image_requirements, prune_build_stages,
                        prune_stale_images, prune_wheelhouses, run_step, wheel_content_hash)
from sled.cache import cache_dir

ARCH = "arm64"
PLATFORM = f"linux/{ARCH}"
BASE_ARM64_TAG = BASE_TAG.replace(":bookworm-", ":bookworm-arm64-")
GLIBC = (2, 36)         # bookworm's: manylinux wheels up to manylinux_2_36 run on it


def llama_wheel(board: str = arm_wheel.DEFAULT_BOARD) -> Path:
    """The aarch64 llama-cpp-python wheel `sled lab arm-wheel` cross-built for BOARD."""
    found = arm_wheel.cached_wheel(board)
    if found is None:
        raise BuildError("arm64 wheelhouse", f"no aarch64 llama-cpp-python wheel for {board} "
                         "(llama-cpp-python publishes none for aarch64): build it with `sled lab "
                         f"arm-wheel --board {board}`")
    return found[0]


def platform_tags(glibc: tuple[int, int] = GLIBC) -> list[str]:
    """pip's --platform values for an aarch64 bookworm: every manylinux up to its glibc."""
    tags = [f"manylinux_{glibc[0]}_{minor}_aarch64" for minor in range(glibc[1], 16, -1)]
    return tags + ["manylinux2014_aarch64", "linux_aarch64"]


def wheelhouse_key(llama: Path) -> str:
    """The device's requirements, the platform and the llama-cpp-python wheel."""
    digest = hashlib.sha256(b"arm64 device dependencies\n")
    digest.update(repr((image_requirements()["device"], platform_tags(), BASE_PYTHON)).encode())
    digest.update(llama.name.encode() + hashlib.sha256(llama.read_bytes()).digest())
    return digest.hexdigest()[:16]


def wheelhouse(root: Path | None = None) -> Path:
    """Every dependency of the arm64 device image and its device.txt, cached by wheelhouse_key."""
    llama = llama_wheel()
    root = root or cache_dir() / "wheelhouse-arm64"
    house = root / wheelhouse_key(llama)
    if (house / ".complete").is_file():
        return house
    house.mkdir(parents=True, exist_ok=True)
    (house / "device.txt").write_text("\n".join(image_requirements()["device"]) + "\n")
    platforms = [word for tag in platform_tags() for word in ("--platform", tag)]
    run_step("arm64 wheelhouse", [sys.executable, "-m", "pip", "download", "--quiet",
                                  "--dest", str(house), "--only-binary=:all:",
                                  "--implementation", "cp", "--python-version",
                                  ".".join(map(str, BASE_PYTHON)), *platforms,
                                  "--find-links", str(llama.parent),
                                  "-r", str(house / "device.txt")])
    (house / ".complete").write_text(house.name + "\n")
    prune_wheelhouses(root, keep=house)
    return house


def image_tags(base: str, house: Path, wheel: Path) -> dict[str, str]:
    """The arm64 images' tags, each a hash of what goes into it (as lab.images.image_tags)."""
    deps = f"{IMAGE_PREFIX}-device-{ARCH}-deps:" + _hash(house.name, _base_id(base), "device",
                                                          _dockerfile("deps"), PLATFORM)
    device = f"{IMAGE_PREFIX}-device-{ARCH}:" + _hash(deps, wheel_content_hash(wheel),
                                                       _dockerfile("device"), PLATFORM)
    return {"base-arm64": base, "device-arm64-deps": deps, "device-arm64": device}


def image_arch(tag: str) -> str:
    return subprocess.run(["docker", "image", "inspect", "-f", "{{.Architecture}}", tag],
                          capture_output=True, text=True).stdout.strip()


def arm64_images(wheel: Path) -> dict[str, str]:
    """The arm64 base, wheelhouse, dependencies image and device image, each built when
    missing; their tags."""
    base = base_image(True, BASE_ARM64_TAG, arch=ARCH)
    if image_arch(base) != ARCH:
        raise BuildError("arm64 base", f"{base} is a {image_arch(base) or 'missing'} image, not "
                         f"{ARCH}: remove it (docker image rm {base}) to build it again")
    house = wheelhouse()
    tags = image_tags(base, house, wheel)
    build_image(tags["device-arm64-deps"], "deps", house, platform=PLATFORM, BASE_IMAGE=base,
                REQUIREMENTS="device.txt")
    with tempfile.TemporaryDirectory(prefix="sled-project-") as context:
        shutil.copy2(wheel, Path(context) / wheel.name)
        build_image(tags["device-arm64"], "device", Path(context), platform=PLATFORM,
                    DEPS_IMAGE=tags["device-arm64-deps"])
    prune_build_stages()
    prune_stale_images({name: tag for name, tag in tags.items() if name != "base-arm64"})
    return tags
