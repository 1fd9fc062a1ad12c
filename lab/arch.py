"""Device architectures in the compose lab: which a scenario's devices run on, and whether this
machine can run them.

A fleet group's `arch` (amd64 or arm64; none: this machine's own) picks the platform of its
device containers. A foreign one runs under qemu-user through binfmt_misc: on an x86-64 host
the arm64 devices run the arm64 device image (lab.images_arm64) as linux/arm64 containers.
"""
from __future__ import annotations

import platform
from pathlib import Path

from lab import arm_root

ARCHES = ("amd64", "arm64")
# platform.machine() -> the platform's architecture
MACHINES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
BINFMT = arm_root.BINFMT
INSTALL = "apt-get install qemu-user-static binfmt-support"


class ArchUnavailable(RuntimeError):
    """This machine cannot run the scenario's devices of another architecture: one line."""


def machine_arch(machine: str | None = None) -> str:
    """This machine's architecture (amd64, arm64), or its platform.machine() when unknown."""
    machine = machine or platform.machine()
    return MACHINES.get(machine.lower(), machine.lower())


def check_arch(value: str | None) -> str | None:
    """A fleet group's arch: amd64, arm64 or none; anything else is refused with the choices."""
    if value is None or value in ARCHES:
        return value
    hint = f" (write {MACHINES[value.lower()]})" if value.lower() in MACHINES else ""
    raise ValueError(f"unknown architecture {value!r}{hint}: arch is one of "
                     f"{', '.join(ARCHES)} (the device containers' platform, linux/ARCH)")


def slot_arch(slot, host: str | None = None) -> str:
    """The architecture a slot's device runs on: its group's, else this machine's."""
    return slot.arch or host or machine_arch()


def foreign_slots(slots, host: str | None = None) -> list:
    """The slots whose devices run on another architecture than this machine's."""
    host = host or machine_arch()
    return [slot for slot in slots if slot_arch(slot, host) != host]


def service(arch: str, host: str | None = None) -> str:
    """The compose service of a device of ARCH: `device` (this machine's) or `device-ARCH`."""
    return "device" if arch == (host or machine_arch()) else f"device-{arch}"


def emulation_ready(slots, host: str | None = None, binfmt: Path | None = None) -> None:
    """The slots' foreign devices can run here (qemu-aarch64 in binfmt_misc, registered when
    it is installed but off and this is root), or ArchUnavailable saying what to install."""
    host = host or machine_arch()
    foreign = foreign_slots(slots, host)
    if not foreign:
        return
    arches = sorted({slot_arch(slot, host) for slot in foreign})
    if host != "amd64" or arches != ["arm64"]:
        raise ArchUnavailable(f"devices of {', '.join(arches)} on this {host} machine: the lab "
                              "runs foreign devices as arm64 containers on an amd64 host only")
    try:
        arm_root.ensure_binfmt(binfmt or BINFMT)
    except arm_root.Unavailable as exc:
        ids = ", ".join(slot.id for slot in foreign)
        raise ArchUnavailable(f"the arm64 devices ({ids}) run under qemu-user through "
                              f"binfmt_misc, which this machine lacks ({str(exc).rstrip('.')}); "
                              f"install it: {INSTALL}") from None
