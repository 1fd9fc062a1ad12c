"""Mosquitto's files for a sled fleet: mosquitto.conf, a password file and an ACL that confines
each device to its own topics. `sled broker-config` writes them for a deployment and the lab for
each of its fleets, so both run with the same ACL.

    fleet = Fleet(devices=("dev-1", "dev-2"), servers={"gpu-1": "gpu-1"})
    files = BrokerFiles.write_fleet(folder, fleet, "sled", Listener(port=8883, tls=tls))
    files = BrokerFiles.write(folder, slots, "sled", Listener(port=1883))   # the lab
    files.conf, files.credentials["dev-1"], files.password("gpu-1")

Every user has a random password kept in folder/credentials.json (mode 0600). The ACL
(mosquitto.conf(5), "user" blocks):
  - a device reads and writes only `<prefix>/devices/<its id>/...` (writes status, telemetry,
    config/applied, responses/#; reads config and requests) and reads `<prefix>/servers/#`;
  - a server's user writes only its announcement `<prefix>/servers/<its server id>`;
  - an operator reads everything under the prefix and writes every device's config and requests.
The broker takes each login's user name as its client id (use_username_as_clientid), so no user
can take over another's connection or fire its last will with a forged client id; a user holds
one connection at a time (a second login of the same user ends the first).
The lab's users are each slot's device, "server" (announcing "lab-server") and two operators:
"lab" (requests and statuses) and "lab-config" (settings changes).
The conf names its files under `root`: the folder itself locally, or where a container mounts
it (/mosquitto/config), so compose uses the same files.
"""
from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from sled.wire.topics import check_topic_level, check_topic_prefix, device_topic, server_topic
from sled.pki import write_secret
from sled.printable import printable

if TYPE_CHECKING:
    from lab.scenario import DeviceSlot

SERVER_USER, LAB_USER, CONFIG_USER, SERVER_ID = "server", "lab", "lab-config", "lab-server"
# The user Mosquitto becomes when started as root without a `user` line in its conf.
BROKER_USER = "mosquitto"
DEVICE_WRITES = ("status", "telemetry", "config/applied", "responses/#")
DEVICE_READS = ("config", "requests")
OPERATOR_WRITES = ("config", "requests")


def passwd_binary() -> str:
    found = shutil.which("mosquitto_passwd") or shutil.which("/usr/bin/mosquitto_passwd")
    if not found:
        raise FileNotFoundError("mosquitto_passwd is not installed (Debian: apt-get install mosquitto)")
    return found


def check_user(name: object) -> str:
    """`name` when it can be a broker user: one topic level (it names the user's topics), no ':'
    (the password file's separator) and no leading '-' (mosquitto_passwd would read a flag)."""
    shown = printable(str(name))
    check_topic_level(name, f"the id {shown!r}")
    if ":" in name or name.startswith("-"):
        raise ValueError(f"the id {shown!r} cannot be a broker user: it holds ':' or starts "
                         f"with '-'")
    return name


def replica_login(index: int, server_id: str = SERVER_ID) -> tuple[str, str]:
    """The broker user and the server id of replica INDEX: the first is the lab's one server
    ("server", SERVER_ID), the others "server-1", SERVER_ID-1, ..."""
    return (SERVER_USER, server_id) if index == 0 else (f"{SERVER_USER}-{index}",
                                                         f"{server_id}-{index}")


@dataclass(frozen=True)
class Fleet:
    """Who logs in to the broker, each under a user name of its own."""
    devices: tuple[str, ...]
    servers: dict[str, str] = field(default_factory=dict)   # user -> the server id it announces
    operators: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for user in self.users:
            check_user(user)
        for server_id in self.servers.values():
            check_topic_level(server_id, f"the server id {printable(server_id)!r}")
        twice = [user for n, user in enumerate(self.users) if user in self.users[:n]]
        if twice:
            raise ValueError(f"{printable(twice[0])!r} is named twice: every device, server and "
                             f"operator needs a user name of its own")

    @classmethod
    def lab(cls, slots: list[DeviceSlot], server_id: str = SERVER_ID,
            replicas: int = 1) -> "Fleet":
        """The lab's fleet: a device per slot, "server" announcing `server_id` (and behind a
        proxy "server-1" announcing `server_id`-1, ...: a user per replica), operators "lab"
        and "lab-config"."""
        servers = dict(replica_login(i, server_id) for i in range(replicas))
        return cls(tuple(slot.id for slot in slots), servers, (LAB_USER, CONFIG_USER))

    @property
    def users(self) -> list[str]:
        return [*self.devices, *self.servers, *self.operators]


@dataclass(frozen=True, slots=True)
class BrokerTls:
    """The listener's TLS files (mosquitto.conf(5): cafile, certfile, keyfile)."""
    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True, slots=True)
class Listener:
    """Where Mosquitto listens and how; `root` is the broker files' folder as Mosquitto sees it
    (None: the folder itself)."""
    port: int = 1883
    bind: str | None = None
    root: str | None = None
    run_as: str | None = None
    log: str | None = None
    tls: BrokerTls | None = None


