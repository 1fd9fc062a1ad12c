"""Every call but Generate, bounded: GetModelInfo, GetTokenizer, Health (Check and Watch) and
reflection. A gRPC server interceptor, so no service is left out:

- a call counts against its caller from its first byte (auth.Gate.caller: its token's device,
  else its certificate's name, else its host): at most max_calls_per_device at once, the next
  is refused with RESOURCE_EXHAUSTED;
- Health.Watch streams live as long as their watcher by design: their lifetime is not bounded,
  their number is, per caller as above and max_watch_streams for the whole server;
- a call's request must come within open_timeout of the call (a reflection stream's every next
  request, of the one before), else the call ends with DEADLINE_EXCEEDED: headers with no
  message hold nothing for long.

gRPC reads a unary request before it calls the handler, so a call that sends headers only would
never reach one: every bounded handler is turned into its request-streaming twin, which is
called at the call's first byte and reads the request itself (and writes a unary reply as the
one message of its stream). The client sees the same method.
Generate counts its own streams (DeviceLedger.count_stream) and waits open_timeout for its Open.

    server = grpc.aio.server(interceptors=[CallBounds(service.core)])
"""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

import grpc

from sled.v1 import verifier_pb2 as pb
from verify_server.core import VerifierCore
from verify_server.errors import SessionError

GENERATE = f"/{pb.DESCRIPTOR.services_by_name['Verifier'].full_name}/Generate"   # bounds itself
WATCH = "/grpc.health.v1.Health/Watch"


class Timeout(Exception):
    """The caller sent no request within open_timeout."""


class CallBounds(grpc.aio.ServerInterceptor):
    def __init__(self, core: VerifierCore) -> None:
        self.core = core

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method == GENERATE or not is_async(handler):
            return handler
        return self.bounded(handler, details.method)

    def bounded(self, handler, method: str):
        """The handler's request-streaming twin: counted, its requests read within open_timeout."""
        behavior = handler_behavior(handler)
        watch = method == WATCH

        async def call(requests, context):
            key = self.counted(context, watch)
            if key is None:
                return
            try:
                await self.answered(handler, behavior, context)
            except Timeout:
                context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
                context.set_details(f"no request within {self.core.settings.open_timeout:g} s "
                                    f"of the call ({method}): send it at once")
            finally:
                self.core.ledger.uncount_call(key, watch)

        return grpc.stream_stream_rpc_method_handler(
            call, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    def counted(self, context, watch: bool) -> str | None:
        """The caller's key, counted; None (and the call's status set) when it is over a bound."""
        caller = self.core.ledger.gate.caller(context.invocation_metadata(),
                                              context.auth_context(), context.peer())
        try:
            return self.core.ledger.count_call(caller, watch)
        except SessionError as error:
            self.core.metrics.errors.labels(error.reason_name).inc()
            context.set_code(error.code)
            context.set_details(error.message)
            return None

    async def answered(self, handler, behavior, context) -> None:
        """What the wrapped handler answers, written here: its stream, or its one reply unless
        it set a status (a refusal)."""
        timeout = self.core.settings.open_timeout
        if handler.request_streaming:
            request = timed_requests(context, timeout)
        else:
            request = await first_request(context, timeout)
            if request is grpc.aio.EOF:
                context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                context.set_details("the call ended without its request")
                return
        if inspect.isasyncgenfunction(behavior):
            async for reply in behavior(request, context):
                await context.write(reply)
            return
        reply = await behavior(request, context)
        if not handler.response_streaming and context.code() in (None, grpc.StatusCode.OK):
            await context.write(reply)


def handler_behavior(handler):
    return (handler.unary_unary or handler.unary_stream or handler.stream_unary
            or handler.stream_stream)


def is_async(handler) -> bool:
    """Whether the handler runs on the loop (every handler of this server does)."""
    behavior = handler_behavior(handler)
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


async def first_request(context, timeout: float):
    try:
        return await asyncio.wait_for(context.read(), timeout)
    except asyncio.TimeoutError:
        raise Timeout from None


async def timed_requests(context, timeout: float) -> AsyncIterator:
    """The call's requests, each within `timeout` of the one before (else Timeout)."""
    while (request := await first_request(context, timeout)) is not grpc.aio.EOF:
        yield request
