"""Who closes a Generate stream first. A server that ends a stream whose device side is still
open resets it (HTTP/2 RST_STREAM), HAProxy passes that reset on as CANCELLED, and what the
server sent last can be lost with it (docs/protocol.md, "The end of a session", "Refusals").
So a server-mode device half-closes right after its Open (the Open is all it sends); a device
that reads a refusal half-closes at once; and the server ends a refused call only once the
device's side is closed (or after REFUSAL_LINGER_S). The proxy itself: tests/test_replicas.py."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc._cython import cygrpc

from edge_client.server_side import generate_server_side
from edge_client.transport import Stream, VerifyError, half_close
from edge_client.wire import SessionRequest
from lying_server import VOCAB, LyingVerifier, serve
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc
from verify_server import service

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
async def serve_target(serve, models):
    """sled's own server of the tiny Llama target, in this process."""
    return await serve(models["llama"])


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


def wrong_tokenizer_open() -> pb.DeviceMessage:
    return pb.DeviceMessage(open=pb.Open(prompt_ids=[5, 6, 7], max_new_tokens=4,
                                         tokenizer_fingerprint="sha256:another"))


async def test_the_server_ends_a_refused_call_once_the_device_half_closes(serve_target,
                                                                          monkeypatch):
    """The refusal comes at once; its status only after the device's half-close."""
    monkeypatch.setattr(service, "REFUSAL_LINGER_S", 600.0)
    async with grpc.aio.insecure_channel(serve_target.address) as channel:
        call = pb_grpc.VerifierStub(channel).Generate()
        await call.write(wrong_tokenizer_open())
        reply = await call.read()
        assert reply.error.reason == pb.ErrorDetail.REASON_TOKENIZER_MISMATCH
        await asyncio.sleep(0.5)
        assert not call.done()                   # the server waits for the device's side
        await call.done_writing()
        assert await asyncio.wait_for(call.code(), 60) == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_device_that_never_half_closes_still_hears_its_refusal(serve_target):
    """After REFUSAL_LINGER_S the server ends the call all the same."""
    async with grpc.aio.insecure_channel(serve_target.address) as channel:
        call = pb_grpc.VerifierStub(channel).Generate()
        await call.write(wrong_tokenizer_open())
        assert (await call.read()).error.reason == pb.ErrorDetail.REASON_TOKENIZER_MISMATCH
        assert await asyncio.wait_for(call.code(), 60) == grpc.StatusCode.FAILED_PRECONDITION


class RefusedCall:
    """A Generate call that answers with a refusal, and notes what the device did in order."""

    def __init__(self) -> None:
        self.steps: list[str] = []

    async def read(self) -> pb.ServerMessage:
        self.steps.append("read")
        return pb.ServerMessage(error=pb.ErrorDetail(
            reason=pb.ErrorDetail.REASON_TOKENIZER_MISMATCH, message="another tokenizer"))

    async def done_writing(self) -> None:
        self.steps.append("half-close")

    async def code(self) -> grpc.StatusCode:
        self.steps.append("status")
        return grpc.StatusCode.FAILED_PRECONDITION


async def test_a_refused_device_half_closes_before_it_waits_for_the_status():
    call = RefusedCall()
    with pytest.raises(VerifyError) as refused:
        await Stream(call).receive()
    assert call.steps == ["read", "half-close", "status"]
    assert (refused.value.code, refused.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION,
                                                          "REASON_TOKENIZER_MISMATCH")


class EndedCall:
    """A call whose half-close fails as grpc's does on a call that ended meanwhile."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def done_writing(self) -> None:
        raise self.error


async def test_a_half_close_of_a_call_that_ended_meanwhile_is_not_an_error():
    await half_close(EndedCall(cygrpc.ExecuteBatchError("Failed \"execute_batch\"")))


async def test_a_half_close_raises_what_is_not_an_ended_call():
    with pytest.raises(RuntimeError, match="not grpc's"):
        await half_close(EndedCall(RuntimeError("not grpc's")))
