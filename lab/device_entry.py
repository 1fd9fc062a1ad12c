"""`sled lab device`: a device container's entrypoint in the compose lab.

Every replica of the compose services `device` and `device-arm64` runs this. It
  1. takes a slot of the scenario's fleet of its own architecture (platform.machine(): an arm64
     replica takes only the slots of `arch: arm64` groups): the first index whose claim file it
     can create (os.open O_CREAT|O_EXCL on the shared state folder, so two replicas never get the
     same one; a restarted container finds its own claim again by its host name);
  2. applies the slot's link profile: `tc qdisc ... netem` on eth0 when the kernel has netem,
     else the daemon's user-space emulation (SLED_DEVICE_EMULATION__LINK), and says which in
     its slot file;
  3. writes the slot file (id, address, API port, which link emulation ran, its machine) for
     the lab runner;
  4. waits for its own broker password: `sled lab compose` reads the slot file and writes that
     slot's password into PASSWORD_FILE inside this container (docker exec); the container
     mounts only state/ and scenario.yaml, never the broker's credentials.json;
  5. for a calibrated:NAME drafter, waits for the trace file `sled lab run` writes into
     state/traces once it has the target's references, and drafts trace:FILE from it;
  6. execs `sled device` with the slot's id, drafter and device profile and the broker login.

Only light modules are imported: the device image has no torch.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

from lab.arch import machine_arch
from lab.profiles import link_profile
from lab.scenario import ScenarioError, load_scenario
from lab.traces.calibrated import is_calibrated, trace_file, trace_spec
from lab.waiting import wait_until_sync
from sled.cache import cache_dir

API_PORT = 8000
SERVER = "server:50051"
PROXY = "proxy:50051"       # server.replicas > 1: the replicas behind HAProxy (profile replicas)
BROKER_HOST = "broker"
# Inside the container only (not a mount): this device's broker password, from sled lab compose.
PASSWORD_FILE = "/tmp/sled-mqtt-password"
PASSWORD_WAIT_S = 300.0
TRACES = "traces"           # under the state folder: calibrated traces from sled lab run
TRACES_WAIT_S = 900.0       # the runner computes the target's references first
# Built-in GGUF drafters by the file the host's sled cache holds (the device image has no models
# extra, so gguf:ALIAS is passed to the daemon as the file's path).
GGUF_FILES = {"gemma3-270m": "gguf/gemma-3-270m-q4_k_m.gguf"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", default=os.environ.get("SLED_LAB_SCENARIO",
                                                             "/lab/scenario.yaml"),
                        help="the scenario file (default: /lab/scenario.yaml)")
    parser.add_argument("--state", default=os.environ.get("SLED_LAB_STATE", "/lab/state"),
                        help="the folder the replicas share for their slot claims")
    parser.add_argument("--password-file", default=PASSWORD_FILE,
                        help="where this device's broker password arrives (default: "
                             f"{PASSWORD_FILE})")
    parser.add_argument("--interface", default="eth0", help="where netem goes (default: eth0)")
    parser.add_argument("--dry-run", action="store_true",
                        help="claim and report, print the daemon's environment, do not exec it")


def run(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.scenario)
        slots = scenario.slots()
    except ScenarioError as exc:
        print(f"sled lab device: {exc}", file=sys.stderr)
        return 2
    arch = machine_arch()
    slot = claim_slot(Path(args.state) / "slots", slots, socket.gethostname(), arch)
    if slot is None:
        print(f"sled lab device: every one of the scenario's {len(slots)} slots this {arch} "
              "container could take is taken; scale each device service to its slots",
              file=sys.stderr)
        return 2
    emulation = apply_link(slot.link, args.interface)
    write_slot_file(Path(args.state) / "slots", slot, emulation)
    password = "" if args.dry_run else wait_password(Path(args.password_file))
    if password is None:
        print(f"sled lab device: no broker password for {slot.id} arrived in "
              f"{args.password_file} within {PASSWORD_WAIT_S:.0f} s", file=sys.stderr)
        return 3
    if is_calibrated(slot.drafter) and not args.dry_run:
        if wait_file(trace_file(Path(args.state) / TRACES, slot.drafter), TRACES_WAIT_S) is None:
            print(f"sled lab device: the traces of {slot.drafter} did not arrive in "
                  f"{Path(args.state) / TRACES} within {TRACES_WAIT_S:.0f} s", file=sys.stderr)
            return 3
    env = daemon_env(slot, emulation, password, Path(args.state) / TRACES,
                     server=PROXY if scenario.server.replicas > 1 else SERVER)
    if args.dry_run:
        print(json.dumps({k: v for k, v in env.items() if k.startswith("SLED_DEVICE_")
                          and "PASSWORD" not in k}, indent=2))
        return 0
    os.execvpe("sled", ["sled", "device"], {**os.environ, **env})


def claim_slot(folder: Path, slots: list, host: str, arch: str | None = None):
    """This container's slot: its earlier claim (a restart), else the first free one; with
    ARCH, only a slot whose arch is ARCH or unset."""
    folder.mkdir(parents=True, exist_ok=True)
    if arch is not None:
        slots = [slot for slot in slots if slot.arch in (None, arch)]
    for slot in slots:
        claim = folder / str(slot.index)
        if claim.exists() and claim.read_text().strip() == host:
            return slot
    for slot in slots:
        try:
            fd = os.open(folder / str(slot.index), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as out:
            out.write(host + "\n")
        return slot
    return None


def wait_password(path: Path, timeout_s: float = PASSWORD_WAIT_S) -> str | None:
    """This device's password once sled lab compose has written it (renamed into place whole)."""
    found = wait_file(path, timeout_s)
    return None if found is None else found.read_text().strip()


