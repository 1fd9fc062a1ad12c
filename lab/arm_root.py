"""An aarch64 Debian Bookworm root on an x86-64 host: the Python of a Raspberry Pi or a Jetson,
run by qemu-user through binfmt_misc and entered with chroot.

    sled lab arm-root            # built once (minutes) into <cache>/arm-root/bookworm-arm64
    sled lab arm-root --check    # chroot ROOT /usr/bin/python3: prints aarch64

The steps, each timed: debootstrap --arch=arm64 --variant=minbase from the Debian mirror this
host's apt uses for bookworm (debootstrap's own default where it names none); python3,
python3-venv, python3-pip and ca-certificates installed in the root with apt-get; this host's CA
bundle copied over the root's, so pip in the root verifies what pip here does. The stamp
(bookworm-arm64.json beside the root) is written last: a root without it is built again.
Needs root and the packages debootstrap, qemu-user-static and binfmt-support.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from sled.cache import cache_dir

SUITE = "bookworm"
PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates")
TOOLS = ("debootstrap", "qemu-aarch64-static", "chroot")
INSTALL = "apt-get install debootstrap qemu-user-static binfmt-support"
BINFMT = Path("/proc/sys/fs/binfmt_misc")
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
APT = Path("/etc/apt")
CHECK_CODE = "import platform; print(platform.machine())"
# What runs in the root: no host PATH (a venv's bin) and no prompts from apt.
CHROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LC_ALL": "C",
              "DEBIAN_FRONTEND": "noninteractive"}


class Unavailable(RuntimeError):
    """This machine cannot build or run the root: one line saying what to install, or why."""


class StepFailed(RuntimeError):
    """A step of the build failed: its name, the last line it wrote and where its log is."""


def root_dir() -> Path:
    return cache_dir() / "arm-root" / f"{SUITE}-arm64"


def stamp_path(root: Path) -> Path:
    return root.with_name(root.name + ".json")


def check_tools(tools: tuple[str, ...] = TOOLS, install: str = INSTALL) -> None:
    """Unavailable naming every one of TOOLS not on PATH and the line that installs them."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise Unavailable(f"{', '.join(missing)} not found: {install}")


def ensure_binfmt(binfmt: Path = BINFMT) -> None:
    """qemu-aarch64 registered and enabled in binfmt_misc: mounted and enabled here if not."""
    entry = binfmt / "qemu-aarch64"
    if _enabled(entry):
        return
    if os.geteuid() != 0:
        raise Unavailable("qemu-aarch64 is not registered in binfmt_misc, and registering it "
                          "needs root")
    if not (binfmt / "register").exists():
        _quiet(["mount", "binfmt_misc", "-t", "binfmt_misc", str(binfmt)])
        if not (binfmt / "register").exists():
            raise Unavailable(f"binfmt_misc cannot be mounted at {binfmt} (a container without "
                              f"the privilege?): aarch64 binaries cannot run here")
    if shutil.which("update-binfmts") is None:
        raise Unavailable(f"update-binfmts not found: {INSTALL}")
    _quiet(["update-binfmts", "--enable", "qemu-aarch64"])
    if not _enabled(entry):
        raise Unavailable(f"update-binfmts could not enable qemu-aarch64 in {binfmt} "
                          f"(apt-get install --reinstall qemu-user-static binfmt-support)")


def _enabled(entry: Path) -> bool:
    try:
        return entry.read_text().splitlines()[0].strip() == "enabled"
    except (OSError, IndexError):
        return False


def _quiet(argv: list[str]) -> None:
    subprocess.run(argv, capture_output=True, text=True)


def debian_mirror(apt: Path = APT, suite: str = SUITE) -> str | None:
    """The first http(s) mirror this host's apt sources name for SUITE (sources.list lines and
    deb822 .sources files), or None: debootstrap then takes its own default."""
    for path in [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]:
        for line in _text(path).splitlines():     # deb [arch=amd64 ...] URI SUITE COMPONENTS
            words = re.sub(r"\[[^\]]*\]", " ", line.split("#", 1)[0]).split()
            if words[:1] == ["deb"] and len(words) > 2 and words[2] == suite \
                    and words[1].startswith(("http://", "https://")):
                return words[1]
    for path in sorted((apt / "sources.list.d").glob("*.sources")):
        for stanza in _text(path).split("\n\n"):
            fields = _deb822(stanza)
            if ("deb" in fields.get("types", "").split()
                    and suite in fields.get("suites", "").split()
                    and fields.get("enabled", "yes").lower() != "no"):
                uris = [uri for uri in fields.get("uris", "").split()
                        if uri.startswith(("http://", "https://"))]
                if uris:
                    return uris[0]
    return None


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _deb822(stanza: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in stanza.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if line[0].isspace() and fields:          # a continuation line
            last = next(reversed(fields))
            fields[last] += " " + line.strip()
            continue
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    return fields


def debootstrap(root: Path, log: Path, mirror: str | None) -> None:
    _run("debootstrap", ["debootstrap", "--arch=arm64", "--variant=minbase", SUITE, str(root),
                         *([mirror] if mirror else [])], log)


def install_packages(root: Path, log: Path) -> None:
    """PACKAGES installed in the root by its own apt-get (run under qemu), with /proc mounted."""
    _replace_file(Path("/etc/resolv.conf"), root / "etc" / "resolv.conf")
    proc = root / "proc"
    _run("mount /proc", ["mount", "-t", "proc", "proc", str(proc)], log)
    try:
        _chroot("apt-get update", root, ["apt-get", "update"], log)
        _chroot("apt-get install", root, ["apt-get", "install", "-y", "--no-install-recommends",
                                          *PACKAGES], log)
        _chroot("apt-get clean", root, ["apt-get", "clean"], log)
    finally:
        _quiet(["umount", str(proc)])


def copy_ca_bundle(root: Path, host_ca: Path = HOST_CA) -> None:
    """This host's CA bundle over the root's own (pip in the root then trusts what pip here
    trusts); the root's update-ca-certificates would write its own again."""
    if host_ca.is_file():
        _replace_file(host_ca, root / "etc" / "ssl" / "certs" / "ca-certificates.crt")


def _replace_file(source: Path, target: Path) -> None:
    """SOURCE's content at TARGET inside the root: a link there is removed, never followed
    (it would point at this host's own file)."""
    if target.is_symlink():
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)


