"""What tests/test_bounded_workers.py runs in worker processes (edge_client.bounded_workers):
each worker imports this module at its start, so it imports nothing heavy."""
from __future__ import annotations

import os
import time

MIB = 1 << 20


def pid(request: bytes) -> bytes:
    time.sleep(float(request or 0))
    return str(os.getpid()).encode()


def hold(request: bytes) -> bytes:
    """REQUEST MiB held at once, one MiB at a time."""
    held = [bytes(MIB) for _ in range(int(request))]
    return str(len(held)).encode()


def echo(request: bytes) -> bytes:
    return request


def leave(request: bytes) -> bytes:
    os._exit(3)
