"""The lab broker's files: mosquitto.conf, a password file and an ACL that confines each device.

    files = BrokerFiles.write(folder, slots, prefix="sled", root=None, port=1883)
    files.conf, files.credentials["dev-00"], files.password("lab")

Users: every device id, "server" and "lab", each with a random password kept in
folder/credentials.json (mode 0600). The ACL (mosquitto.conf(5), "user" blocks):
  - a device reads and writes only `<prefix>/devices/<its id>/...` (writes status, telemetry,
    config/applied, responses/#; reads config and requests) and reads `<prefix>/servers/#`;
  - "server" writes only its announcement `<prefix>/servers/<server id>`;
  - "lab" reads everything under the prefix and writes every device's config and requests.
The conf names its files under `root`: the folder itself locally, or where a container mounts
it (/mosquitto/config), so compose uses the same files.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from lab.scenario import DeviceSlot

SERVER_USER, LAB_USER, SERVER_ID = "server", "lab", "lab-server"
DEVICE_WRITES = ("status", "telemetry", "config/applied", "responses/#")
DEVICE_READS = ("config", "requests")


def passwd_binary() -> str:
    found = shutil.which("mosquitto_passwd") or shutil.which("/usr/bin/mosquitto_passwd")
    if not found:
        raise FileNotFoundError("mosquitto_passwd is not installed (Debian: apt-get install mosquitto)")
    return found


def acl_lines(device_ids: list[str], prefix: str, server_id: str = SERVER_ID) -> list[str]:
    """The ACL: one user block per device, then the server's and the lab's."""
    lines = ["# sled lab: each device only its own topics; the server only its announcement"]
    for device_id in device_ids:
        own = f"{prefix}/devices/{device_id}"
        lines += ["", f"user {device_id}"]
        lines += [f"topic write {own}/{leaf}" for leaf in DEVICE_WRITES]
        lines += [f"topic read {own}/{leaf}" for leaf in DEVICE_READS]
        lines.append(f"topic read {prefix}/servers/#")
    lines += ["", f"user {SERVER_USER}", f"topic write {prefix}/servers/{server_id}"]
    lines += ["", f"user {LAB_USER}", f"topic read {prefix}/#",
              f"topic write {prefix}/devices/+/config", f"topic write {prefix}/devices/+/requests"]
    return lines


def conf_lines(root: str, port: int, bind: str | None, run_as: str | None, log: str | None) -> list[str]:
    lines = [f"listener {port}" + (f" {bind}" if bind else ""), "persistence false",
             "allow_anonymous false", f"password_file {root}/passwords", f"acl_file {root}/acl"]
    lines.append(f"log_dest file {log}" if log else "log_dest stdout")
    if run_as:
        lines.append(f"user {run_as}")
    return lines


@dataclass
class BrokerFiles:
    folder: Path
    credentials: dict[str, str]     # user -> password
    prefix: str
    server_id: str = SERVER_ID

    @property
    def conf(self) -> Path:
        return self.folder / "mosquitto.conf"

    def password(self, user: str) -> str:
        return self.credentials[user]

    def forget_passwords(self) -> None:
        """Remove credentials.json once the fleet is down: a run's folder keeps no password."""
        (self.folder / "credentials.json").unlink(missing_ok=True)

    @classmethod
    def write(cls, folder: Path, slots: list[DeviceSlot], prefix: str = "sled", *,
              root: str | None = None, port: int = 1883, bind: str | None = None,
              run_as: str | None = None, log: str | None = None,
              server_id: str = SERVER_ID) -> "BrokerFiles":
        """Write conf, passwords, acl and credentials.json into `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        users = [slot.id for slot in slots] + [SERVER_USER, LAB_USER]
        credentials = {user: secrets.token_hex(16) for user in users}   # never a leading "-"
        _write_passwords(folder / "passwords", credentials)
        (folder / "acl").write_text("\n".join(acl_lines([s.id for s in slots], prefix, server_id)) + "\n")
        root = root or str(folder.resolve())
        (folder / "mosquitto.conf").write_text("\n".join(conf_lines(root, port, bind, run_as, log)) + "\n")
        _write_secret(folder / "credentials.json", json.dumps(credentials, indent=2) + "\n")
        return cls(folder, credentials, prefix, server_id)

    @classmethod
    def read(cls, folder: Path, prefix: str = "sled", server_id: str = SERVER_ID) -> "BrokerFiles":
        credentials = json.loads((Path(folder) / "credentials.json").read_text())
        return cls(Path(folder), credentials, prefix, server_id)


def _write_passwords(path: Path, credentials: dict[str, str]) -> None:
    """Hashed with mosquitto_passwd -b (the first call creates the file)."""
    path.unlink(missing_ok=True)
    for i, (user, password) in enumerate(credentials.items()):
        flags = ["-b", "-c"] if i == 0 else ["-b"]
        subprocess.run([passwd_binary(), *flags, str(path), user, password], check=True,
                       capture_output=True)
    path.chmod(0o644)   # hashes only; a broker running as its own user must read them


def _write_secret(path: Path, text: str) -> None:
    """Created 0600 from the start, so the passwords are never readable by others."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
