"""The Verifier gRPC service: the transport of verify_server.core. It reads each call's messages,
hands them to the core with the call's deadline and the caller's identity, and turns a core
refusal (a SessionError) into the stream's Error message and the call's status.

    open   -> core.open (may wait for KV), core.prefill     -> Opened
    draft  -> core.verify                                   -> Verdict
    server modes: core.decode, a Verdict per forward         -> Verdict ...
    a movable session the server moved to itself: core.decode until a verdict moves it back
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc
from verify_server import errors, validation
from verify_server.auth import Gate, Identity
from verify_server.core import VerifierCore
from verify_server.dropped_replies import quiet_dropped_replies, tokenizer_stream_ended
from verify_server.errors import Reason, SessionError
from verify_server.metrics import Metrics
from verify_server.reading_pace import ReadingPace
from verify_server.scheduler import Scheduler
from verify_server.session import Session
from verify_server.settings import ServerSettings
from verify_server.target import Target
from verify_server.transport import Undecodable, deadline_of, detached, end_call, kind_of

log = logging.getLogger("sled.server")
EVICTED_GRACE = 4     # idle timeouts an evicted live session's stream waits for its device
REFUSAL_LINGER_S = 1.0    # how long a refused stream waits for its device to half-close
__all__ = ["EVICTED_GRACE", "Undecodable", "VerifierService"]


class VerifierService(pb_grpc.VerifierServicer):
    def __init__(self, target: Target, scheduler: Scheduler, settings: ServerSettings,
                 metrics: Metrics, gate: Gate | None = None) -> None:
        self.core = VerifierCore(target, scheduler, settings, metrics, gate)
        quiet_dropped_replies()

    # --- unary calls -------------------------------------------------------------------------

    def identify(self, context) -> Identity:
        """The caller (auth.Gate); a refusal is counted and logged by reason."""
        try:
            return self.core.ledger.gate.identify(context.invocation_metadata(),
                                                  context.auth_context(), context.peer())
        except SessionError as error:
            self.core.metrics.auth_refusals.labels(error.reason_name).inc()
            raise detached(error) from None

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        if isinstance(request, Undecodable):
            return end_call(context, request.refusal(), pb.ModelInfo())
        try:
            self.identify(context)
        except SessionError as error:
            return end_call(context, error, pb.ModelInfo())
        core = self.core
        target, settings = core.target, core.settings
        return pb.ModelInfo(
            model_id=target.model_id,
            vocab_size=target.vocab_size,
            tokenizer_fingerprint=target.fingerprint,
            tokenizer_files_sha256=target.tokenizer_files_sha256,
            eos_token_ids=target.eos_ids,
            context_length=target.context_length,
            limits=pb.ServerLimits(max_draft_tokens=settings.max_draft_tokens,
                                   max_sessions=settings.max_sessions,
                                   max_q_support=settings.max_q_support,
                                   kv_budget_tokens=core.pool.capacity_tokens,
                                   kv_block_tokens=core.pool.block_tokens,
                                   max_step_tokens=core.scheduler.max_step_tokens,
                                   idle_timeout_s=settings.idle_timeout,
                                   tree_drafts=core.scheduler.engine.branches),
            sat_available=target.sat_slots > 0,
            sat_slots=target.sat_slots,
            dtype=target.dtype,
            device=target.device,
        )

    async def GetTokenizer(self, request, context) -> None:
        """The tokenizer's chunks, made and encoded once at start: a call costs no disk work and
        no serialization on the loop (server.add_verifier sends the bytes as they are).

        gRPC holds a chunk in the call's buffer until the client has read it, so replies are
        bounded twice: at most max_tokenizer_calls are being written at once (the server's slots),
        and one device (a token's or certificate's) holds at most max_tokenizer_calls_per_device
        calls until each is over, so it cannot take every slot, nor pile up stalled calls
        (DeviceLedger.tokenizer_busy). A write that waits on a client reading nothing for
        tokenizer_stall_timeout, or one read slower than tokenizer_min_rate on average once
        tokenizer_rate_grace is over (ReadingPace), ends the reply (DEADLINE_EXCEEDED) and frees
        its slot: a slot is held for at most grace + reply size / min rate. A stream the client
        drops is one log line (verify_server.dropped_replies)."""
        if isinstance(request, Undecodable):
            end_call(context, request.refusal())
            return
        try:
            identity = self.identify(context)
        except SessionError as error:
            end_call(context, error)
            return
        busy = self.core.ledger.tokenizer_busy(identity)
        if busy:
            context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.set_details(busy)
            return
        chunks, sent, key = self.core.target.tokenizer_reply, [0], identity.key
        self.core.ledger.tokenizer_call_started(key)
        context.add_done_callback(lambda _: self._tokenizer_call_done(key, sent[0], len(chunks)))
        settings = self.core.settings
        pace = ReadingPace(settings.tokenizer_min_rate, settings.tokenizer_rate_grace)
        try:
            for chunk in chunks:
                if not await self._written(context, chunk, pace):
                    return
                sent[0] += 1
        finally:
            self.core.ledger.tokenizer_reply_written()   # nothing more is written: slot free

    async def _written(self, context, chunk: bytes, pace: ReadingPace) -> bool:
        """The chunk handed to gRPC; False (and the call's status set) when the client read
        nothing for tokenizer_stall_timeout, or reads too slowly to take it in time (pace)."""
        stall = self.core.settings.tokenizer_stall_timeout
        floor_s = pace.seconds_left(len(chunk))
        try:
            await asyncio.wait_for(context.write(chunk), min(stall, floor_s))
        except asyncio.TimeoutError:
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            context.set_details(pace.too_slow() if floor_s < stall else
                                f"the client read nothing of this reply for {stall:g} s: it ends "
                                "here (ask again)")
            return False
        pace.written(len(chunk))
        return True

    def _tokenizer_call_done(self, key: str, sent: int, total: int) -> None:
        self.core.ledger.tokenizer_call_over(key)
        tokenizer_stream_ended(key, sent, total)

    # --- the session stream ------------------------------------------------------------------

    async def Generate(self, requests: AsyncIterator[pb.DeviceMessage],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ServerMessage]:
        """One stream, one session: dispatch each message; a refusal ends the stream (only).

        Nothing may keep a request after its call (a refused multi-million-token prompt would
        stay in memory): messages are read with context.read(), as grpc's request iterator keeps
        the last one in a cycle it never frees, and a refusal ends the call with a status set
        after the except block, not by an abort, whose kept exception would pin the frames."""
        session: Session | None = None
        refusal: SessionError | None = None
        device, counted = "-", None
        try:
            # Headers at once: the device's sign that a handler took this call (one stuck in a
            # stopping server's race gets none, and the device tries elsewhere: docs/protocol.md)
            await context.send_initial_metadata(())
            identity = self.identify(context)
            device = identity.device
            counted = self.core.ledger.count_stream(identity)
            while (message := await self._next(session, context)) is not grpc.aio.EOF:
                kind = kind_of(message)
                if kind == "open":
                    session = await self.core.open(session, message.open, identity)
                    opened = await self.core.prefill(session, deadline_of(context))
                    yield pb.ServerMessage(opened=opened)
                    if session.mode != pb.GENERATION_MODE_DEVICE_DRAFTS:
                        async for verdict in self.core.decode(session, deadline_of(context)):
                            yield pb.ServerMessage(verdict=verdict)
                        break
                    if session.placement != pb.GENERATION_MODE_DEVICE_DRAFTS:   # served at once
                        async for verdict in self.core.decode(session, deadline_of(context)):
                            yield pb.ServerMessage(verdict=verdict)
                    session.wait_for_device()
                elif kind == "draft":
                    verdict = await self.core.verify(session, message.draft, deadline_of(context))
                    if verdict is None:       # a moved session's draft of a past round
                        continue
                    yield pb.ServerMessage(verdict=verdict)
                    if session.placement != pb.GENERATION_MODE_DEVICE_DRAFTS:   # moved to the server
                        async for verdict in self.core.decode(session, deadline_of(context)):
                            yield pb.ServerMessage(verdict=verdict)
                elif kind == "close":
                    break
        except SessionError as error:
            refusal = detached(error)
        finally:
            self.core.close(session)
            if counted is not None:
                self.core.ledger.uncount_stream(counted)
        message = None          # the last request goes before a refusal is sent
        if refusal is not None:
            yield self._refuse(session, device, refusal)
            await self._until_half_closed(context)
            end_call(context, refusal)

    async def _next(self, session: Session | None, context):
        """The device's next message, or the end of the stream once its session is evicted:
        EOF (the call ends OK) for a finished session, a REASON_EVICTED refusal for a live one.
        The first message must come within open_timeout (a stream with no Open is ended)."""
        settings = self.core.settings
        if session is None:
            try:
                return await asyncio.wait_for(context.read(), settings.open_timeout)
            except asyncio.TimeoutError:
                raise errors.deadline(Reason.REASON_PROTOCOL, f"no Open within "
                                      f"{settings.open_timeout:g} s of the call: send the Open "
                                      "first") from None
        read = asyncio.ensure_future(context.read())
        try:
            await self._read_or_evicted(session, read)
        finally:
            got = read.done()
            if not got:
                read.cancel()
        if got:
            return read.result()
        if session.finished:
            return grpc.aio.EOF
        raise validation.evicted(session, settings.idle_timeout)

    async def _read_or_evicted(self, session: Session, read: asyncio.Future) -> None:
        """Until the message is read or the session is evicted; a live one's stream stays open
        EVICTED_GRACE timeouts more, so a device that comes back hears REASON_EVICTED on its next
        draft (a write into a stream the server has ended fails on the device with INTERNAL)."""
        evicted = asyncio.ensure_future(session.evicted.wait())
        try:
            await asyncio.wait((read, evicted), return_when=asyncio.FIRST_COMPLETED)
        finally:
            evicted.cancel()
        if not read.done() and not session.finished:
            await asyncio.wait((read,), timeout=EVICTED_GRACE * self.core.settings.idle_timeout)

    async def _until_half_closed(self, context) -> None:
        """Until the device, having read the refusal, half-closes its side (at most
        REFUSAL_LINGER_S). A call the server ends while the device's side is open is reset, not
        ended, and a proxy may pass the reset on as CANCELLED, dropping the refusal with it
        (HAProxy 2.6 does, under load): the device would take a refused session for a lost
        server. What the device sent before it read the refusal is dropped unread."""
        async def drained() -> None:
            while await context.read() is not grpc.aio.EOF:
                pass
        try:
            await asyncio.wait_for(drained(), REFUSAL_LINGER_S)
        except asyncio.TimeoutError:
            pass

    def _refuse(self, session: Session | None, device: str, error: SessionError) -> pb.ServerMessage:
        self.core.metrics.errors.labels(error.reason_name).inc()
        log.info("session %s of %s refused: %s", session.id if session else "-", device,
                 error.message)
        return pb.ServerMessage(error=error.detail())
