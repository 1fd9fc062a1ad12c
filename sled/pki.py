"""A development PKI in one folder (`sled certs` makes it): a CA, the verify server's certificate,
and per device a client certificate and a bearer token.

    DIR/ca.pem, ca.key                        the CA; kept when DIR has one, so devices added
                                              later join the same CA
    DIR/server.pem, server.key                the server (and the MQTT broker's TLS listener):
                                              localhost, this host, 127.0.0.1, ::1, server names
    DIR/devices/<id>/client.pem, client.key   a device: its id as CN and DNS name, clientAuth
    DIR/devices/<id>/token                    its bearer token
    DIR/tokens                                sled serve --auth-tokens: every device's token,
                                              pinned to its certificate (cert=<id>)

Keys, tokens and the token file are 0600 from creation (write_secret), certificates 0644.

    pki = make_certs(Path("certs"), ["dev-1", "dev-2"], server_names=["gpu-1.lan"])
    pki.server_cert, pki.devices["dev-1"].token
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sled.wire.topics import check_topic_level, is_topic_level
from sled.printable import printable

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey

CA_DAYS, LEAF_DAYS = 3650, 825
CA_NAME = "sled development CA"
SERVER_NAME = "sled verify server"
SERVER_HOSTS = ("localhost", "127.0.0.1", "::1")          # with this host's name and --server-name
CLOCK_SKEW = datetime.timedelta(minutes=5)                 # valid from a little before now
TOKEN_FILE_HEADER = "# DEVICE_ID TOKEN [cert=NAME] [sessions=N] [tokens_per_s=R]"


@dataclass(frozen=True, slots=True)
class DeviceFiles:
    """One device's certificate, key and bearer token."""
    cert: Path
    key: Path
    token: Path

    @classmethod
    def at(cls, folder: Path) -> "DeviceFiles":
        return cls(folder / "client.pem", folder / "client.key", folder / "token")

    def exist(self) -> bool:
        return all(path.is_file() for path in (self.cert, self.key, self.token))


@dataclass(frozen=True)
class Pki:
    """The paths of a `sled certs` folder, every device it holds, and what this run made."""
    folder: Path
    devices: dict[str, DeviceFiles]
    made: tuple[str, ...] = ()

    @classmethod
    def at(cls, folder: Path, made: tuple[str, ...] = ()) -> "Pki":
        """The folder as it is: a device is a subfolder of devices/ that holds all its files."""
        root = Path(folder) / "devices"
        found = sorted(d.name for d in root.iterdir() if is_topic_level(d.name)) \
            if root.is_dir() else []
        devices = {name: DeviceFiles.at(root / name) for name in found}
        return cls(Path(folder), {n: f for n, f in devices.items() if f.exist()}, made)

    @property
    def ca(self) -> Path:
        return self.folder / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.folder / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.folder / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.folder / "server.key"

    @property
    def tokens(self) -> Path:
        return self.folder / "tokens"

    def device_files(self, device_id: str) -> DeviceFiles:
        return DeviceFiles.at(self.folder / "devices" / device_id)


@dataclass(frozen=True, slots=True)
class Authority:
    """The CA that signs: its certificate and key."""
    cert: x509.Certificate
    key: EllipticCurvePrivateKey


