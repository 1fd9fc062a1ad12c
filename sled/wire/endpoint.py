"""HOST:PORT, the one way both sides write where a verify server listens.

    parse_endpoint("10.0.0.2:50051")          -> Endpoint("10.0.0.2", 50051)
    parse_endpoint("[::1]:50051")             -> Endpoint("[::1]", 50051)
    parse_endpoint("gpu-1", what="server")    -> ValueError: server 'gpu-1' is not HOST:PORT
"""
from __future__ import annotations

from typing import NamedTuple


class Endpoint(NamedTuple):
    host: str          # a name or an address; IPv6 in brackets
    port: int          # 1..65535

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(text: object, what: str = "endpoint") -> Endpoint:
    """The host and port of `text`; ValueError names `what` and says what is wrong."""
    host, _, port = text.rpartition(":") if isinstance(text, str) else ("", "", "")
    if not host or any(c.isspace() for c in host) or not (port.isascii() and port.isdigit()):
        raise ValueError(f"{what} {text!r} is not HOST:PORT")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"{what} {text!r}: port {int(port)} is outside 1..65535")
    return Endpoint(host, int(port))
