"""How a device reaches its verify servers: plaintext or TLS (mutual with a client certificate),
the bearer token every call carries, and which servers it will not dial at all.

    security = ChannelSecurity.from_files(server_ca="ca.pem", client_cert="dev-1.pem",
                                          client_key="dev-1.key", token="q2VhZ...")
    channel = security.channel("gpu-1.lan:50051")     # TLS, the certificate checked for gpu-1.lan
    stub = security.stub(channel)                      # every call carries the token
    security.refusal("10.0.0.9:50051", "", announced=True)   # why not to use it ("" = it may)

With TLS the server must prove, in the handshake, that it holds a certificate the device's CA
signed for the name dialed: the endpoint's host, or with `server_names` set the one of them the
server announced (or its host, when listed). An announced server must also be one of the
fleet's: its name in `server_names`, or (without them) the host of a configured server, since
a CA that signs for other names too (a public one) would let anyone announce a server of their
own. A fake announcement on the broker therefore leads nowhere. Without TLS a device sends its
token only to the servers it is configured with, never to announced ones.
"""
from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from sled.wire.auth import bearer_metadata
from sled.wire.endpoint import parse_endpoint
from sled.printable import printable
from sled.v1 import verifier_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = (("grpc.keepalive_time_ms", 30_000),)


class SecurityFileError(ValueError):
    """A TLS file of the device cannot be read; the message names the setting and the file."""


@dataclass(frozen=True)
class ChannelSecurity:
    server_ca: bytes | None = None       # PEM: TLS on when set
    client_cert: bytes | None = None     # PEM: mutual TLS
    client_key: bytes | None = field(default=None, repr=False)
    token: str = field(default="", repr=False)
    server_names: tuple[str, ...] = ()

    @classmethod
    def from_files(cls, server_ca=None, client_cert=None, client_key=None, token: str = "",
                   server_names=()) -> "ChannelSecurity":
        if bool(client_cert) != bool(client_key):
            raise SecurityFileError("client_cert and client_key go together: give both or neither")
        if client_cert and not server_ca:
            raise SecurityFileError("a client certificate is sent over TLS only: set server_ca "
                                    "(the CA that signed the servers' certificates) too")
        return cls(_read(server_ca, "server_ca"), _read(client_cert, "client_cert"),
                   _read(client_key, "client_key"), token, tuple(server_names))

    @classmethod
    def from_settings(cls, settings) -> "ChannelSecurity":
        """From the device daemon's settings (edge_client.settings.DeviceSettings)."""
        return cls.from_files(settings.server_ca, settings.client_cert, settings.client_key,
                              settings.token.get_secret_value(), settings.server_names)

    @property
    def tls(self) -> bool:
        return self.server_ca is not None

    def channel(self, endpoint: str, tls_name: str = "") -> grpc.aio.Channel:
        """A channel to the endpoint; with TLS the server's certificate must carry `tls_name`
        (default: the endpoint's host)."""
        options = list(CHANNEL_OPTIONS)
        if not self.tls:
            return grpc.aio.insecure_channel(endpoint, options=options)
        if tls_name and tls_name != _host(endpoint):
            options.append(("grpc.ssl_target_name_override", tls_name))
        credentials = grpc.ssl_channel_credentials(self.server_ca, self.client_key, self.client_cert)
        return grpc.aio.secure_channel(endpoint, credentials, options=options)

    def stub(self, channel: grpc.aio.Channel):
        """A Verifier stub whose every call carries this device's token (if it has one)."""
        stub = pb_grpc.VerifierStub(channel)
        return AuthorizedStub(stub, bearer_metadata(self.token)) if self.token else stub

    def tls_name(self, endpoint: str, announced_name: str = "") -> str | None:
        """The name the server's certificate must carry; None when no allowed name fits."""
        host = _host(endpoint)
        if not self.server_names:
            return host
        for name in (announced_name, host):
            if name and name in self.server_names:
                return name
        return None

    def refusal(self, endpoint: str, announced_name: str = "", announced: bool = False,
                configured: tuple[str, ...] = ()) -> str:
        """Why this device will not dial the server at all ("" when it may); `configured`: the
        endpoints this device is configured with."""
        if announced and self.token and not self.tls:
            return ("announced over MQTT, but this device sends its token only over TLS (set "
                    "server_ca) or to the servers it is configured with")
        if not self.tls:
            return ""
        if self.tls_name(endpoint, announced_name) is None:
            shown = printable(announced_name or _host(endpoint), 100)
            return (f"its name {shown!r} is not one of this device's server_names "
                    f"({', '.join(self.server_names)})")
        if announced and not self.server_names and _host(endpoint) not in map(_host, configured):
            return (f"announced over MQTT under {printable(_host(endpoint), 100)!r}, which is no "
                    "configured server's host: list the fleet's server names in server_names")
        return ""


class AuthorizedStub:
    """A Verifier stub that adds the token's metadata to every call it makes."""

    def __init__(self, stub, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub, self._metadata = stub, metadata

    def __getattr__(self, method: str):
        call = getattr(self._stub, method)

        def with_token(*args, metadata=None, **kwargs):
            return call(*args, metadata=tuple(metadata or ()) + self._metadata, **kwargs)
        return with_token


async def speaks_tls(endpoint: str, timeout: float = 2.0) -> bool:
    """Whether the endpoint completes a TLS handshake. Its certificate is not checked: this only
    tells why a plaintext call failed, nothing is sent over it."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    where = parse_endpoint(endpoint, "server")
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(where.host.strip("[]"), where.port, ssl=context), timeout)
    except (OSError, ssl.SSLError, asyncio.TimeoutError):
        return False
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), timeout)
    except (OSError, ssl.SSLError, asyncio.TimeoutError):
        pass
    return True


def _host(endpoint: str) -> str:
    return parse_endpoint(endpoint, "server").host.strip("[]")


def _read(path, setting: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityFileError(f"cannot read {setting} {path}: {exc.strerror or exc}") from None