def make_certs(folder: Path, devices: list[str], server_names: list[str] = (),
               days: int = LEAF_DAYS, force: bool = False) -> Pki:
    """Make what `folder` lacks (with force: the server's and these devices' files anew), then
    bring the token file up to date (_write_token_file). ValueError for a bad device id or server name, or a CA that cannot
    sign."""
    wanted = [check_cert_id(device_id) for device_id in dict.fromkeys(devices)]
    requested = [general_name(name) for name in server_names]
    pki = Pki.at(folder)
    (pki.folder / "devices").mkdir(parents=True, exist_ok=True)
    authority, new_ca = _authority(pki)
    made = ["CA"] if new_ca else []
    if new_ca:       # what an earlier CA signed would no longer verify
        wanted = list(dict.fromkeys([*pki.devices, *wanted]))
    if force or new_ca or not _server_covers(pki, requested):
        _issue_server(authority, pki, server_names, days)
        made.append("server certificate")
    issued = []
    for device_id in wanted:
        if force or new_ca or not pki.device_files(device_id).exist():
            _issue_device(authority, device_id, pki.device_files(device_id), days)
            issued.append(device_id)
    made += [f"device {device_id}" for device_id in issued]
    pki = Pki.at(pki.folder, tuple(made))
    _write_token_file(pki, issued)
    return pki


def check_cert_id(device_id: object) -> str:
    """A device id that can name a certificate and a folder: one topic level in ASCII, and
    neither "." nor ".." (never a path)."""
    check_topic_level(device_id, f"the device id {printable(str(device_id))!r}")
    if not device_id.isascii() or device_id in (".", ".."):
        raise ValueError(f"the device id {printable(device_id)!r} cannot name a certificate and "
                         f"a folder: it must be ASCII, and neither '.' nor '..'")
    return device_id


def general_name(name: str) -> x509.GeneralName:
    """A subjectAltName entry: an IP address when `name` is one, else a DNS name."""
    from cryptography import x509   # optional: the certs extra

    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        pass
    if not name or not name.isascii() or not name.isprintable() or any(c.isspace() for c in name):
        raise ValueError(f"the server name {printable(name)!r} is not a DNS name or an IP address")
    return x509.DNSName(name)


def _authority(pki: Pki) -> tuple[Authority, bool]:
    """The folder's CA, or a new one saved there; True when it is new."""
    if pki.ca.exists() or pki.ca_key.exists():
        return _load_authority(pki), False
    authority = _new_authority()
    _save(authority.key, pki.ca_key, authority.cert, pki.ca)
    return authority, True


def _load_authority(pki: Pki) -> Authority:
    """The folder's CA; ValueError when half of it is missing or the key is not its own."""
    from cryptography import x509   # optional: the certs extra
    from cryptography.hazmat.primitives import serialization   # optional: the certs extra

    for path in (pki.ca, pki.ca_key):
        if not path.is_file():
            raise ValueError(f"{path} is missing: the CA needs both ca.pem and ca.key")
    try:
        cert = x509.load_pem_x509_certificate(pki.ca.read_bytes())
        key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the CA in {pki.folder} does not load: {exc}") from None
    if cert.public_key() != key.public_key():
        raise ValueError(f"{pki.ca_key} is not the key of {pki.ca}")
    return Authority(cert, key)


def _new_authority() -> Authority:
    """A self-signed CA that may sign leaf certificates only (path length 0)."""
    from cryptography import x509   # optional: the certs extra
    from cryptography.hazmat.primitives import hashes   # optional: the certs extra

    key = _new_key()
    name = _name(CA_NAME)
    builder = (_builder(name, name, key.public_key(), _days_from_now(CA_DAYS))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(_key_usage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True), critical=True))
    return Authority(builder.sign(key, hashes.SHA256()), key)


def _issue_server(authority: Authority, pki: Pki, server_names: list[str], days: int) -> None:
    from cryptography.x509.oid import ExtendedKeyUsageOID   # optional: the certs extra

    names = dict.fromkeys([SERVER_HOSTS[0], socket.gethostname(), *server_names, *SERVER_HOSTS[1:]])
    key, cert = _issue(authority, SERVER_NAME, [general_name(n) for n in names],
                       ExtendedKeyUsageOID.SERVER_AUTH, days)
    _save(key, pki.server_key, cert, pki.server_cert)


