"""The Verifier gRPC service: one session per Generate stream, its rounds through the scheduler.

    open   -> check (validation), admit the KV, prefill the prompt       -> Opened
    draft  -> check, verify in the next batched forward, finish_round    -> Verdict
    server modes: the server drafts for itself, a Verdict per forward     -> Verdict ...
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from sled.wire.tree import cut
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc
from verify_server import errors, validation
from verify_server.auth import Gate, Identity
from verify_server.blocks import PoolExhausted
from verify_server.draft_advice import suggest_draft_len
from verify_server.dropped_replies import quiet_dropped_replies, tokenizer_stream_ended
from verify_server.errors import Reason, SessionError
from verify_server.metrics import Metrics
from verify_server.quotas import Quotas
from verify_server.rounds import finish_round, timings
from verify_server.scheduler import Scheduler
from verify_server.session import Session
from verify_server.settings import ServerSettings
from verify_server.target import Target
from verify_server.tenant import tenant_key
from verify_server.work import Verify, sat_step_tokens

log = logging.getLogger("sled.server")
EVICTED_GRACE = 4     # idle timeouts an evicted live session's stream waits for its device


def deadline_of(context, deadline_ms: int = 0) -> float | None:
    """The earlier of the call's own deadline and a per-round one, as a perf_counter time."""
    now = time.perf_counter()
    remaining = context.time_remaining() if context is not None else None
    candidates = [now + remaining] if remaining is not None else []
    if deadline_ms:
        candidates.append(now + deadline_ms / 1e3)
    return min(candidates) if candidates else None


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A request whose bytes are not a valid message of its type (the bytes are not kept)."""
    message_type: str
    size: int
    why: str

    def refusal(self) -> SessionError:
        return errors.invalid(Reason.REASON_PROTOCOL,
                              f"undecodable message: {self.size} bytes are not a valid "
                              f"sled.v1.{self.message_type} ({self.why[:120]})")


def kind_of(message: pb.DeviceMessage | Undecodable) -> str:
    """Which of open, draft and close the message is; refuses anything else."""
    if isinstance(message, Undecodable):
        raise message.refusal()
    kind = message.WhichOneof("kind")
    if kind is None:
        raise errors.invalid(Reason.REASON_PROTOCOL,
                             "empty DeviceMessage: set one of open, draft, close")
    return kind


def detached(error: SessionError) -> SessionError:
    """The error without its traceback and chained exceptions, whose frames hold the request."""
    error.__traceback__ = error.__context__ = error.__cause__ = None
    return error


def end_call(context, error: SessionError, reply=None):
    """The call ends with the error's status once the handler returns (no exception is raised,
    so none is kept with the call's frames)."""
    context.set_code(error.code)
    context.set_details(error.message)
    return reply


