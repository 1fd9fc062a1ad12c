"""`sled certs`: a CA, a server certificate and per-device client certificates that verify as a
chain (names and key usages included) and pass a real TLS handshake; secrets 0600 from the
start; a second run keeps the CA and adds devices; a token file the server reads, each token
pinned to its device's certificate; a bad device id is one line and exit 2."""
from __future__ import annotations

import os
import socket
import ssl
import stat
from concurrent.futures import ThreadPoolExecutor
from ipaddress import ip_address

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from sled.pki import DeviceFiles, Pki, make_certs
from sled_cli.main import main
from tests.test_extras import assert_said, run_without
from verify_server.auth import digest, read_token_file


def load(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def policy(pki: Pki) -> PolicyBuilder:
    return PolicyBuilder().store(Store([load(pki.ca)]))


@pytest.fixture
def pki(tmp_path) -> Pki:
    return make_certs(tmp_path / "certs", ["dev-1", "dev-2"], ["gpu-1.lan", "10.1.2.3"])


def test_the_server_certificate_verifies_for_every_name_it_is_reached_by(pki):
    server = load(pki.server_cert)
    for name in ("localhost", socket.gethostname(), "gpu-1.lan"):
        policy(pki).build_server_verifier(x509.DNSName(name)).verify(server, [])
    for address in ("127.0.0.1", "::1", "10.1.2.3"):
        policy(pki).build_server_verifier(x509.IPAddress(ip_address(address))).verify(server, [])
    with pytest.raises(VerificationError):
        policy(pki).build_server_verifier(x509.DNSName("elsewhere.lan")).verify(server, [])
    usage = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]


def test_a_device_certificate_names_its_device_and_is_for_clients_only(pki):
    device = load(pki.devices["dev-1"].cert)
    verified = policy(pki).build_client_verifier().verify(device, [])
    assert list(verified.subjects) == [x509.DNSName("dev-1")]
    assert device.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "dev-1"
    device.verify_directly_issued_by(load(pki.ca))
    with pytest.raises(VerificationError):       # clientAuth only: never a server's certificate
        policy(pki).build_server_verifier(x509.DNSName("dev-1")).verify(device, [])
    other = make_certs(pki.folder.parent / "other", ["dev-1"])
    with pytest.raises(VerificationError):       # another CA's device is not this CA's
        policy(pki).build_client_verifier().verify(load(other.devices["dev-1"].cert), [])


def test_secrets_are_0600_and_certificates_0644_whatever_the_umask(tmp_path):
    before = os.umask(0)
    try:
        pki = make_certs(tmp_path / "certs", ["dev-1"])
    finally:
        os.umask(before)
    device = pki.devices["dev-1"]
    for secret in (pki.ca_key, pki.server_key, pki.tokens, device.key, device.token):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    for cert in (pki.ca, pki.server_cert, device.cert):
        assert stat.S_IMODE(cert.stat().st_mode) == 0o644, cert


def test_a_second_run_keeps_the_ca_and_adds_a_device(pki, capsys):
    ca, dev_1, token_1 = pki.ca.read_bytes(), pki.devices["dev-1"].cert.read_bytes(), \
        pki.devices["dev-1"].token.read_text()
    assert main(["certs", str(pki.folder), "--devices", "dev-1,dev-3"]) == 0
    again = Pki.at(pki.folder)
    assert again.ca.read_bytes() == ca
    assert again.devices["dev-1"].cert.read_bytes() == dev_1           # kept without --force
    assert again.devices["dev-1"].token.read_text() == token_1
    policy(again).build_client_verifier().verify(load(again.devices["dev-3"].cert), [])
    assert list(again.devices) == ["dev-1", "dev-2", "dev-3"]
    assert "made device dev-3" in capsys.readouterr().out
    assert main(["certs", str(pki.folder), "--devices", "dev-1", "--force"]) == 0
    assert pki.ca.read_bytes() == ca and pki.devices["dev-1"].cert.read_bytes() != dev_1


