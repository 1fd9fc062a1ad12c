"""The Verifier gRPC service: validates what devices send and turns it into scheduled work."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
import torch

from sled.fingerprint import short
from sled.sampling import Sampling
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc
from verify_server import errors
from verify_server.acceptance import DraftQ
from verify_server.blocks import PoolExhausted
from verify_server.config import ServerConfig
from verify_server.draft_advice import suggest_draft_len
from verify_server.errors import Reason, SessionError
from verify_server.metrics import Metrics
from verify_server.scheduler import Scheduler, StepInfo
from verify_server.session import Session
from verify_server.target import Target
from verify_server.work import Verify

log = logging.getLogger("sled.server")

PROB_SUM_TOLERANCE = 1e-3


def _timings(info: StepInfo) -> pb.ServerTimings:
    return pb.ServerTimings(queue_ms=info.queue_ms, forward_ms=info.forward_ms,
                            batch_size=info.batch_size)


def _deadline(context, deadline_ms: int = 0) -> float | None:
    """The earlier of the call's own deadline and a per-round one, as a perf_counter time."""
    now = time.perf_counter()
    remaining = context.time_remaining() if context is not None else None
    candidates = [now + remaining] if remaining is not None else []
    if deadline_ms:
        candidates.append(now + deadline_ms / 1e3)
    return min(candidates) if candidates else None


