"""`sled certs DIR [--devices dev-1,dev-2] [--server-name NAME ...]`: a development CA, the verify
server's certificate, and per device a client certificate and a bearer token, into one folder
(sled.pki says what each file is); then the flags that use them."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from sled.extras import require_extra
from sled.flags import one_line, positive_int
from sled.pki import CA_DAYS, LEAF_DAYS, Pki, make_certs

def add_arguments(parser) -> None:
    parser.add_argument("folder", type=Path, metavar="DIR", help="where the files go")
    parser.add_argument("--devices", type=id_list, default=[], metavar="ID,...",
                        help="device ids, comma separated (each device's `sled device --id`)")
    parser.add_argument("--server-name", action="append", default=[], metavar="NAME",
                        help="a DNS name or IP address the server is reached by (repeatable)")
    parser.add_argument("--days", type=positive_int, default=LEAF_DAYS,
                        help=f"how long the server and device certificates are valid (the CA: "
                             f"{CA_DAYS} days)")
    parser.add_argument("--force", action="store_true",
                        help="make the server's and the named devices' files anew (the CA stays)")


def id_list(text: str) -> list[str]:
    """A comma-separated flag value as a list ("dev-1,dev-2" -> ["dev-1", "dev-2"]); each id is
    checked where it is used, so a bad one is one line naming it."""
    return [part.strip() for part in text.split(",") if part.strip()]


def usage(pki: Pki) -> list[str]:
    """What was made and the commands that use it."""
    q = _quoted
    lines = [f"{pki.folder}: made {', '.join(pki.made)}" if pki.made
             else f"{pki.folder}: nothing to make (every file was there)",
             "", "The verify server:",
             f"  sled serve --model M --tls-cert {q(pki.server_cert)} "
             f"--tls-key {q(pki.server_key)} --tls-client-ca {q(pki.ca)} "
             f"--auth-tokens {q(pki.tokens)}",
             "", "The MQTT broker's TLS listener (the same server certificate):",
             f"  sled broker-config BROKER_DIR --devices {q(','.join(pki.devices) or 'ID,...')} "
             f"--tls-dir {q(pki.folder)}"]
    if pki.devices:
        lines += ["", "Each device:"]
    for device_id, files in pki.devices.items():
        # the token goes in the environment: a command line is visible to every local user
        lines.append(f"  SLED_DEVICE_TOKEN=\"$(cat {q(files.token)})\" sled device "
                     f"--id {q(device_id)} --server-ca {q(pki.ca)} "
                     f"--client-cert {q(files.cert)} --client-key {q(files.key)}")
    return lines


def _quoted(path: Path | str) -> str:
    """A path or id as one shell word."""
    return shlex.quote(str(path))


def run(args) -> int:
    require_extra("certs", "this command")
    try:
        pki = make_certs(args.folder, args.devices, args.server_name, args.days, args.force)
    except (ValueError, OSError) as exc:
        print(f"sled certs: {one_line(exc)}", file=sys.stderr)
        return 2
    print("\n".join(usage(pki)))
    return 0
