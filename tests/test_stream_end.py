"""How a device ends its side of a server-mode stream: the Open is all it sends, so it
half-closes at once, before the server can end the stream. A server that ends a stream whose
device side is still open resets it (HTTP/2 RST_STREAM), HAProxy passes that reset on as
CANCELLED, and the device could lose the last verdicts to it (docs/protocol.md, "The end of a
session"). The server here streams nothing until the device's side is closed, so a device that
half-closes late never gets its first verdict."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from edge_client.server_side import generate_server_side
from edge_client.wire import SessionRequest
from lying_server import VOCAB, LyingVerifier, serve
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc

PROMPT, MAX_NEW = [10, 11], 6
HALF_CLOSE_S = 5.0      # how long the server waits for the device's side to close


class AfterHalfClose(LyingVerifier):
    """An honest counting server that, in a server mode, streams only once the device's side of
    the stream is closed, and notes what it read after the Open (EOF, a message, or None when
    nothing came within HALF_CLOSE_S)."""

    def __init__(self) -> None:
        super().__init__()
        self.after_open: list[object] = []

    async def Generate(self, request_iterator, context):
        await context.send_initial_metadata(())
        opening = (await context.read()).open
        try:
            after = await asyncio.wait_for(context.read(), HALF_CLOSE_S)
        except asyncio.TimeoutError:
            after = None
        self.after_open.append(after)
        if after is not grpc.aio.EOF:
            return
        yield pb.ServerMessage(opened=pb.Opened(session_id="s", max_new_tokens=MAX_NEW))
        for verdict in self.server_steps(list(opening.prompt_ids), opening.max_new_tokens):
            yield pb.ServerMessage(verdict=verdict)


@pytest.fixture
async def server():
    verifier = AfterHalfClose()
    grpc_server, address = await serve(verifier)
    async with grpc.aio.insecure_channel(address) as channel:
        yield verifier, pb_grpc.VerifierStub(channel)
    await grpc_server.stop(grace=0)


@pytest.mark.parametrize("mode", [pb.GENERATION_MODE_SERVER, pb.GENERATION_MODE_SERVER_SAT],
                         ids=["server", "server_sat"])
async def test_a_server_mode_device_half_closes_right_after_its_open(server, mode):
    verifier, stub = server
    result = await asyncio.wait_for(generate_server_side(
        stub, SessionRequest(PROMPT, MAX_NEW, mode=mode), vocab_size=VOCAB), 2 * HALF_CLOSE_S)
    assert verifier.after_open == [grpc.aio.EOF]            # closed before anything came back
    assert result.token_ids == list(range(len(PROMPT), len(PROMPT) + MAX_NEW))
