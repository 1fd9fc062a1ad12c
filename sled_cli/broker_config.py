"""`sled broker-config DIR --devices dev-1,dev-2 [--servers gpu-1] [--tls-dir CERTS_DIR]`: the
Mosquitto conf, password file and ACL of a fleet, the same files the lab runs with (lab.broker):
each device may write only its own topics, each verify server only its own announcement. Every
user's password is kept in DIR/credentials.json (0600).

    sled certs certs --devices dev-1,dev-2
    sled broker-config broker --devices dev-1,dev-2 --servers gpu-1 --tls-dir certs
    mosquitto -c broker/mosquitto.conf
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from lab.broker import BrokerFiles, BrokerTls, Fleet, Listener, passwords_owner
from sled.wire.topics import DEFAULT_PREFIX
from sled.pki import Pki
from sled_cli.certs import id_list
from sled.flags import one_line, positive_int

PLAIN_PORT, TLS_PORT = 1883, 8883
# Prints one user's password from credentials.json: python3 -c READ_PASSWORD FILE USER
READ_PASSWORD = "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])"


def add_arguments(parser) -> None:
    parser.add_argument("folder", type=Path, metavar="DIR", help="where the files go")
    parser.add_argument("--devices", type=id_list, required=True, metavar="ID,...",
                        help="device ids, comma separated (each device's `sled device --id`)")
    parser.add_argument("--servers", type=id_list, default=[], metavar="ID,...",
                        help="verify server ids (`sled serve --server-id`), each its own user "
                             "that may announce only that id")
    parser.add_argument("--operators", type=id_list, default=[], metavar="USER,...",
                        help="users that read every topic under the prefix and send every "
                             "device its config and requests (apps, dashboards)")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="the MQTT topic prefix")
    parser.add_argument("--tls-dir", type=Path, metavar="CERTS_DIR",
                        help="a `sled certs` folder: the listener speaks TLS with its ca.pem, "
                             "server.pem and server.key (clients still log in with passwords)")
    parser.add_argument("--port", type=positive_int, default=None,
                        help=f"the listener's port (default: {TLS_PORT} with --tls-dir, "
                             f"else {PLAIN_PORT})")
    parser.add_argument("--bind", default=None, metavar="ADDRESS",
                        help="listen on this address only (default: every interface)")
    parser.add_argument("--run-as", default=None, metavar="USER",
                        help="the user Mosquitto runs as when started as root (default: "
                             "Mosquitto's own, `mosquitto`)")


def listener(args) -> Listener:
    """The deployment's listener: TLS from a `sled certs` folder if given, its port by default
    the one for TLS or plain MQTT."""
    tls = broker_tls(args.tls_dir) if args.tls_dir is not None else None
    port = args.port or (TLS_PORT if tls else PLAIN_PORT)
    if port > 65535:
        raise ValueError(f"--port {port} is outside 1..65535")
    return Listener(port, args.bind, run_as=args.run_as, tls=tls)


def broker_tls(tls_dir: Path) -> BrokerTls:
    """The CA, server certificate and key of a `sled certs` folder, as absolute paths."""
    pki = Pki.at(tls_dir)
    for path in (pki.ca, pki.server_cert, pki.server_key):
        if not path.is_file():
            raise ValueError(f"--tls-dir {tls_dir} has no {path.name}: make it with "
                             f"`sled certs {tls_dir}`")
    return BrokerTls(pki.ca.resolve(), pki.server_cert.resolve(), pki.server_key.resolve())


def usage(files: BrokerFiles, fleet: Fleet, where: Listener) -> list[str]:
    """How to run the broker, and each device's and server's login to it."""
    folder = files.folder.resolve()
    login = _login_options(files.prefix, where)
    lines = [f"{files.folder}: mosquitto.conf, passwords, acl, credentials.json (every user's "
             f"password, 0600)", "", "The broker:",
             f"  mosquitto -c {_quoted(files.conf.resolve())}",
             f"  (passwords is 0600 and {passwords_owner(files.folder)}'s: Mosquitto must read it "
             f"as that user; each user's name is its client id, one connection per user)", ""]
    if where.tls:
        lines += _tls_notes(where.tls)
    lines.append("Each device (the password may also be --mqtt.password):")
    for device_id in fleet.devices:
        lines.append(f"  SLED_DEVICE_MQTT__PASSWORD={_password(folder, device_id)} sled device "
                     f"--id {_quoted(device_id)} --mqtt.host BROKER "
                     + "".join(f"--mqtt.{name} {value} " for name, value in login)
                     + f"--mqtt.username {_quoted(device_id)}")
    if fleet.servers:
        lines += ["", "Each verify server:"]
    for server_id in fleet.servers:
        lines.append(f"  SLED_MQTT_PASSWORD={_password(folder, server_id)} sled serve --model M "
                     f"--server-id {_quoted(server_id)} --mqtt-host BROKER "
                     + "".join(f"--mqtt-{name} {value} " for name, value in login)
                     + f"--mqtt-username {_quoted(server_id)}")
    if fleet.operators:
        lines += ["", "Each operator (any MQTT client; every topic under the prefix to read, "
                      "every device's config and requests to write):"]
    for user in fleet.operators:
        lines.append(f"  username {_quoted(user)}, password {_password(folder, user)}")
    return lines


def _tls_notes(tls: BrokerTls) -> list[str]:
    """What a TLS listener asks of the machines: a readable key, and clients that dial a name
    the certificate carries."""
    return [f"Mosquitto reads {tls.key} as the user it runs as (started as root: `mosquitto`, "
            f"or --run-as); let it, e.g. `chgrp mosquitto {_quoted(tls.key)} && chmod 640 "
            f"{_quoted(tls.key)}`.",
            f"Clients dial BROKER by a name {tls.cert.name} carries (sled certs --server-name).",
            ""]


def _login_options(prefix: str, where: Listener) -> list[tuple[str, str]]:
    """The MQTT settings a client needs besides host and credentials, as (option, shell word)."""
    options = [("port", str(where.port))]
    if where.tls:
        options.append(("ca-file", _quoted(where.tls.ca)))
    if prefix != DEFAULT_PREFIX:
        options.append(("topic-prefix", _quoted(prefix)))
    return options


def _password(folder: Path, user: str) -> str:
    """A shell word that reads `user`'s password from credentials.json when the line runs."""
    read = shlex.join(["python3", "-c", READ_PASSWORD, str(folder / "credentials.json"), user])
    return f'"$({read})"'


def _quoted(word: Path | str) -> str:
    return shlex.quote(str(word))


def run(args) -> int:
    try:
        fleet = Fleet(tuple(args.devices), {server: server for server in args.servers},
                      tuple(args.operators))
        where = listener(args)
        files = BrokerFiles.write_fleet(args.folder, fleet, args.prefix, where)
    except (ValueError, OSError) as exc:
        print(f"sled broker-config: {one_line(exc)}", file=sys.stderr)
        return 2
    print("\n".join(usage(files, fleet, where)))
    return 0
