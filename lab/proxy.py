"""HAProxy in front of several `sled serve` replicas: its configuration for N backends
(haproxy_config) and the proxy as a child process on loopback (ProxyProcess), the way
lab/server_process.py runs servers.

    config = haproxy_config("127.0.0.1:50051", ["10.0.0.5:50051", "10.0.0.6:50051"])
    async with ProxyProcess(["127.0.0.1:41001", "127.0.0.1:41002"], folder) as proxy:
        proxy.address                        # what every device dials

The rules are those of deploy/haproxy.cfg: HTTP mode over HTTP/2 on both sides, so each gRPC
call (a `Generate` stream is one session) is balanced on its own and stays on its replica
until it ends; `leastconn` sends a new session to the replica with the fewest open; a health
check is a real grpc.health.v1.Health/Check call whose answer must carry SERVING; a replica that
refuses a new connection is left for another (`option redispatch`). A replica lost mid-session
breaks its streams (CANCELLED, then UNAVAILABLE for new calls until the check marks it down),
and each device reopens its session through the proxy on a replica still up (edge_client.session).
No device names itself: the proxy appends each device's address to x-forwarded-for and drops
any certificate name a device sent (verify_server.origin.CERT_HEADER).
"""
from __future__ import annotations

import shutil
import signal
from pathlib import Path

from lab.fleet import FleetStartError
from lab.server_process import HOST, Child, free_port, wait_listening
from verify_server.origin import CERT_HEADER

HAPROXY = ("haproxy", "/usr/sbin/haproxy", "/usr/local/sbin/haproxy")
START_S = 15.0
HEALTH_PATH = b"/grpc.health.v1.Health/Check"


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    """One HTTP/2 frame: 24-bit length, type, flags, stream id, payload."""
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _text(raw: bytes) -> bytes:
    """An HPACK string literal, not Huffman-coded (shorter than 127 bytes)."""
    return bytes([len(raw)]) + raw


# HAProxy 2.6's http-check cannot send a body holding NUL bytes, and every gRPC message starts
# with them (the compression flag, the length). So the health check speaks HTTP/2 itself over
# TCP: the client preface, empty SETTINGS, one HEADERS frame (POST, http, the Check method,
# content-type application/grpc, te: trailers; HPACK literals from the static table) and one
# DATA frame with HealthCheckRequest{service: ""} (five zero bytes: flag 0, length 0), on
# stream 1. The replica is healthy when its answer holds the DATA frame on stream 1 carrying
# HealthCheckResponse{status: SERVING}: length 7, flag 0, message length 2, field 1 = 1.
HEALTH_CHECK_SEND = (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                     + _frame(0x4, 0x0, 0, b"")
                     + _frame(0x1, 0x4, 1, b"\x83\x86"                # :method POST, :scheme http
                              + b"\x04" + _text(HEALTH_PATH)           # :path
                              + b"\x01" + _text(b"localhost")          # :authority
                              + b"\x0f\x10" + _text(b"application/grpc")  # content-type
                              + b"\x00" + _text(b"te") + _text(b"trailers"))
                     + _frame(0x0, 0x1, 1, b"\x00" + (0).to_bytes(4, "big")))
HEALTH_CHECK_SERVING = _frame(0x0, 0x0, 1, b"\x00" + (2).to_bytes(4, "big") + b"\x08\x01")


def haproxy_binary() -> str | None:
    """The haproxy executable, None when it is not installed."""
    for candidate in HAPROXY:
        if shutil.which(candidate):
            return shutil.which(candidate)
    return None


def haproxy_config(bind: str, backends: list[str], *, check_interval_s: float = 1.0,
                   session_timeout_s: int = 3600, nameserver: str | None = None) -> str:
    """An haproxy.cfg balancing gRPC calls on BIND over BACKENDS ("host:port" each, plaintext
    gRPC). session_timeout_s: how long a session's stream may stay silent (a device thinking,
    a resume waiting) before the proxy closes it. nameserver ("ip:port", e.g. Docker's
    127.0.0.11:53): backends named by host are looked up there, again as they come and go (a
    restarted container may come back on another address), and one not there yet at start is
    left down until it is."""
    if not backends:
        raise ValueError("haproxy_config needs at least one backend")
    inter = f"{int(check_interval_s * 1000)}ms"
    resolvers, lookup = "", ""
    if nameserver:
        resolvers = f"""
resolvers names
    nameserver dns {nameserver}
    hold valid 1s
    hold obsolete 1s
"""
        lookup = " resolvers names init-addr last,libc,none"
    servers = "\n".join(f"    server replica-{i} {address}" for i, address in enumerate(backends))
    return f"""\
global
    maxconn 4096

defaults
    mode http
    timeout connect 2s
    timeout client {session_timeout_s}s
    timeout server {session_timeout_s}s
    # a replica that refuses the connection is tried again, on another one
    retries 2
    option redispatch
    # the device's address, for sled serve --trusted-proxy (docs/security.md)
    option forwardfor
{resolvers}
frontend sled
    bind {bind} proto h2
    # no device names itself (sled serve --proxy-cert-header)
    http-request del-header {CERT_HEADER}
    default_backend sled_replicas

backend sled_replicas
    balance leastconn
    # grpc.health.v1.Health/Check in raw HTTP/2 frames (lab/proxy.py says which)
    option tcp-check
    tcp-check send-binary {HEALTH_CHECK_SEND.hex()}
    tcp-check expect binary {HEALTH_CHECK_SERVING.hex()}
    default-server proto h2 check inter {inter} fall 2 rise 1{lookup}
{servers}
"""


class ProxyProcess:
    """`async with ProxyProcess(backends, folder) as proxy:` HAProxy listening on
    proxy.address (a free loopback port) in front of BACKENDS, its config and log in FOLDER."""

    def __init__(self, backends: list[str], folder: Path, port: int | None = None) -> None:
        binary = haproxy_binary()
        if binary is None:
            raise FleetStartError("HAProxy is not installed (Debian: apt-get install haproxy; "
                                  "or make haproxy)")
        self.port = port or free_port()
        self.address = f"{HOST}:{self.port}"
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.config = self.folder / "haproxy.cfg"
        self.config.write_text(haproxy_config(self.address, backends))
        # -db: in the foreground, its messages into the log file
        self.child = Child("haproxy", [binary, "-db", "-f", str(self.config)],
                           self.folder / "haproxy.log")

    async def __aenter__(self) -> "ProxyProcess":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self) -> None:
        self.child.start()
        await wait_listening(self.child, self.port, START_S)

    async def stop(self) -> None:
        await self.child.kill(signal.SIGTERM)