def disk_usage(root: Path) -> int:
    """The root's bytes on disk (du -sxb)."""
    done = subprocess.run(["du", "-sxb", str(root)], capture_output=True, text=True)
    return int(done.stdout.split()[0]) if done.returncode == 0 and done.stdout else 0


def check(root: Path) -> str:
    """platform.machine() as the root's own python3 reports it."""
    done = subprocess.run(["chroot", str(root), "/usr/bin/python3", "-c", CHECK_CODE],
                          capture_output=True, text=True, env=CHROOT_ENV, timeout=300)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise StepFailed(f"chroot {root} /usr/bin/python3 failed: {last}")
    return done.stdout.strip()


def _chroot(step: str, root: Path, argv: list[str], log: Path) -> None:
    _run(step, ["chroot", str(root), *argv], log, env=CHROOT_ENV)


def _run(step: str, argv: list[str], log: Path, env: dict | None = None) -> None:
    with log.open("a") as sink:
        sink.write(f"$ {' '.join(argv)}\n")
        sink.flush()
        done = subprocess.run(argv, stdout=sink, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        lines = [line for line in _text(log).splitlines() if line.strip()]
        raise StepFailed(f"{step} failed (exit {done.returncode}): "
                         f"{lines[-1].strip() if lines else 'no output'}; log: {log}")


def remove_root(root: Path) -> None:
    """An unfinished root removed: whatever is still mounted in it first (a /proc left by an
    interrupted build must not be walked into)."""
    for point in sorted(_mounts_under(root), reverse=True):
        _quiet(["umount", "-l", point])
    if _mounts_under(root):
        raise StepFailed(f"{root} still has mounts in it ({_mounts_under(root)[0]}): unmount "
                         f"them, then run again")
    shutil.rmtree(root, ignore_errors=True)


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve()) + "/"
    points = [line.split()[1].replace("\\040", " ") for line in _text(Path("/proc/self/mounts"))
              .splitlines() if len(line.split()) > 1]
    return [point for point in points if point.startswith(prefix)]


def build(root: Path, say=print) -> dict:
    """The root built from nothing, each step timed; its stamp (written last)."""
    if os.geteuid() != 0:
        raise Unavailable("building the root needs root (debootstrap, chroot, mount): run it "
                          "with sudo")
    remove_root(root)
    root.mkdir(parents=True)
    log = root.with_name(root.name + ".log")
    log.write_text("")
    mirror = debian_mirror()
    steps = {}
    for name, step in (("debootstrap", lambda: debootstrap(root, log, mirror)),
                       ("packages", lambda: install_packages(root, log)),
                       ("ca bundle", lambda: copy_ca_bundle(root))):
        say(f"{name} ...")
        start = time.monotonic()
        step()
        steps[name] = round(time.monotonic() - start, 1)
    stamp = {"suite": SUITE, "arch": "arm64", "mirror": mirror or "debootstrap's default",
             "packages": list(PACKAGES), "steps_s": steps, "bytes": disk_usage(root),
             "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    stamp_path(root).write_text(json.dumps(stamp, indent=1) + "\n")
    return stamp


def cached_stamp(root: Path) -> dict | None:
    """The stamp of a finished root, if there is one (and its python3)."""
    try:
        stamp = json.loads(stamp_path(root).read_text())
    except (OSError, ValueError):
        return None
    return stamp if (root / "usr" / "bin" / "python3").exists() else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n", 1)[0]
    parser.add_argument("--check", action="store_true",
                        help="run the root's python3 through chroot and print its "
                             "platform.machine() (aarch64)")


def run(args: argparse.Namespace) -> int:
    say = lambda line: print(f"arm-root: {line}", flush=True)     # noqa: E731
    root = root_dir()
    try:
        check_tools()
        ensure_binfmt()
        stamp = cached_stamp(root)
        fresh = stamp is None
        if fresh:
            say(f"building an aarch64 Debian {SUITE} root in {root} (minutes, once)")
            stamp = build(root, say=say)
        size = disk_usage(root) or stamp["bytes"]
        took = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in stamp["steps_s"].items())
        say(f"{root}: {size / 1e6:.0f} MB; {'built' if fresh else 'cached, built'} in {took} "
            f"(mirror: {stamp['mirror']})")
        if args.check:
            start = time.monotonic()
            machine = check(root)
            say(f"chroot python3: {machine} ({time.monotonic() - start:.1f} s)")
            return 0 if machine == "aarch64" else 1
    except Unavailable as exc:
        print(f"sled lab arm-root: {exc}", file=sys.stderr, flush=True)
        return 2
    except (StepFailed, subprocess.TimeoutExpired) as exc:
        print(f"sled lab arm-root: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0