def _issue_device(authority: Authority, device_id: str, files: DeviceFiles, days: int) -> None:
    from cryptography import x509   # optional: the certs extra
    from cryptography.x509.oid import ExtendedKeyUsageOID   # optional: the certs extra

    files.cert.parent.mkdir(parents=True, exist_ok=True)
    key, cert = _issue(authority, device_id, [x509.DNSName(device_id)],
                       ExtendedKeyUsageOID.CLIENT_AUTH, days)
    _save(key, files.key, cert, files.cert)
    write_secret(files.token, secrets.token_urlsafe(32) + "\n")


def _issue(authority: Authority, common_name: str, names: list[x509.GeneralName], usage,
           days: int) -> tuple[EllipticCurvePrivateKey, x509.Certificate]:
    """A new key and its leaf certificate for `names`, signed by the CA, for one extended key
    usage (serverAuth or clientAuth); never valid past the CA."""
    from cryptography import x509   # optional: the certs extra
    from cryptography.hazmat.primitives import hashes   # optional: the certs extra

    key = _new_key()
    until = min(_days_from_now(days), authority.cert.not_valid_after_utc)
    ca_key = authority.key.public_key()
    builder = (_builder(_name(common_name), authority.cert.subject, key.public_key(), until)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(_key_usage(digital_signature=True), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.SubjectAlternativeName(names), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key),
                              critical=False))
    return key, builder.sign(authority.key, hashes.SHA256())


def _builder(subject: x509.Name, issuer: x509.Name, public_key,
             until: datetime.datetime) -> x509.CertificateBuilder:
    """The fields every certificate here shares: names, key, serial, validity, key identifier."""
    from cryptography import x509   # optional: the certs extra

    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(_now() - CLOCK_SKEW).not_valid_after(until)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))


def _key_usage(**allowed: bool) -> x509.KeyUsage:
    """KeyUsage with only the named uses allowed."""
    from cryptography import x509   # optional: the certs extra

    uses = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
            "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
    return x509.KeyUsage(**{use: allowed.get(use, False) for use in uses})


def _name(common_name: str) -> x509.Name:
    from cryptography import x509   # optional: the certs extra
    from cryptography.x509.oid import NameOID   # optional: the certs extra

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _new_key() -> EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec   # optional: the certs extra

    return ec.generate_private_key(ec.SECP256R1())


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _days_from_now(days: int) -> datetime.datetime:
    return _now() + datetime.timedelta(days=days)


def _server_covers(pki: Pki, requested: list[x509.GeneralName]) -> bool:
    """Whether the folder has a server certificate and key that carry every requested name."""
    from cryptography import x509   # optional: the certs extra

    if not (pki.server_cert.is_file() and pki.server_key.is_file()):
        return False
    cert = x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
    carried = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return all(name in carried for name in requested)


def _save(key: EllipticCurvePrivateKey, key_path: Path, cert: x509.Certificate,
          cert_path: Path) -> None:
    """The key 0600 from creation, then its certificate 0644."""
    from cryptography.hazmat.primitives import serialization   # optional: the certs extra

    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    write_secret(key_path, pem.decode("ascii"))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    cert_path.chmod(0o644)


def _write_token_file(pki: Pki, issued: list[str]) -> None:
    """The server's token file as its operator left it (a device removed from it stays removed,
    a line's quotas stay), with the new token of each device issued now: its line updated, or
    added pinned to its certificate."""
    lines = pki.tokens.read_text().splitlines() if pki.tokens.exists() else [TOKEN_FILE_HEADER]
    token = {device_id: pki.device_files(device_id).token.read_text().strip()
             for device_id in issued}
    for i, line in enumerate(lines):
        words = line.split("#", 1)[0].split()
        if words and words[0] in token:
            lines[i] = " ".join([words[0], token.pop(words[0]), *words[2:]])
    lines += [f"{device_id} {value} cert={device_id}" for device_id, value in token.items()]
    write_secret(pki.tokens, "\n".join(lines) + "\n")


def write_secret(path: Path, text: str) -> None:
    """Created 0600 from the start, so a secret is never readable by others."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