def test_the_token_file_pins_each_token_to_its_device_certificate(pki):
    lines = pki.tokens.read_text().splitlines()
    assert lines[0].startswith("# DEVICE_ID TOKEN") and len(lines) == 3
    grants = {grant.device: grant for grant in read_token_file(pki.tokens)}
    assert set(grants) == {"dev-1", "dev-2"}
    for device_id, files in pki.devices.items():
        token = files.token.read_text().strip()
        assert f"{device_id} {token} cert={device_id}" in lines
        assert grants[device_id].cert == device_id and grants[device_id].digest == digest(token)


@pytest.mark.parametrize("bad", ["../x", "a/b", "..", "dev 1"])
def test_a_bad_device_id_is_one_line_and_exit_2(bad, tmp_path, capsys):
    assert main(["certs", str(tmp_path / "certs"), "--devices", f"dev-1,{bad}"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("sled certs: the device id"), err
    assert not (tmp_path / "certs" / "devices" / "dev-1").exists()    # checked before anything
    assert not (tmp_path / "x").exists()


def test_sled_certs_without_cryptography_names_the_certs_extra(tmp_path):
    done = run_without(["cryptography"], "certs", str(tmp_path / "certs"), "--devices", "dev-1")
    assert_said(done, "sled certs", "certs")
    assert not (tmp_path / "certs").exists()


# A real TLS handshake over loopback: the server holds server.pem and asks for a client
# certificate from the CA, as `sled serve --tls-client-ca` does.

def server_context(pki: Pki) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    context.load_verify_locations(pki.ca)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def serve_once(listening: socket.socket, context: ssl.SSLContext):
    """Accept one connection: the client certificate's subject, or the handshake's error."""
    connection, _ = listening.accept()
    connection.settimeout(5)
    try:
        with context.wrap_socket(connection, server_side=True) as tls:
            tls.sendall(b"ok")
            return dict(pair[0] for pair in tls.getpeercert()["subject"])
    except ssl.SSLError as exc:
        return exc


def handshake(pki: Pki, device: DeviceFiles):
    """(what the server saw, what the client read) for one connection as `device`."""
    client = ssl.create_default_context(cafile=pki.ca)
    client.load_cert_chain(device.cert, device.key)
    with socket.create_server(("127.0.0.1", 0)) as listening, ThreadPoolExecutor(1) as pool:
        listening.settimeout(10)
        seen = pool.submit(serve_once, listening, server_context(pki))
        try:
            with socket.create_connection(listening.getsockname(), timeout=5) as raw, \
                    client.wrap_socket(raw, server_hostname="localhost") as tls:
                read = tls.recv(2)
        except (ssl.SSLError, OSError) as exc:
            read = exc
        return seen.result(timeout=10), read


def test_a_tls_handshake_accepts_this_cas_device_and_refuses_another_cas(pki):
    seen, read = handshake(pki, pki.devices["dev-1"])
    assert seen == {"commonName": "dev-1"} and read == b"ok"
    stranger = make_certs(pki.folder.parent / "stranger", ["dev-1"])
    seen, read = handshake(pki, stranger.devices["dev-1"])
    assert isinstance(seen, ssl.SSLError) and "certificate verify failed" in str(seen), seen
    assert read != b"ok"


def test_adding_a_device_keeps_the_token_file_as_its_operator_left_it(tmp_path):
    """A device revoked by hand stays revoked and a line's quota stays when devices are added;
    --force gives a device a new token on its own line."""
    pki = make_certs(tmp_path / "certs", ["dev-1", "dev-2"])
    old_token = pki.device_files("dev-1").token.read_text().strip()
    edited = [line.replace(f"cert=dev-1", "cert=dev-1 sessions=2")
              for line in pki.tokens.read_text().splitlines() if not line.startswith("dev-2 ")]
    pki.tokens.write_text("\n".join(edited) + "\n")
    pki = make_certs(tmp_path / "certs", ["dev-3"])
    grants = {grant.device: grant for grant in read_token_file(pki.tokens)}
    assert set(grants) == {"dev-1", "dev-3"}                  # dev-2 stays revoked
    assert grants["dev-1"].quota.sessions == 2
    pki = make_certs(tmp_path / "certs", ["dev-1"], force=True)
    new_token = pki.device_files("dev-1").token.read_text().strip()
    line = [l for l in pki.tokens.read_text().splitlines() if l.startswith("dev-1 ")]
    assert new_token != old_token and line == [f"dev-1 {new_token} cert=dev-1 sessions=2"]
