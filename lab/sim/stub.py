"""A Verifier stub whose calls reach a VerifierService in this process, with no network.

The simulated fleet's devices are sled's own device sessions (edge_client.session, server_side)
and the server is sled's own service and core. Between them a real fleet has gRPC; a simulation
on a virtual clock cannot (grpc's poller runs on real time), so each call is handed to the
service's handler directly: the device writes messages into the call, the handler reads them
with `context.read()` and its replies come back in order, its refusals as the call's status.
Messages are passed as objects, never encoded: the link emulation (lab.link) charges their
encoded size all the same (ByteSize).

    stub = LocalStub(service, peer="ipv4:10.0.0.7:50000")
    stream = Stream.open(stub)          # edge_client.transport.Stream over a LocalCall
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from sled.v1 import verifier_pb2 as pb


class LocalContext:
    """What the Verifier's handlers ask of a grpc.aio.ServicerContext: the peer, no metadata,
    no credentials, no deadline, the requests and the status they end with."""

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self.requests: asyncio.Queue = asyncio.Queue()
        self.headers_sent = asyncio.Event()
        self.code = grpc.StatusCode.OK
        self.details = ""

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple:
        return ()

    def auth_context(self) -> dict:
        return {}

    def time_remaining(self) -> None:
        return None

    async def send_initial_metadata(self, metadata) -> None:
        self.headers_sent.set()

    async def read(self):
        return await self.requests.get()

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


class LocalCall:
    """One Generate call, as edge_client.transport.Stream uses a grpc.aio stream-stream call."""

    def __init__(self, service, peer: str) -> None:
        self.context = LocalContext(peer)
        self._replies: asyncio.Queue = asyncio.Queue()
        self._handler = asyncio.get_running_loop().create_task(
            self._serve(service.Generate(None, self.context)))

    async def _serve(self, replies: AsyncIterator[pb.ServerMessage]) -> None:
        try:
            async for reply in replies:
                self._replies.put_nowait(reply)
        except asyncio.CancelledError:
            self.context.code, self.context.details = grpc.StatusCode.CANCELLED, "call cancelled"
        finally:
            self.context.headers_sent.set()
            self._replies.put_nowait(grpc.aio.EOF)

    async def write(self, message: pb.DeviceMessage) -> None:
        if self._handler.done():
            raise asyncio.InvalidStateError("the call is over")
        self.context.requests.put_nowait(message)

    async def done_writing(self) -> None:
        self.context.requests.put_nowait(grpc.aio.EOF)

    async def initial_metadata(self) -> tuple:
        await self.context.headers_sent.wait()
        return ()

    async def read(self):
        reply = await self._replies.get()
        if reply is grpc.aio.EOF:
            self._replies.put_nowait(grpc.aio.EOF)       # every later read sees the end too
        return reply

    async def code(self) -> grpc.StatusCode:
        await asyncio.shield(asyncio.wait((self._handler,)))
        return self.context.code

    async def details(self) -> str:
        await asyncio.shield(asyncio.wait((self._handler,)))
        return self.context.details

    def cancel(self) -> None:
        self._handler.cancel()


class LocalStub:
    """The Verifier calls a device session makes (Generate, GetModelInfo) on a local service;
    `peer` is the address the service sees (its anonymous devices are told apart by host)."""

    def __init__(self, service, peer: str) -> None:
        self.service = service
        self.peer = peer

    def Generate(self, timeout: float | None = None, wait_for_ready: bool = False) -> LocalCall:
        return LocalCall(self.service, self.peer)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, timeout: float | None = None,
                           wait_for_ready: bool = False) -> pb.ModelInfo:
        return await self.service.GetModelInfo(request, LocalContext(self.peer))
