"""What one connection holds is bounded: the server allows --max-streams-per-connection calls
open at once on a connection (HTTP/2's max_concurrent_streams), so a client that opens hundreds
of Generate streams, is refused on each and never reads a refusal nor half-closes holds that many
in the server, not hundreds; its further calls wait in the client. Another connection is served
meanwhile."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc
from test_stream_end import wrong_tokenizer_open
from verify_server import service
from verify_server.settings import ServerSettings

LIMIT = 20                 # calls one connection may hold
SENT = 200                 # refused streams its client opens and never reads
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)    # shares no connection


def test_the_default_is_a_thousand_and_twenty_four_calls_per_connection():
    assert ServerSettings().max_streams_per_connection == 1024


async def until_refused(server, count: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := refused(server)) < count:
        assert time.monotonic() < deadline, f"{seen:g} of {count} refused in {timeout_s:g} s"
        await asyncio.sleep(0.05)


def refused(server) -> float:
    return server.metrics.value("sled_errors_total", {"reason": "tokenizer_mismatch"})


@pytest.mark.parametrize("limit", [LIMIT, 100_000], ids=["bounded", "unbounded"])
async def test_refused_streams_never_read_hold_at_most_the_connections_limit(
        serve, models, monkeypatch, limit):
    """Each refused stream waits for a half-close that never comes (held for good here, 1 s in
    service): the server holds `limit` of them at once; without the bound, every one sent."""
    monkeypatch.setattr(service, "REFUSAL_LINGER_S", 600.0)
    server = await serve(models["llama"], max_streams_per_connection=limit)
    async with grpc.aio.insecure_channel(server.address, options=OWN_CONNECTION) as channel:
        stub = pb_grpc.VerifierStub(channel)
        calls = [stub.Generate() for _ in range(SENT)]
        writes = [asyncio.ensure_future(call.write(wrong_tokenizer_open())) for call in calls]
        held = min(limit, SENT)
        await until_refused(server, held)
        await asyncio.sleep(0.5)                         # room for any more to come
        assert refused(server) == held
        assert sum(write.done() for write in writes) == held     # the rest wait in the client
        async with grpc.aio.insecure_channel(server.address, options=OWN_CONNECTION) as other:
            info = await pb_grpc.VerifierStub(other).GetModelInfo(pb.GetModelInfoRequest(),
                                                                  timeout=10)
        assert info.tokenizer_fingerprint == server.service.core.target.fingerprint
        for write, call in zip(writes, calls):
            write.cancel()
            call.cancel()