class VerifierService(pb_grpc.VerifierServicer):
    def __init__(self, target: Target, scheduler: Scheduler, settings: ServerSettings,
                 metrics: Metrics, gate: Gate | None = None) -> None:
        self.target = target
        self.scheduler = scheduler
        self.settings = settings
        self.metrics = metrics
        self.sessions: dict[str, Session] = {}
        self.accepting = True
        self.pool = scheduler.engine.pool
        self.tokenizer_calls = 0          # GetTokenizer replies being written (the server's slots)
        self.tokenizer_calls_of: dict[str, int] = {}   # GetTokenizer calls not over, by device key
        self.streams: dict[str, int] = {}   # Generate streams held, by device key (Identity.key)
        self.kv_reserved: dict[str, int] = {}   # KV tokens reserved by open sessions, by device key
        self.gate = gate or Gate()        # who may call (auth): every Verifier call passes it
        self.quotas = Quotas(settings.quota_sessions, settings.quota_tokens_per_s,
                             settings.quota_burst_s, settings.quota_wait_s)
        quiet_dropped_replies()
        metrics.active_sessions.set_function(lambda: len(self.sessions))

    # --- unary calls -------------------------------------------------------------------------

    def identify(self, context) -> Identity:
        """The caller (auth.Gate); a refusal is counted and logged by reason."""
        try:
            return self.gate.identify(context.invocation_metadata(), context.auth_context(),
                                      context.peer())
        except SessionError as error:
            self.metrics.auth_refusals.labels(error.reason_name).inc()
            raise detached(error) from None

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        if isinstance(request, Undecodable):
            return end_call(context, request.refusal(), pb.ModelInfo())
        try:
            self.identify(context)
        except SessionError as error:
            return end_call(context, error, pb.ModelInfo())
        return pb.ModelInfo(
            model_id=self.target.model_id,
            vocab_size=self.target.vocab_size,
            tokenizer_fingerprint=self.target.fingerprint,
            tokenizer_files_sha256=self.target.tokenizer_files_sha256,
            eos_token_ids=self.target.eos_ids,
            context_length=self.target.context_length,
            limits=pb.ServerLimits(max_draft_tokens=self.settings.max_draft_tokens,
                                   max_sessions=self.settings.max_sessions,
                                   max_q_support=self.settings.max_q_support,
                                   kv_budget_tokens=self.pool.capacity_tokens,
                                   kv_block_tokens=self.pool.block_tokens,
                                   max_step_tokens=self.scheduler.max_step_tokens,
                                   idle_timeout_s=self.settings.idle_timeout,
                                   tree_drafts=self.scheduler.engine.branches),
            sat_available=self.target.sat_slots > 0,
            sat_slots=self.target.sat_slots,
            dtype=self.target.dtype,
            device=self.target.device,
        )

    async def GetTokenizer(self, request, context) -> None:
        """The tokenizer's chunks, made and encoded once at start: a call costs no disk work and
        no serialization on the loop (server.add_verifier sends the bytes as they are).

        gRPC holds a chunk in the call's buffer until the client has read it, so replies are
        bounded twice: at most max_tokenizer_calls are being written at once (the server's slots),
        and one device (a token's or certificate's) holds at most max_tokenizer_calls_per_device
        calls until each is over, so it cannot take every slot, nor pile up stalled calls. A write
        that waits on a client reading nothing for tokenizer_stall_timeout ends the reply
        (DEADLINE_EXCEEDED) and frees its slot. A stream the client drops is one log line (verify_server.dropped_replies)."""
        if isinstance(request, Undecodable):
            end_call(context, request.refusal())
            return
        try:
            identity = self.identify(context)
        except SessionError as error:
            end_call(context, error)
            return
        busy = self._tokenizer_busy(identity)
        if busy:
            context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.set_details(busy)
            return
        chunks, sent, peer, key = self.target.tokenizer_reply, [0], context.peer(), identity.key
        self.tokenizer_calls += 1
        hold(self.tokenizer_calls_of, key, 1)
        context.add_done_callback(lambda _: self._tokenizer_call_done(key, peer, sent[0], len(chunks)))
        try:
            for chunk in chunks:
                if not await self._written(context, chunk):
                    return
                sent[0] += 1
        finally:
            self.tokenizer_calls -= 1   # nothing more is written: the server's slot is free

    def _tokenizer_busy(self, identity) -> str:
        """Why a GetTokenizer call cannot be served now ("" when it can)."""
        held = self.tokenizer_calls_of.get(identity.key, 0)
        per_device = self.settings.max_tokenizer_calls_per_device
        if identity.authenticated and held >= per_device:   # a host's devices cannot be told apart
            return (f"device {identity.device} holds {held} GetTokenizer replies (limit "
                    f"{per_device} per device): read or end them first")
        limit = self.settings.max_tokenizer_calls
        if self.tokenizer_calls >= limit:
            return (f"{self.tokenizer_calls} GetTokenizer replies are being sent (limit {limit}): "
                    "retry in a moment")
        return ""

    async def _written(self, context, chunk: bytes) -> bool:
        """The chunk handed to gRPC; False (and the call's status set) when the client read
        nothing for tokenizer_stall_timeout."""
        stall = self.settings.tokenizer_stall_timeout
        try:
            await asyncio.wait_for(context.write(chunk), stall)
        except asyncio.TimeoutError:
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            context.set_details(f"the client read nothing of this reply for {stall:g} s: it ends "
                                "here (ask again)")
            return False
        return True

    def _tokenizer_call_done(self, key: str, peer: str, sent: int, total: int) -> None:
        release(self.tokenizer_calls_of, key, 1)
        tokenizer_stream_ended(peer, sent, total)

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
            counted = self._count_stream(identity)
            while (message := await self._next(session, context)) is not grpc.aio.EOF:
                kind = kind_of(message)
                if kind == "open":
                    session = self._open(session, message.open, identity, context.peer())
                    yield await self._prefill(session, context)
                    if session.mode != pb.GENERATION_MODE_DEVICE_DRAFTS:
                        async for reply in self._decode(session, context):
                            yield reply
                        break
                    session.wait_for_device()
                elif kind == "draft":
                    yield await self._verify(session, message.draft, context)
                elif kind == "close":
                    break
        except SessionError as error:
            refusal = detached(error)
        finally:
            self._close(session)
            if counted is not None:
                release(self.streams, counted, 1)
        message = None          # the last request goes before a refusal is sent
        if refusal is not None:
            yield self._refuse(session, device, refusal)
            end_call(context, refusal)

    def _count_stream(self, identity) -> str:
        """One more stream of this device, from its first byte; RESOURCE_EXHAUSTED (REASON_QUOTA)
        past max_streams_per_device. Returns the key to uncount when the stream ends."""
        held, limit = self.streams.get(identity.key, 0), self.settings.max_streams_per_device
        if held >= limit:
            raise errors.exhausted(Reason.REASON_QUOTA, f"device {identity.device} holds {held} "
                                   f"Generate streams (limit {limit}): end one first")
        hold(self.streams, identity.key, 1)
        return identity.key

    async def _next(self, session: Session | None, context):
        """The device's next message, or the end of the stream once its session is evicted:
        EOF (the call ends OK) for a finished session, a REASON_EVICTED refusal for a live one.
        The first message must come within open_timeout (a stream with no Open is ended)."""
        if session is None:
            try:
                return await asyncio.wait_for(context.read(), self.settings.open_timeout)
            except asyncio.TimeoutError:
                raise errors.deadline(Reason.REASON_PROTOCOL, f"no Open within "
                                      f"{self.settings.open_timeout:g} s of the call: send the Open "
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
        raise validation.evicted(session, self.settings.idle_timeout)

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
            await asyncio.wait((read,), timeout=EVICTED_GRACE * self.settings.idle_timeout)

    def _open(self, session: Session | None, request: pb.Open, identity: Identity,
              peer: str) -> Session:
        validation.check_no_session(session)
        sampling = validation.check_open(request, self.target, self.settings, len(self.sessions),
                                         self.accepting)
        loose = validation.check_loose(request, sampling)
        self.quotas.open(identity, len(request.prompt_ids))
        try:
            session = Session.from_open(request, sampling, self.target.eos_ids,
                                        self.scheduler.engine.new_kv(), loose)
            session.device = identity
            proven = identity.key if identity.authenticated else None
            self._admit(session, tenant_key(peer, request.cache_salt, proven))
        except BaseException:
            self.quotas.close(identity)
            raise
        self.sessions[session.id] = session
        self.metrics.sessions.inc()
        if loose is not None:
            self.metrics.loose_sessions.inc()
        self.metrics.device_sessions.labels(self.metrics.device_label(identity.device)).inc()
        log.debug("session %s opened by %s", session.id, identity.device)
        return session

    async def _pace(self, session: Session, tokens: int) -> None:
        """Hold (or refuse) the session's next work to keep its device within its tokens/s
        quota, and count the tokens against the device."""
        if session.device is None:
            return
        await self.quotas.pace(session.device, tokens)
        self.metrics.device_tokens.labels(self.metrics.device_label(session.device.device)).inc(
            tokens)

    async def _prefill(self, session: Session, context) -> pb.ServerMessage:
        await self._pace(session, len(session.prompt_ids) - session.cached_prompt_tokens)
        info = await self.scheduler.prefill(session, deadline_of(context))
        return pb.ServerMessage(opened=pb.Opened(
            session_id=session.id, prompt_tokens=len(session.prompt_ids),
            max_new_tokens=session.max_new_tokens, timings=timings(info),
            cached_prompt_tokens=session.cached_prompt_tokens, loose=session.loose is not None))

    async def _verify(self, session: Session | None, draft: pb.Draft, context) -> pb.ServerMessage:
        """A device's draft: checked, verified in the next batched forward, the round finished."""
        tokens = validation.check_draft(draft, session, self.target, self.settings)
        parents = validation.check_tree(draft, session, self.scheduler.engine.branches)
        session.heard_from_device()
        q = validation.draft_q(draft, tokens, session.sampling, self.target.vocab_size,
                               self.settings.max_q_support)
        room = session.verifiable(len(tokens))
        if parents is not None:      # what fits the session's room: as deep and as many as a chain
            tokens, parents = cut(tokens, parents, max_depth=room, max_nodes=room)
        draft_len = min(room, len(tokens))
        await self._pace(session, draft_len + 1 + draft.lookahead)
        outcome, info = await self.scheduler.verify(
            session, tokens[:draft_len], q[:draft_len] if q is not None else None,
            deadline_of(context, draft.deadline_ms), draft.lookahead, parents or None)
        verdict = finish_round(session, outcome, draft_len, info, self.metrics, self._advise)
        if session.finished:   # its KV goes now; its slot when the device closes or idles out
            self._end(session)
        session.wait_for_device()
        return pb.ServerMessage(verdict=verdict)

    async def _decode(self, session: Session, context) -> AsyncIterator[pb.ServerMessage]:
        """Server modes: the server produces the tokens, batched with every other session's work.

        GENERATION_MODE_SERVER decodes one token per pass. GENERATION_MODE_SERVER_SAT drafts with
        SATs: each pass verifies the previous SAT guesses and appends a block of m fresh SAT
        slots after every place the draft may be cut (engine.Row: anchors), so whatever is
        accepted, the block that follows exactly the accepted tokens is the next draft:

            pass 1: [x, S S S]                    -> emits t1, guesses g1 g2 g3
            pass 2: [t1, g1 g2 g3, S S S (after t1) | S S S (after g1) | S S S (after g2) |
                     S S S (after g3)]            -> accepts g1 g2, emits g1 g2 c (c corrects g3),
                                                     guesses: the block after g2
            pass 3: [c, h1 h2 h3, ...]

        An engine that cannot attend such blocks (the padded one) appends one block after the
        whole draft; then a cut draft leaves the next pass with an empty draft (one token).

        The next pass is queued before this one's verdict goes out, so a slow reader never makes
        its session miss a batch."""
        lookahead = self.target.sat_slots if session.mode == pb.GENERATION_MODE_SERVER_SAT else 0
        every_cut = bool(lookahead) and self.scheduler.engine.branches

        def next_pass(guesses: list[int]) -> tuple[asyncio.Future, int]:
            draft = guesses[:session.verifiable(len(guesses))]
            work = Verify(session, None, deadline_of(context), draft=draft, lookahead=lookahead,
                          every_cut=every_cut)
            return self.scheduler.enqueue(work), len(draft)

        await self._pace(session, sat_step_tokens(0, lookahead, every_cut))
        step, draft_len = next_pass([])
        while True:
            outcome, info = await step
            verdict = finish_round(session, outcome, draft_len, info, self.metrics)
            if not session.finished:
                try:
                    await self._pace(session, sat_step_tokens(len(outcome.hints), lookahead,
                                                              every_cut))
                except SessionError:
                    yield pb.ServerMessage(verdict=verdict)   # committed: it goes out first
                    raise
                step, draft_len = next_pass(outcome.hints)
            session.wait_for_device()       # a device that stops reading idles out too
            yield pb.ServerMessage(verdict=verdict)
            session.heard_from_device()
            if session.finished:
                return
            if session.evicted_after is not None:   # its queued pass was dropped with its KV
                raise validation.evicted(session, self.settings.idle_timeout)

    def _advise(self, session: Session) -> int:
        """The draft length this session's device should send next."""
        return suggest_draft_len(session.acceptance, len(self.sessions),
                                 self.scheduler.max_step_tokens, self.settings.max_draft_tokens)

    def _refuse(self, session: Session | None, device: str, error: SessionError) -> pb.ServerMessage:
        self.metrics.errors.labels(error.reason_name).inc()
        log.info("session %s of %s refused: %s", session.id if session else "-", device,
                 error.message)
        return pb.ServerMessage(error=error.detail())

    # --- KV and session lifetimes -------------------------------------------------------------

    def _admit(self, session: Session, tenant: bytes) -> None:
        """Reserve the session's KV (prompt + max_new_tokens) within its device's share,
        sharing the cached prefix blocks of its tenant (verify_server.tenant) only."""
        slots = self.target.sat_slots
        # room for the SAT slots of a pass: one block, or one after every cut of a SAT draft
        needed = len(session.prompt_ids) + session.max_new_tokens + \
            (slots * (slots + 1) if session.mode == pb.GENERATION_MODE_SERVER_SAT else slots)
        device = session.device
        held, share = self.kv_reserved.get(device.key, 0), self.kv_share_tokens()
        shared = share < self.pool.capacity_tokens       # else the pool's own bound is the share
        if shared and held + needed > share:
            raise errors.exhausted(
                Reason.REASON_KV_BUDGET,
                f"device {device.device}'s share of the KV cache is {share} tokens and its sessions "
                f"hold {held}: this one needs {needed}; end a session, or lower max_new_tokens")
        try:
            session.cached_prompt_tokens = session.kv.admit(session.prefill_tokens(), needed, tenant)
        except PoolExhausted:
            own = f" (device {device.device}'s sessions hold {held} of its share of {share})" \
                if shared else ""
            raise errors.exhausted(   # what the device holds, never the server's totals
                Reason.REASON_KV_BUDGET,
                f"the KV cache is full: this session needs {needed} tokens{own}; retry later, "
                "lower max_new_tokens, or use a server with a larger --kv-budget") from None
        session.kv_reserved = needed
        hold(self.kv_reserved, device.key, needed)
        self.metrics.prefix_hit_tokens.inc(session.cached_prompt_tokens)

    def kv_share_tokens(self) -> int:
        """KV tokens one device may reserve: kv_share of the budget, by default an equal part
        for each device of the token file (all of it without one: devices are told apart only
        by token)."""
        share = self.settings.kv_share
        if share is None:
            devices = len(self.gate.grants) if self.gate.required else 1
            share = 1.0 / max(devices, 1)
        return int(self.pool.capacity_tokens * share)

    def _end(self, session: Session) -> None:
        """The session is done (finished, failed or disconnected): its KV goes now."""
        self.scheduler.release(session)
        self._unreserve(session)

    def _unreserve(self, session: Session) -> None:
        """Its KV no longer counts against its device's share (once)."""
        if session.kv_reserved and session.device is not None:
            release(self.kv_reserved, session.device.key, session.kv_reserved)
        session.kv_reserved = 0

    def _close(self, session: Session | None) -> None:
        """The stream is over: the session goes, whatever ended it."""
        if session is not None:
            self._end(session)
            self._forget(session)

    def _forget(self, session: Session) -> None:
        """The session leaves the table, and its device's session quota, once."""
        if self.sessions.pop(session.id, None) is not None and session.device is not None:
            self.quotas.close(session.device)

    def evict_idle(self, now: float | None = None) -> list[Session]:
        """Free the slot and KV of every session that has waited on its device longer than the
        timeout; a finished one waiting for its device's close counts from its last verdict."""
        timeout = self.settings.idle_timeout
        if not timeout:
            return []
        now = time.monotonic() if now is None else now
        idle = [s for s in self.sessions.values() if s.idle_for(now) > timeout]
        for session in idle:
            session.evicted_after = session.idle_for(now)
            self._end(session)
            self._forget(session)
            self.metrics.evicted.inc()
            session.evicted.set()             # its handler ends the stream
            log.info("session %s of %s evicted after %.1f s idle", session.id,
                     session.device.device if session.device else "-", session.evicted_after)
        return idle

    async def run_evictions(self) -> None:
        """Background task: look for idle sessions a few times per timeout."""
        if not self.settings.idle_timeout:
            return
        while True:
            await asyncio.sleep(max(self.settings.idle_timeout / 4, 0.05))
            self.evict_idle()
            self.quotas.sweep()


def hold(table: dict[str, int], key: str, amount: int) -> None:
    """What a device holds (streams, tokenizer calls, KV tokens) grows by amount."""
    table[key] = table.get(key, 0) + amount


def release(table: dict[str, int], key: str, amount: int) -> None:
    """... and shrinks; a device holding nothing leaves the table."""
    left = table.pop(key, 0) - amount
    if left > 0:
        table[key] = left