def acl_lines(fleet: Fleet, prefix: str) -> list[str]:
    """The ACL: one user block per device, then each server's and each operator's."""
    lines = ["# sled: each device only its own topics; each server only its announcement"]
    for device_id in fleet.devices:
        lines += ["", f"user {device_id}"]
        lines += [f"topic write {device_topic(prefix, device_id, leaf)}" for leaf in DEVICE_WRITES]
        lines += [f"topic read {device_topic(prefix, device_id, leaf)}" for leaf in DEVICE_READS]
        lines.append(f"topic read {server_topic(prefix, '#')}")
    for user, server_id in fleet.servers.items():
        lines += ["", f"user {user}", f"topic write {server_topic(prefix, server_id)}"]
    for user in fleet.operators:
        lines += ["", f"user {user}", f"topic read {prefix}/#"]
        lines += [f"topic write {device_topic(prefix, '+', leaf)}" for leaf in OPERATOR_WRITES]
    return lines


def conf_lines(root: str, listener: Listener) -> list[str]:
    """mosquitto.conf: one listener, passwords and the ACL required, the user name as the
    client id, TLS when it has files."""
    lines = [f"listener {listener.port}" + (f" {listener.bind}" if listener.bind else ""),
             "persistence false", "allow_anonymous false", f"password_file {root}/passwords",
             f"acl_file {root}/acl", "use_username_as_clientid true"]
    if listener.tls:       # clients prove who they are with passwords, not certificates
        lines += [f"cafile {listener.tls.ca}", f"certfile {listener.tls.cert}",
                  f"keyfile {listener.tls.key}", "require_certificate false"]
    lines.append(f"log_dest file {listener.log}" if listener.log else "log_dest stdout")
    if listener.run_as:
        lines.append(f"user {listener.run_as}")
    return lines


@dataclass
class BrokerFiles:
    folder: Path
    credentials: dict[str, str]     # user -> password
    prefix: str
    server_id: str = SERVER_ID      # what the lab's "server" user announces

    @property
    def conf(self) -> Path:
        return self.folder / "mosquitto.conf"

    def password(self, user: str) -> str:
        return self.credentials[user]

    def forget_passwords(self) -> None:
        """Remove credentials.json once the fleet is down: a run's folder keeps no password."""
        (self.folder / "credentials.json").unlink(missing_ok=True)

    @classmethod
    def write(cls, folder: Path, slots: list[DeviceSlot], prefix: str = "sled",
              listener: Listener = Listener(), *, server_id: str = SERVER_ID,
              replicas: int = 1) -> "BrokerFiles":
        """The lab's files (Fleet.lab) into `folder`, for Mosquitto listening as `listener`
        says."""
        files = cls.write_fleet(folder, Fleet.lab(slots, server_id, replicas), prefix, listener)
        return replace(files, server_id=server_id)

    @classmethod
    def write_fleet(cls, folder: Path, fleet: Fleet, prefix: str = "sled",
                    listener: Listener = Listener()) -> "BrokerFiles":
        """Write conf, passwords, acl and credentials.json for `fleet` into `folder`."""
        check_topic_prefix(prefix)
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        credentials = {user: secrets.token_hex(16) for user in fleet.users}   # never a leading "-"
        _write_passwords(folder / "passwords", credentials, listener.run_as)
        (folder / "acl").write_text("\n".join(acl_lines(fleet, prefix)) + "\n")
        root = listener.root or str(folder.resolve())
        (folder / "mosquitto.conf").write_text("\n".join(conf_lines(root, listener)) + "\n")
        write_secret(folder / "credentials.json", json.dumps(credentials, indent=2) + "\n")
        return cls(folder, credentials, prefix)

    @classmethod
    def read(cls, folder: Path, prefix: str = "sled", server_id: str = SERVER_ID) -> "BrokerFiles":
        credentials = json.loads((Path(folder) / "credentials.json").read_text())
        return cls(Path(folder), credentials, prefix, server_id)


def _write_passwords(path: Path, credentials: dict[str, str], run_as: str | None) -> None:
    """Hashed with mosquitto_passwd -b (the first call creates the file), 0600, owned by the
    user Mosquitto reads it as."""
    path.unlink(missing_ok=True)
    for i, (user, password) in enumerate(credentials.items()):
        flags = ["-b", "-c"] if i == 0 else ["-b"]
        done = subprocess.run([passwd_binary(), *flags, str(path), user, password],
                              capture_output=True)
        if done.returncode != 0:     # its message, never the command line: that has the password
            raise ValueError(f"mosquitto_passwd refused the user {printable(user)!r}: "
                             f"{printable(done.stderr.strip() or done.stdout.strip())}")
    path.chmod(0o600)
    give_to_broker_user(path, run_as)


def give_to_broker_user(path: Path, run_as: str | None) -> None:
    """Mosquitto 2 started as root reads its password file after it becomes `run_as` (default:
    its own user, mosquitto): as root, hand the file to that user when it exists. Otherwise the
    file stays its writer's, the user a broker started without root runs as."""
    if os.geteuid() != 0:
        return
    try:
        user = pwd.getpwnam(run_as or BROKER_USER)
    except KeyError:
        return
    os.chown(path, user.pw_uid, user.pw_gid)


def passwords_owner(folder: Path) -> str:
    """Who owns folder/passwords (the only user that can read it), by name where it has one."""
    uid = (Path(folder) / "passwords").stat().st_uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