def wait_file(path: Path, timeout_s: float) -> Path | None:
    """PATH once it exists (its writer renames it into place whole), or None after timeout_s."""
    return wait_until_sync(lambda: path if path.is_file() else None, timeout_s)


def wait_slot_files(folder: Path, count: int, timeout_s: float) -> list[dict]:
    """The first `count` slot files the replicas write, waiting for all of them (the one reader
    of slot files: sled lab compose and the lab's ComposeFleet both use it); TimeoutError."""
    def enough() -> list[Path] | None:
        found = sorted(folder.glob("*.json"), key=lambda p: int(p.stem))
        return found if len(found) >= count else None

    found = wait_until_sync(enough, timeout_s)
    if found is None:
        raise TimeoutError(f"only {len(list(folder.glob('*.json')))} of {count} device containers "
                           f"took a slot within {timeout_s:.0f} s")
    return [json.loads(p.read_text()) for p in found[:count]]


def write_slot_file(folder: Path, slot, emulation: str) -> Path:
    """<index>.json, written whole (rename) so the runner never reads half of it."""
    info = {"index": slot.index, "id": slot.id, "device": slot.device, "link": slot.link,
            "drafter": slot.drafter, "host": host_address(), "container": socket.gethostname(),
            "port": API_PORT, "link_emulation": emulation, "machine": platform.machine()}
    path = folder / f"{slot.index}.json"
    partial = folder / f".{slot.index}.json.partial"
    partial.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(partial, path)
    return path


def host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


def netem_args(link_spec: str, interface: str) -> list[str]:
    """tc's arguments for a link profile: the whole round trip on this side's egress (replies
    come back undelayed, so a round trip takes rtt), jitter, and the rate when it has one."""
    p = link_profile(link_spec)
    argv = ["tc", "qdisc", "replace", "dev", interface, "root", "netem",
            "delay", f"{p.rtt_ms:g}ms"]
    if p.jitter_ms:
        argv.append(f"{p.jitter_ms:g}ms")
    if p.loss_pct:
        argv += ["loss", f"{p.loss_pct:g}%"]
    if p.bandwidth_mbps:
        argv += ["rate", f"{p.bandwidth_mbps:g}mbit"]
    return argv


def apply_link(link_spec: str, interface: str) -> str:
    """"netem" when tc could set it up, else "user-space" (the daemon emulates the link)."""
    try:
        done = subprocess.run(netem_args(link_spec, interface), capture_output=True, text=True)
    except FileNotFoundError:   # no tc in the image
        return "user-space"
    return "netem" if done.returncode == 0 else "user-space"


def drafter_spec(spec: str, cache: Path, traces: Path) -> str:
    """gguf:ALIAS becomes the GGUF file in the mounted cache, calibrated:NAME its trace file in
    the state folder; everything else is unchanged."""
    kind, _, arg = spec.partition(":")
    if kind == "gguf" and arg in GGUF_FILES and (cache / GGUF_FILES[arg]).is_file():
        return f"gguf:{cache / GGUF_FILES[arg]}"
    return trace_spec(spec, traces)


def daemon_env(slot, emulation: str, password: str, traces: Path,
               server: str = SERVER) -> dict[str, str]:
    """The device daemon's settings; SERVER: what it dials (the server, or the proxy)."""
    env = {
        "SLED_DEVICE_ID": slot.id,
        "SLED_DEVICE_DRAFTER": drafter_spec(slot.drafter, cache_dir(), traces),
        "SLED_DEVICE_SERVERS": json.dumps([server]),
        # The runner reaches each device's API over the compose network, so it listens beyond
        # loopback; the lab is a testbed on a private network with no published device ports,
        # so it serves the API with no key (sled device refuses that unless api_open is set).
        "SLED_DEVICE_HOST": "0.0.0.0",
        "SLED_DEVICE_API_OPEN": "true",
        "SLED_DEVICE_PORT": str(API_PORT),
        "SLED_DEVICE_EMULATION__DEVICE": slot.device,
        "SLED_DEVICE_MQTT__HOST": BROKER_HOST,
        "SLED_DEVICE_MQTT__USERNAME": slot.id,
        "SLED_DEVICE_MQTT__PASSWORD": password,
    }
    if emulation == "user-space":
        env["SLED_DEVICE_EMULATION__LINK"] = slot.link
    return env