class VerifierService(pb_grpc.VerifierServicer):
    def __init__(self, target: Target, scheduler: Scheduler, config: ServerConfig,
                 metrics: Metrics) -> None:
        self.target = target
        self.scheduler = scheduler
        self.config = config
        self.metrics = metrics
        self.context_length = min(target.context_length, config.context_length or 1 << 30)
        self.sessions: dict[str, Session] = {}
        self.accepting = True
        self.pool = scheduler.engine.pool
        self.sat_slots = target.sat.slots if target.sat is not None else 0

    # --- unary calls -------------------------------------------------------------------------

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        return pb.ModelInfo(
            model_id=self.target.model_id,
            vocab_size=self.target.vocab_size,
            tokenizer_fingerprint=self.target.fingerprint,
            eos_token_ids=self.target.eos_ids,
            context_length=self.context_length,
            limits=pb.ServerLimits(max_draft_tokens=self.config.max_draft_tokens,
                                   max_sessions=self.config.max_sessions,
                                   max_q_support=self.config.max_q_support,
                                   kv_budget_tokens=self.pool.capacity_tokens,
                                   kv_block_tokens=self.pool.block_tokens,
                                   max_step_tokens=self.scheduler.max_step_tokens,
                                   idle_timeout_s=self.config.idle_timeout_s),
            sat_available=self.sat_slots > 0,
            sat_slots=self.sat_slots,
            dtype=self.target.dtype,
            device=self.target.device,
        )

    async def GetTokenizer(self, request, context) -> pb.TokenizerFiles:
        files = [pb.TokenizerFile(name=name, content=content)
                 for name, content in self.target.tokenizer_files().items()]
        return pb.TokenizerFiles(tokenizer_fingerprint=self.target.fingerprint, files=files)

    # --- the session stream ------------------------------------------------------------------

    async def Generate(self, requests: AsyncIterator[pb.DeviceMessage],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ServerMessage]:
        session: Session | None = None
        try:
            async for message in requests:
                if session is not None:
                    session.heard_from_device()
                kind = message.WhichOneof("kind")
                if kind == "open":
                    if session is not None:
                        raise errors.precondition(Reason.REASON_PROTOCOL,
                                                  "this stream already has an open session; "
                                                  "open a new stream for a new generation")
                    session = self._open(message.open)
                    info = await self.scheduler.prefill(session, _deadline(context))
                    yield pb.ServerMessage(opened=pb.Opened(
                        session_id=session.id, prompt_tokens=len(session.prompt_ids),
                        max_new_tokens=session.max_new_tokens, timings=_timings(info),
                        cached_prompt_tokens=session.cached_prompt_tokens))
                    if session.mode != pb.GENERATION_MODE_DEVICE_DRAFTS:
                        async for verdict in self._decode(session, context):
                            yield pb.ServerMessage(verdict=verdict)
                        break
                    session.wait_for_device()
                elif kind == "draft":
                    verdict = await self._verify(session, message.draft, context)
                    yield pb.ServerMessage(verdict=verdict)
                    if session.finished:
                        self._end(session)
                    else:
                        session.wait_for_device()
                elif kind == "close":
                    break
                else:
                    raise errors.invalid(Reason.REASON_PROTOCOL,
                                         "empty DeviceMessage: set one of open, draft, close")
        except SessionError as error:
            self.metrics.errors.labels(error.reason_name).inc()
            log.info("session %s refused: %s", session.id if session else "-", error.message)
            yield pb.ServerMessage(error=error.detail())
            await context.abort(error.code, error.message)
        finally:
            if session is not None:
                self._end(session)
                self.sessions.pop(session.id, None)
                self.metrics.active_sessions.set(len(self.sessions))

    async def _decode(self, session: Session, context) -> AsyncIterator[pb.Verdict]:
        """Server modes: the server produces the tokens, batched with every other session's work.

        GENERATION_MODE_SERVER decodes one token per pass. GENERATION_MODE_SERVER_SAT drafts with
        SATs: each pass verifies the previous SAT guesses and appends m fresh SAT slots after
        them, whose outputs are the next draft if the whole draft is accepted (otherwise the next
        pass starts with an empty draft, which still yields one token and new guesses).

            pass 1: [x, S S S]        -> emits t1,          guesses g1 g2 g3
            pass 2: [t1, g1 g2 g3, S S S] -> accepts g1 g2, emits g1 g2 c   (c corrects g3)
            pass 3: [c, S S S]        -> emits t, guesses ...

        The next pass is queued before this one's verdict goes out, so a slow reader never makes
        its session miss a batch."""
        lookahead = self.sat_slots if session.mode == pb.GENERATION_MODE_SERVER_SAT else 0

        def next_pass(guesses: list[int]) -> tuple[asyncio.Future, list[int]]:
            draft = guesses[:session.verifiable(len(guesses))]
            work = Verify(session, None, _deadline(context), draft=draft, lookahead=lookahead)
            return self.scheduler.enqueue(work), draft

        step, draft = next_pass([])
        while True:
            outcome, info = await step
            emitted, finish, accepted = session.commit(outcome)
            verified = len(draft)
            if not session.finished:
                step, draft = next_pass(outcome.hints)
            session.observe(verified, accepted)
            self.metrics.rounds.inc()
            self.metrics.draft_tokens.inc(verified)
            self.metrics.accepted_tokens.inc(accepted)
            self.metrics.emitted_tokens.inc(len(emitted))
            yield pb.Verdict(round=session.round - 1, accepted=accepted, emitted_ids=emitted,
                             finish_reason=finish, timings=_timings(info), verified=verified)
            if session.finished:
                return

    # --- idle eviction --------------------------------------------------------------------------

    def evict_idle(self, now: float | None = None) -> list[Session]:
        """Free the KV of sessions that have waited on their device longer than the timeout."""
        timeout = self.config.idle_timeout_s
        if not timeout:
            return []
        now = time.monotonic() if now is None else now
        idle = [s for s in self.sessions.values() if s.idle_for(now) > timeout and not s.finished]
        for session in idle:
            session.evicted_after = session.idle_for(now)
            self.scheduler.release(session)
            self.sessions.pop(session.id, None)
            self.metrics.evicted.inc()
            log.info("session %s evicted after %.1f s idle", session.id, session.evicted_after)
        if idle:
            self.metrics.active_sessions.set(len(self.sessions))
        return idle

    async def run_evictions(self) -> None:
        """Background task: look for idle sessions a few times per timeout."""
        if not self.config.idle_timeout_s:
            return
        while True:
            await asyncio.sleep(max(self.config.idle_timeout_s / 4, 0.05))
            self.evict_idle()

    def _end(self, session: Session) -> None:
        """The session is done (finished, failed or disconnected): its KV goes now."""
        self.scheduler.release(session)

    def _open(self, request: pb.Open) -> Session:
        if not self.accepting:
            raise errors.unavailable(Reason.REASON_SHUTTING_DOWN,
                                     "server is shutting down; retry on another server")
        if request.tokenizer_fingerprint and request.tokenizer_fingerprint != self.target.fingerprint:
            raise errors.precondition(
                Reason.REASON_TOKENIZER_MISMATCH,
                f"drafter tokenizer {short(request.tokenizer_fingerprint)} "
                f"({request.drafter or 'unnamed drafter'}) does not match target "
                f"{self.target.model_id} tokenizer {short(self.target.fingerprint)}: "
                "draft with a model that shares the target's tokenizer")
        prompt = list(request.prompt_ids)
        if not prompt:
            raise errors.invalid(Reason.REASON_PROTOCOL, "prompt_ids is empty: send at least one token")
        self._check_ids(prompt, "prompt_ids")
        self._check_ids(request.stop_ids, "stop_ids")
        if request.max_new_tokens < 1:
            raise errors.invalid(Reason.REASON_PROTOCOL, "max_new_tokens must be >= 1")
        if len(prompt) + request.max_new_tokens > self.context_length:
            raise errors.invalid(
                Reason.REASON_CONTEXT_OVERFLOW,
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                f"exceeds the context length {self.context_length}: shorten one of them")
        try:
            sampling = Sampling.from_proto(request.sampling)
        except ValueError as exc:
            raise errors.invalid(Reason.REASON_BAD_SAMPLING, f"bad sampling params: {exc}") from None
        if len(self.sessions) >= self.config.max_sessions:
            raise errors.exhausted(Reason.REASON_TOO_MANY_SESSIONS,
                                   f"server is at its limit of {self.config.max_sessions} sessions; "
                                   "retry later or use another server")
        if request.mode not in pb.GenerationMode.values():
            raise errors.invalid(Reason.REASON_PROTOCOL,
                                 f"unknown generation mode {request.mode}: use "
                                 + " or ".join(pb.GenerationMode.keys()))
        if request.mode == pb.GENERATION_MODE_SERVER_SAT and not self.sat_slots:
            raise errors.precondition(
                Reason.REASON_NO_SAT,
                f"target {self.target.model_id} has no semantic adaptive tokens, so it cannot draft "
                "for itself: use GENERATION_MODE_SERVER, or serve a SAT-tuned target "
                "(sled serve --sat-adapter, or a model whose config has sled_sat)")
        stop = frozenset(request.stop_ids)
        end = stop if request.ignore_eos else stop | frozenset(self.target.eos_ids)
        session = Session(prompt_ids=prompt, sampling=sampling, max_new_tokens=request.max_new_tokens,
                          end_ids=end, stop_ids=stop, drafter=request.drafter, mode=request.mode,
                          kv=self.scheduler.engine.new_kv())
        self._admit(session)
        self.sessions[session.id] = session
        self.metrics.sessions.inc()
        self.metrics.active_sessions.set(len(self.sessions))
        return session

    def _admit(self, session: Session) -> None:
        """Reserve the session's KV (prompt + max_new_tokens), sharing cached prefix blocks."""
        needed = len(session.prompt_ids) + session.max_new_tokens + self.sat_slots
        try:
            session.cached_prompt_tokens = session.kv.admit(session.prefill_tokens(), needed)
        except PoolExhausted:
            pool, mib = self.pool, self.pool.shape.bytes_per_token / (1 << 20)
            free_tokens = (pool.usable_blocks - pool.committed_blocks) * pool.block_tokens
            raise errors.exhausted(
                Reason.REASON_KV_BUDGET,
                f"KV cache budget is full: this session needs {needed} tokens "
                f"({needed * mib:.1f} MiB) but only {free_tokens} of {pool.capacity_tokens} tokens "
                f"({pool.capacity_tokens * mib:.0f} MiB budget) are free across "
                f"{len(self.sessions)} sessions; retry later, lower max_new_tokens, or use a "
                "server with a larger --kv-budget") from None
        self.metrics.prefix_hit_tokens.inc(session.cached_prompt_tokens)

    async def _verify(self, session: Session | None, draft: pb.Draft, context) -> pb.Verdict:
        if session is None:
            raise errors.precondition(Reason.REASON_NO_SESSION,
                                      "draft before open: send an open message first", draft.round)
        if session.evicted_after is not None:
            raise errors.aborted(
                Reason.REASON_EVICTED,
                f"session {session.id} was idle {session.evicted_after:.1f} s (limit "
                f"{self.config.idle_timeout_s:g} s) and its KV was freed: reopen a stream with the "
                f"prompt + the {len(session.generated)} committed tokens to resume")
        if session.finished:
            raise errors.precondition(
                Reason.REASON_SESSION_FINISHED,
                f"session {session.id} already finished ({pb.FinishReason.Name(session.finish)}) "
                f"after {len(session.generated)} tokens", draft.round)
        if draft.round != session.round:
            raise errors.precondition(Reason.REASON_WRONG_ROUND,
                                      f"draft is for round {draft.round}, session {session.id} "
                                      f"expects round {session.round}", draft.round)
        tokens = list(draft.token_ids)
        if not tokens:
            raise errors.invalid(Reason.REASON_EMPTY_DRAFT, "draft has no tokens: send k >= 1",
                                 draft.round)
        if len(tokens) > self.config.max_draft_tokens:
            raise errors.invalid(Reason.REASON_DRAFT_TOO_LONG,
                                 f"draft has {len(tokens)} tokens, the server verifies at most "
                                 f"{self.config.max_draft_tokens} per round", draft.round)
        self._check_ids(tokens, "draft.token_ids", draft.round)
        if draft.lookahead and not self.sat_slots:
            raise errors.precondition(Reason.REASON_NO_SAT,
                                      f"lookahead {draft.lookahead} asked for, but target "
                                      f"{self.target.model_id} has no semantic adaptive tokens: "
                                      "send lookahead 0", draft.round)
        if draft.lookahead > self.sat_slots:
            raise errors.invalid(Reason.REASON_PROTOCOL,
                                 f"lookahead {draft.lookahead} exceeds the target's {self.sat_slots} "
                                 "SAT slots (ModelInfo.sat_slots)", draft.round)
        q = self._draft_q(session, draft, tokens)
        budget = session.verifiable(len(tokens))
        deadline = _deadline(context, draft.deadline_ms)
        outcome, info = await self.scheduler.verify(session, tokens[:budget],
                                                    q[:budget] if q is not None else None, deadline,
                                                    draft.lookahead)
        emitted, finish, accepted = session.commit(outcome)
        session.observe(budget, accepted)
        self.metrics.rounds.inc()
        self.metrics.draft_tokens.inc(budget)
        self.metrics.accepted_tokens.inc(accepted)
        self.metrics.emitted_tokens.inc(len(emitted))
        suggested = suggest_draft_len(session.acceptance, len(self.sessions),
                                      self.scheduler.max_step_tokens, self.config.max_draft_tokens)
        return pb.Verdict(round=draft.round, accepted=accepted, emitted_ids=emitted,
                          finish_reason=finish, timings=_timings(info), verified=budget,
                          suggested_draft_len=suggested,
                          hint_ids=outcome.hints if not session.finished else [])

    def _draft_q(self, session: Session, draft: pb.Draft, tokens: list[int]) -> list[DraftQ] | None:
        """The sparse q of a sampling draft; None means a deterministic drafter (one-hot q)."""
        if session.sampling.greedy or not draft.q:
            return None
        if len(draft.q) != len(tokens):
            raise errors.invalid(Reason.REASON_BAD_DRAFT_DISTRIBUTION,
                                 f"draft has {len(tokens)} tokens but {len(draft.q)} q entries: "
                                 "send one per token or none", draft.round)
        result = []
        for j, (token, dist) in enumerate(zip(tokens, draft.q)):
            where = f"q[{j}]"
            if not dist.ids or len(dist.ids) != len(dist.probs):
                raise errors.invalid(Reason.REASON_BAD_DRAFT_DISTRIBUTION,
                                     f"{where} needs ids and probs of equal, non-zero length", draft.round)
            if len(dist.ids) > self.config.max_q_support:
                raise errors.invalid(Reason.REASON_BAD_DRAFT_DISTRIBUTION,
                                     f"{where} has {len(dist.ids)} entries, at most "
                                     f"{self.config.max_q_support} allowed", draft.round)
            self._check_ids(dist.ids, f"{where}.ids", draft.round)
            ids = torch.tensor(list(dist.ids), dtype=torch.long)
            probs = torch.tensor(list(dist.probs), dtype=torch.float64)
            if len(set(dist.ids)) != len(dist.ids) or not bool((probs > 0).all()):
                raise errors.invalid(Reason.REASON_BAD_DRAFT_DISTRIBUTION,
                                     f"{where} must list distinct ids with probs > 0", draft.round)
            if abs(float(probs.sum()) - 1.0) > PROB_SUM_TOLERANCE:
                raise errors.invalid(Reason.REASON_BAD_DRAFT_DISTRIBUTION,
                                     f"{where} probs sum to {float(probs.sum()):.4f}, not 1", draft.round)
            if token not in dist.ids:
                raise errors.invalid(Reason.REASON_BAD_DRAFT_DISTRIBUTION,
                                     f"draft token {token} at position {j} is outside its q support "
                                     "(q must be the distribution it was drawn from)", draft.round)
            result.append(DraftQ(ids, probs / probs.sum()))
        return result

    def _check_ids(self, ids, field: str, round: int = 0) -> None:
        bad = [t for t in ids if t >= self.target.vocab_size]
        if bad:
            raise errors.invalid(Reason.REASON_TOKEN_OUT_OF_RANGE,
                                 f"{field} has id {bad[0]} outside the target vocabulary "
                                 f"[0, {self.target.vocab_size})", round)
