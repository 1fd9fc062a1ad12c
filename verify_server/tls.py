"""The server's transport security: TLS from a certificate and key, mutual TLS with a client CA.

    credentials = server_credentials(settings)     # None: plaintext (no --tls-cert)
    server.add_secure_port("0.0.0.0:50051", credentials)

The files are checked here with Python's ssl module before gRPC sees them, so a key that does
not belong to its certificate or a file that is not PEM stops start-up with one line naming
the file, instead of gRPC's handshake failing for every client later.
"""
from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from verify_server.settings import ServerSettings


class TlsFileError(ValueError):
    """A TLS file cannot be used; the message names it and says why."""


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    if not settings.tls_cert:
        return None
    cert, key = _read(settings.tls_cert, "--tls-cert"), _read(settings.tls_key, "--tls-key")
    _check_pair(settings.tls_cert, settings.tls_key)
    client_ca = None
    if settings.tls_client_ca:
        client_ca = _read(settings.tls_client_ca, "--tls-client-ca")
        _check_ca(settings.tls_client_ca)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsFileError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None


def _check_pair(cert: str, key: str) -> None:
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise TlsFileError(f"--tls-cert {cert} and --tls-key {key} do not make a usable pair "
                           f"(not PEM, or the key is not the certificate's): {exc.reason or exc}"
                           ) from None


def _check_ca(path: str) -> None:
    try:
        ssl.create_default_context(ssl.Purpose.SERVER_AUTH).load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise TlsFileError(f"--tls-client-ca {path} holds no usable CA certificate: "
                           f"{exc.reason or exc}") from None
