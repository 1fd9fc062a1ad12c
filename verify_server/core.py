"""The server's core, apart from gRPC: the session table, KV admission within each device's
share (the ledger's: verify_server.ledger), and each session's rounds through the scheduler.

    session = await core.open(None, request, identity)       # checked, counted, KV admitted
    opened = await core.prefill(session, deadline)            # the prompt in: pb.Opened
    verdict = await core.verify(session, draft, deadline)     # a device's draft: pb.Verdict
    async for verdict in core.decode(session, deadline): ...  # server modes: the server drafts
    core.close(session)                                       # whatever ended the stream

It works from plain values: a deadline (a sled.clock time, or None) and the device's
auth.Identity, whose key (its token's device, certificate or host) tells devices apart. A
refusal is a SessionError, which the transport (verify_server.service) turns into the call's
status; a call that goes away cancels the coroutine awaiting its work (asyncio), and the
transport closes its session. An Open the whole KV cache cannot take now waits in the admission
queue (verify_server.admission) until sessions free theirs: `open` returns once its KV is
reserved.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from sled import clock
from sled.v1 import verifier_pb2 as pb
from sled.wire.tree import cut
from verify_server import errors, validation
from verify_server.admission import ADVICE, AdmissionQueue
from verify_server.auth import Gate, Identity
from verify_server.draft_advice import suggest_draft_len
from verify_server.engines.blocks import PoolExhausted
from verify_server.errors import Reason, SessionError
from verify_server.ledger import DeviceLedger
from verify_server.metrics import Metrics
from verify_server.placement import DEVICE, PlacementPolicy, Standing
from verify_server.rounds import finish_round, timings
from verify_server.scheduler import Scheduler, Verify, sat_step_tokens
from verify_server.sdsat import slots_under_load
from verify_server.session import Session
from verify_server.settings import ServerSettings
from verify_server.target import Target
from verify_server.tenant import tenant_key

log = logging.getLogger("sled.server")
PLACEMENT_LABELS = {pb.GENERATION_MODE_DEVICE_DRAFTS: "device", pb.GENERATION_MODE_SERVER: "server",
                    pb.GENERATION_MODE_SERVER_SAT: "server_sat"}


def round_deadline(deadline: float | None, deadline_ms: int = 0) -> float | None:
    """The earlier of the call's deadline and a round's own (deadline_ms from now)."""
    if not deadline_ms:
        return deadline
    own = clock.now() + deadline_ms / 1e3
    return own if deadline is None else min(deadline, own)


class VerifierCore:
    """Owns the sessions and their rounds; what each device holds is its ledger's
    (verify_server.ledger), which the core charges with a session's quota and KV."""

    def __init__(self, target: Target, scheduler: Scheduler, settings: ServerSettings,
                 metrics: Metrics, gate: Gate | None = None) -> None:
        self.target = target
        self.scheduler = scheduler
        self.settings = settings
        self.metrics = metrics
        self.sessions: dict[str, Session] = {}
        self.accepting = True
        self.pool = scheduler.engine.pool
        self.ledger = DeviceLedger(settings, self.pool, gate)   # what each device holds
        self.admission = AdmissionQueue(settings.admission_queue, settings.admission_wait, metrics)
        self.placement = PlacementPolicy(
            settings.placement, settings.placement_slo_rate,
            pb.GENERATION_MODE_SERVER_SAT if target.sat_slots else pb.GENERATION_MODE_SERVER,
            settings.placement_low, settings.placement_high)
        metrics.active_sessions.set_function(lambda: len(self.sessions))
        metrics.step_load.set_function(lambda: self.scheduler.load.share(clock.now()))
        for mode, label in PLACEMENT_LABELS.items():
            metrics.placed_sessions.labels(label).set_function(
                lambda mode=mode: sum(s.placement == mode for s in self.sessions.values()))

    # --- a session's life ------------------------------------------------------------------------

    async def open(self, session: Session | None, request: pb.Open,
                   identity: Identity) -> Session:
        """The session an Open asks for: checked, counted against its device's session quota,
        its KV admitted (and its cached prefix found), in the table. Sessions waiting for KV
        count against max_sessions and their device's quota while they wait."""
        validation.check_no_session(session)
        sampling = validation.check_open(request, self.target, self.settings,
                                         len(self.sessions) + self.admission.waiting,
                                         self.accepting)
        loose = validation.check_loose(request, sampling)
        self.ledger.quotas.open(identity, len(request.prompt_ids))
        try:
            session = Session.from_open(request, sampling, self.target.eos_ids,
                                        self.scheduler.engine.new_kv(), loose)
            session.device = identity
            await self._admit(session, tenant_key(identity.tenant, request.cache_salt))
        except BaseException:
            self.ledger.quotas.close(identity)
            raise
        self.sessions[session.id] = session
        self._count_open(session)
        return session

    def _count_open(self, session: Session) -> None:
        self.metrics.sessions.inc()
        if session.loose is not None:
            self.metrics.loose_sessions.inc()
        self.metrics.device_sessions.labels(self.metrics.device_label(session.device.device)).inc()
        log.debug("session %s opened by %s", session.id, session.device.device)

    async def prefill(self, session: Session, deadline: float | None) -> pb.Opened:
        """The prompt into the session's KV (what its cached prefix lacks)."""
        await self._pace(session, len(session.prompt_ids) - session.cached_prompt_tokens)
        info = await self.scheduler.prefill(session, deadline, self.round_tokens(session))
        if self.pool.windowed:      # the prompt in, its windowed groups gave back what it needed
            self.admission.kv_freed()
        opened = pb.Opened(session_id=session.id, prompt_tokens=len(session.prompt_ids),
                           max_new_tokens=session.max_new_tokens, timings=timings(info),
                           cached_prompt_tokens=session.cached_prompt_tokens,
                           loose=session.loose is not None)
        self._place(session, opened)
        return opened

    async def verify(self, session: Session | None, draft: pb.Draft,
                     deadline: float | None) -> pb.Verdict | None:
        """A device's draft: checked, verified in the next batched forward, the round finished.
        deadline: the call's; the draft's deadline_ms counts from when its work is queued.
        None for a moved session's draft of a round already past (the device wrote it before
        it read the move): dropped unanswered."""
        if self._stale(session, draft):
            self.metrics.stale_drafts.inc()
            return None
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
            round_deadline(deadline, draft.deadline_ms), draft.lookahead, parents or None)
        verdict = finish_round(session, outcome, draft_len, info, self.metrics)
        # the device drafts the next round: its length, and the SAT hints to start it with
        verdict.suggested_draft_len = self.advise(session)
        if not session.finished:
            verdict.hint_ids.extend(outcome.hints)
            session.observe_pace(len(verdict.emitted_ids), clock.now())
            self._place(session, verdict)
        if session.finished:   # its KV goes now; its slot when the device closes or idles out
            self.end(session)
        session.wait_for_device()
        return verdict

    def _stale(self, session: Session | None, draft: pb.Draft) -> bool:
        """A draft for a round already past, of a session that has moved: its device wrote it
        ahead, before it read the verdict that moved it."""
        return session is not None and session.moved_at is not None and draft.round < session.round

    def _place(self, session: Session, said: pb.Verdict | pb.Opened) -> None:
        """At a movable session's round boundary (or its open): where its next tokens come
        from, said in the verdict (or Opened) when that changes (the device reads it before its
        next round)."""
        if not session.movable:
            return
        now = clock.now()
        since = float("inf") if session.moved_at is None else now - session.moved_at
        standing = Standing(session.placement, session.acceptance, session.device_rate, since)
        placement = self.placement.place(standing, self.scheduler.load.share(now))
        if placement != session.placement:
            session.move(placement, now)
            said.placement = placement
            self.metrics.placement_moves.labels(PLACEMENT_LABELS[placement]).inc()

    async def decode(self, session: Session, deadline: float | None) -> AsyncIterator[pb.Verdict]:
        """Server modes: the server produces the tokens, batched with every other session's work.

        GENERATION_MODE_SERVER decodes one token per pass. GENERATION_MODE_SERVER_SAT drafts with
        SATs: each pass verifies the previous SAT guesses and appends a block of m fresh SAT
        slots after every place the draft may be cut (engines.rows.Row: anchors), so whatever is
        accepted, the block that follows exactly the accepted tokens is the next draft:

            pass 1: [x, S S S]                    -> emits t1, guesses g1 g2 g3
            pass 2: [t1, g1 g2 g3, S S S (after t1) | S S S (after g1) | S S S (after g2) |
                     S S S (after g3)]            -> accepts g1 g2, emits g1 g2 c (c corrects g3),
                                                     guesses: the block after g2
            pass 3: [c, h1 h2 h3, ...]

        An engine that cannot attend such blocks (the padded one) appends one block after the
        whole draft; then a cut draft leaves the next pass with an empty draft (one token).

        The next pass is queued before this one's verdict goes out, so a slow reader never makes
        its session miss a batch. While more sessions are live than settings.sat_off_above, a
        SERVER_SAT pass carries no SAT slots and no draft (a plain decode), until the load falls.

        A movable session the server serves (verify_server.placement) is decoded this way until
        the policy moves it back to its device: that verdict says so and ends the iteration."""
        def every_cut(lookahead: int) -> bool:
            return bool(lookahead) and self.scheduler.engine.branches

        def next_pass(guesses: list[int], lookahead: int) -> tuple[asyncio.Future, int]:
            draft = guesses[:session.verifiable(len(guesses))] if lookahead else []
            work = Verify(session, None, deadline, draft=draft, lookahead=lookahead,
                          every_cut=every_cut(lookahead))
            return self.scheduler.enqueue(work), len(draft)

        lookahead = self.sat_lookahead(session)
        await self._pace(session, sat_step_tokens(0, lookahead, every_cut(lookahead)))
        step, draft_len = next_pass([], lookahead)
        while True:
            outcome, info = await step
            verdict = finish_round(session, outcome, draft_len, info, self.metrics)
            if not session.finished:
                self._place(session, verdict)
            moved_back = not session.finished and session.placement == DEVICE
            if not (session.finished or moved_back):
                lookahead = self.sat_lookahead(session)
                guesses = outcome.hints if lookahead else []
                try:
                    await self._pace(session, sat_step_tokens(len(guesses), lookahead,
                                                              every_cut(lookahead)))
                except SessionError:
                    yield verdict       # committed: it goes out first
                    raise
                step, draft_len = next_pass(guesses, lookahead)
            session.wait_for_device()       # a device that stops reading idles out too
            yield verdict
            if moved_back:                  # its device drafts the next round
                return
            session.heard_from_device()
            if session.finished:
                return
            if session.evicted_after is not None:   # its queued pass was dropped with its KV
                raise validation.evicted(session, self.settings.idle_timeout)

    def sat_lookahead(self, session: Session) -> int:
        """SAT slots the session's next server pass carries: the target's in SERVER_SAT mode,
        none while the server is past settings.sat_off_above live sessions (or in SERVER mode)."""
        if session.placement != pb.GENERATION_MODE_SERVER_SAT:
            return 0
        return slots_under_load(self.target.sat_slots, len(self.sessions),
                                self.settings.sat_off_above)

    def advise(self, session: Session) -> int:
        """The draft length this session's device should send next."""
        return suggest_draft_len(session.acceptance, len(self.sessions),
                                 self.scheduler.max_step_tokens, self.settings.max_draft_tokens)

    async def _pace(self, session: Session, tokens: int) -> None:
        """Hold (or refuse) the session's next work to keep its device within its tokens/s
        quota, and count the tokens against the device."""
        if session.device is None:
            return
        await self.ledger.quotas.pace(session.device, tokens)
        self.metrics.device_tokens.labels(self.metrics.device_label(session.device.device)).inc(
            tokens)

    def end(self, session: Session) -> None:
        """The session is done (finished, failed or disconnected): its KV goes now."""
        freed = self.scheduler.release(session)
        self._unreserve(session)
        # the first session waiting for KV tries again once this one's is free (at once, or
        # when the step it is in ends)
        freed.add_done_callback(lambda _: self.admission.kv_freed())

    def close(self, session: Session | None) -> None:
        """The stream is over: the session goes, whatever ended it."""
        if session is not None:
            self.end(session)
            self._forget(session)

    def _forget(self, session: Session) -> None:
        """The session leaves the table, and its device's session quota, once."""
        if self.sessions.pop(session.id, None) is not None and session.device is not None:
            self.ledger.quotas.close(session.device)

    # --- KV admission ------------------------------------------------------------------------

    async def _admit(self, session: Session, tenant: bytes) -> None:
        """Reserve the session's KV (prompt + max_new_tokens) within its device's share,
        sharing the cached prefix blocks of its tenant (verify_server.tenant) only. When the
        whole cache cannot take it now, it waits in the admission queue for sessions to free
        theirs (with admission_queue 0 it is refused at once); a session larger than the whole
        cache, or one past its device's share, is refused at once."""
        self._check_fits_cache(session)
        self._check_share(session)
        if self.admission.first_in_line() and self._reserve(session, tenant):
            return
        if not self.admission.limit:
            raise self._cache_full(session)
        await self.admission.wait_for_kv(lambda: self._reserve(session, tenant),
                                         self.kv_needed(session))

    def _reserve(self, session: Session, tenant: bytes) -> bool:
        """The session's KV reserved now (True), or not, the whole cache being too full for it
        (False). Its device's share is checked again: its other sessions may have got KV while
        this one waited."""
        self._check_share(session)
        try:
            session.cached_prompt_tokens = session.kv.admit(session.prefill_tokens(),
                                                            self.kv_needed(session), tenant)
        except PoolExhausted:
            return False
        session.kv_reserved = self.kv_charged(session)
        self.ledger.hold_kv(session.device.key, session.kv_reserved)
        self.metrics.prefix_hit_tokens.inc(session.cached_prompt_tokens)
        return True

    def _check_fits_cache(self, session: Session) -> None:
        """A session the whole KV cache could never hold: refused, never queued."""
        charged, capacity = self.kv_charged(session), self.pool.capacity_tokens
        if charged > capacity:
            raise errors.exhausted(
                Reason.REASON_KV_BUDGET,
                f"this session needs {self.kv_needed(session)} tokens of KV, more than the whole "
                f"KV cache holds ({capacity}): shorten the prompt or lower max_new_tokens, or "
                "use a server with a larger --kv-budget")

    def _check_share(self, session: Session) -> None:
        """Refused when the session would take its device past its share of the KV cache."""
        device, charged = session.device, self.kv_charged(session)
        held, share = self.ledger.kv_held(device.key), self.ledger.kv_share_tokens()
        if share < self.pool.capacity_tokens and held + charged > share:
            raise errors.exhausted(
                Reason.REASON_KV_BUDGET,
                f"device {device.device}'s share of the KV cache is {share} tokens and its sessions "
                f"hold {held}: this one needs {charged} (whole blocks of "
                f"{self.pool.block_tokens}); end a session, or lower max_new_tokens")

    def _cache_full(self, session: Session) -> SessionError:
        """The refusal of a session the whole cache cannot take now, when none may wait: what
        its device holds, never the server's totals."""
        device, share = session.device, self.ledger.kv_share_tokens()
        own = ""
        if share < self.pool.capacity_tokens:
            held = self.ledger.kv_held(device.key)
            own = f" (device {device.device}'s sessions hold {held} of its share of {share})"
        return errors.exhausted(
            Reason.REASON_KV_BUDGET,
            f"the KV cache is full: this session needs {self.kv_needed(session)} tokens{own}; "
            f"{ADVICE}")

    def kv_needed(self, session: Session) -> int:
        """KV tokens the session may fill: its prompt, max_new_tokens, and the SAT slots of a
        pass."""
        return len(session.prompt_ids) + session.max_new_tokens + self._sat_entries(session)

    def round_tokens(self, session: Session) -> int:
        """The most entries a row of the session's rounds has: the last token, a full draft
        and the SAT slots of a pass."""
        return 1 + self.settings.max_draft_tokens + self._sat_entries(session)

    def _sat_entries(self, session: Session) -> int:
        """The SAT slots a pass may append: one block, or one after every cut of a SAT draft
        (in SERVER_SAT mode, or in a session the server may move there)."""
        slots = self.target.sat_slots
        drafts = session.mode == pb.GENERATION_MODE_SERVER_SAT or session.movable
        return slots * (slots + 1) if drafts else slots

    def kv_charged(self, session: Session) -> int:
        """KV tokens the session holds against its device's share: what it may fill, rounded up
        to whole blocks, as the cache hands them out."""
        return self.pool.blocks_for(self.kv_needed(session)) * self.pool.block_tokens

    def _unreserve(self, session: Session) -> None:
        """Its KV no longer counts against its device's share (once)."""
        if session.kv_reserved and session.device is not None:
            self.ledger.release_kv(session.device.key, session.kv_reserved)
        session.kv_reserved = 0

    # --- idle sessions -----------------------------------------------------------------------

    def evict_idle(self, now: float | None = None) -> list[Session]:
        """Free the slot and KV of every session that has waited on its device longer than the
        timeout; a finished one waiting for its device's close counts from its last verdict."""
        timeout = self.settings.idle_timeout
        if not timeout:
            return []
        now = clock.now() if now is None else now
        idle = [s for s in self.sessions.values() if s.idle_for(now) > timeout]
        for session in idle:
            self._evict(session, session.idle_for(now))
        return idle

    def _evict(self, session: Session, idle_s: float) -> None:
        session.evicted_after = idle_s
        self.close(session)
        self.metrics.evicted.inc()
        session.evicted.set()             # its stream's handler ends the stream
        log.info("session %s of %s evicted after %.1f s idle", session.id,
                 session.device.device if session.device else "-", session.evicted_after)

    async def run_evictions(self) -> None:
        """Background task: look for idle sessions a few times per timeout."""
        if not self.settings.idle_timeout:
            return
        while True:
            await asyncio.sleep(max(self.settings.idle_timeout / 4, 0.05))
            self.evict_idle()
            self.ledger.quotas.sweep()

