"""The device round: open a session, then draft -> exchange -> commit until a verdict ends it.

    session = DeviceSession(stub, drafter, SessionRequest(prompt_ids, max_new_tokens=64),
                            RoundSettings(draft_len="adaptive", pipeline=True))
    result = await session.run()          # the target's own tokens

Round r: the device drafts draft_len tokens after its context (the prompt and the tokens
committed so far) and sends them; the server's verdict says how many it accepted and which
tokens it emitted (the accepted ones, then the target's correction or bonus). The device commits
the emitted tokens, rolls its drafter back past the rejected ones, and picks the next draft_len.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import grpc

from drafters.base import Drafter, Proposal
from edge_client.draft_policy import DraftPolicy
from edge_client.hint_policy import HINT_USES, HintPolicy
from edge_client.proposer import Draft, Head, Proposer
from edge_client.result import LOST, RESUMED, GenerationResult, RoundStat, ServerEvent
from edge_client.strikes import SILENT_RETRIES, Strikes
from edge_client.speculation import Speculation
from edge_client.transport import (ServerLost, Silence, Stream, Transport, VerifyError, lost_server,
                                   receive_within)
from edge_client.verdict_check import Asked, advised_draft_len, check_verdict
from edge_client.wire import SessionRequest, draft_message, drafter_label
from sled import clock
from sled.backoff import Backoff
from sled.printable import printable
from sled.v1 import verifier_pb2 as pb
from sled.wire.fingerprint import short

# First draft length of a draft_len="auto" session, before the server has suggested one.
AUTO_FIRST_DRAFT_LEN = 4
# Reopening: each attempt waits this long for its server at first, doubling up to the most ...
CONNECT_S, MAX_CONNECT_S = 1.0, 8.0
# ... and attempts after a lost server are this far apart at first, doubling up to the most;
# so are the reopenings after a strike (a server that failed the session with no verdict since
# it opened, or went silent), until a verdict comes.
PAUSE_S, MAX_PAUSE_S = 0.05, 2.0
# A first open's server must take the call this soon (a resuming open: its connect_s).
ACCEPT_S = 30.0
# How long a device waits by default for its session's Opened (the prompt's prefill, queued
# behind other sessions' work) and for each round's verdict before it treats the server as lost
OPEN_TIMEOUT_S, VERDICT_TIMEOUT_S = 120.0, 60.0


@dataclass(frozen=True, slots=True)
class RoundSettings:
    """How a device drafts and talks to the server. The output is the target's either way; these
    only change how many tokens a round yields and how long it takes.

    draft_len: tokens per draft; "auto" drafts what the previous verdict suggested, at most
    max_draft_len (AUTO_FIRST_DRAFT_LEN at first); "adaptive" lets a DraftPolicy pick the length
    with the most expected tokens per second from the session's acceptance, drafting speed and
    round trips (at most max_draft_len, capped by the suggestion).
    min_confidence > 0 ends a draft early after the first token the drafter is less sure of (its
    probability of the token it drafted); drafters without a confidence draft draft_len.
    pipeline keeps drafting while each verdict is in flight, on the path where the whole draft is
    accepted and the bonus is the drafter's own next token (edge_client/speculation.py), in the
    rounds where the session's own estimates say it pays (DraftPolicy.pipelining_pays).
    lookahead=m asks a SAT-tuned target for m hint tokens per verdict: when the last draft was
    accepted whole, the next draft may start with the hints, the drafter continuing after them,
    but only while the session's own rounds show the hints beating its drafter (HintPolicy);
    hints="always" uses every hint, unmeasured.
    A seeded sampling session pipelines and picks its lengths like any other: its tokens are
    fixed by its seed and their positions (sled.wire.keyed), however its rounds are split.
    tree=N > 1 lets the drafter (one that drafts trees: cacheback; the model drafters in greedy
    sessions) send up to N candidates per draft position as one tree of at most
    max_draft_tokens tokens (the server's ServerLimits.max_draft_tokens: its limit on the
    tokens of one draft, a chain or a tree); the server accepts the longest path the target
    agrees with. Rounds that pipeline or start with hints stay chains
    up to where the drafter's own part begins, and a branched draft asks for no SAT hints
    (they follow chains only).
    reconnect_s: how long a lost server is retried, with backoff, before the session fails
    (0: at once). timeout: the deadline of each Generate call (None: none). open_timeout_s and
    verdict_timeout_s: how long the server may take to answer an open with Opened and a draft
    with its verdict; a server silent longer is treated as lost (resumed, or failed over).
    silent_retries: how many strikes a server may have before the session gives it up; a strike
    is a silence, or a lost stream or an eviction with no verdict since the session last opened
    (edge_client.strikes). The next strike ends the session (ServerSilent after a silence, else
    ServerGivenUp), unless the server chooser offers another server, and each reopening after a
    strike waits a little longer first. A server that answers Opened and then stays silent thus
    holds a session for at most (silent_retries + 1) x verdict_timeout_s, plus the reopening
    (within reconnect_s): that is per server, so with N such servers to fail over between, up
    to N times as long (2N x verdict_timeout_s by default). A server that answers each verdict
    just under verdict_timeout_s is not silent: nothing caps it but max_new_tokens x
    verdict_timeout_s.
    """
    draft_len: int | str = 4
    max_draft_len: int = 16
    min_confidence: float = 0.0
    pipeline: bool = False
    lookahead: int = 0
    hints: str = "measured"
    tree: int = 1
    max_draft_tokens: int = 32
    reconnect_s: float = 30.0
    timeout: float | None = None
    open_timeout_s: float = OPEN_TIMEOUT_S
    verdict_timeout_s: float = VERDICT_TIMEOUT_S
    silent_retries: int = SILENT_RETRIES

    def __post_init__(self) -> None:
        fixed = isinstance(self.draft_len, int) and not isinstance(self.draft_len, bool)
        if not (fixed and self.draft_len >= 1 or self.draft_len in ("auto", "adaptive")):
            raise ValueError(f"draft_len must be >= 1, auto or adaptive, got {self.draft_len!r}")
        if self.max_draft_len < 1:
            raise ValueError(f"max_draft_len must be >= 1, got {self.max_draft_len}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {self.min_confidence}")
        if self.lookahead < 0 or self.reconnect_s < 0 or self.silent_retries < 0:
            raise ValueError(f"lookahead, reconnect_s and silent_retries must be >= 0, got "
                             f"{self.lookahead}, {self.reconnect_s} and {self.silent_retries}")
        if not (self.open_timeout_s > 0 and self.verdict_timeout_s > 0):
            raise ValueError(f"open_timeout_s and verdict_timeout_s must be > 0, got "
                             f"{self.open_timeout_s} and {self.verdict_timeout_s}")
        if self.tree < 1 or self.max_draft_tokens < 1:
            raise ValueError(f"tree and max_draft_tokens must be >= 1, got {self.tree} and "
                             f"{self.max_draft_tokens}")
        if self.hints not in HINT_USES:
            raise ValueError(f"hints must be {' or '.join(HINT_USES)}, got {self.hints!r}")


@dataclass(frozen=True, slots=True)
class SessionHooks:
    """What a session asks of whoever runs it, and tells it; each is optional. reopen_on() names
    the stub to use after a lost server (a failover); on_tokens sees each verdict's committed
    tokens, on_round each round's RoundStat, on_server a lost and a resumed server
    (ServerEvent). A server-side session has no rounds and no server chooser: it tells
    on_tokens and on_server only."""
    reopen_on: Callable[[], object] | None = None
    on_tokens: Callable[[list[int]], None] | None = None
    on_round: Callable[[RoundStat], None] | None = None
    on_server: Callable[[ServerEvent], None] | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """What the device knows of the served model (p) before a session opens, when it knows it:
    its tokenizer's fingerprint (a drafter with another tokenizer is then refused before
    anything is sent), its name (which that refusal names) and its vocabulary size (every id a
    verdict emits is checked against it; 0: unknown, unchecked)."""
    fingerprint: str | None = None
    model: str = ""
    vocab_size: int = 0


class DeviceSession:
    """One generation session of a device. It owns the context (prompt + committed tokens), the
    round, the draft length, the speculation and the result.

    If the server goes away mid-session (UNAVAILABLE: a restart, a dropped link) or evicts it,
    the session is reopened with the prompt + its committed tokens (`result.resumes` counts
    them). A lost server is told to `on_server` at once (a ServerEvent LOST), and again when a
    server took the session back (RESUMED); when none does within reconnect_s the session
    raises ServerLost, and `result` keeps the committed tokens (Reconnect: the waiting).
    `hooks.reopen_on()`, when given, is asked for the stub to use after each lost server (a
    failover); with it, the first open waits and retries the same way. `policy` is the
    DraftPolicy to use and keep teaching (a device's earlier sessions on the same server: its
    timings and acceptance carry over); default: a fresh one when adaptive or pipelining.
    `transport` opens each stream (an emulated link wraps it). Every verdict is checked against
    the draft and the request before anything of it is kept (edge_client.verdict_check, against
    the target's `vocab_size` when known): one that breaks the rules ends the session with
    BrokenVerdict.
    """

    def __init__(self, stub, drafter: Drafter, request: SessionRequest,
                 settings: RoundSettings = RoundSettings(), *, policy: DraftPolicy | None = None,
                 transport: Transport = Stream.open, hooks: SessionHooks = SessionHooks(),
                 vocab_size: int = 0) -> None:
        self.stub, self.request, self.settings = stub, request, settings
        self.vocab_size = vocab_size
        self.transport, self.hooks = transport, hooks
        self.reconnect = Reconnect(settings.reconnect_s, hooks.on_server, settings.silent_retries)
        self.proposer = Proposer(drafter, request.sampling, settings.min_confidence, settings.tree,
                                 settings.max_draft_tokens)
        adaptive = settings.draft_len == "adaptive"
        if policy is None and (adaptive or settings.pipeline):
            policy = DraftPolicy(max_draft_len=settings.max_draft_len)
        self.policy = policy
        self.hints = HintPolicy(settings.lookahead, always=settings.hints == "always")
        self.draft_len = policy.choose() if adaptive else \
            AUTO_FIRST_DRAFT_LEN if settings.draft_len == "auto" else settings.draft_len
        self.result = GenerationResult(loose=request.loose is not None)
        self.stream: Stream | None = None
        self.round = 0
        self.head: Head | None = None                  # what starts the next draft
        self.speculation: Speculation | None = None    # drafting while a verdict is in flight
        # clock.now() times of this round: the device's turn began, the draft left, the
        # verdict came (None after an open: the next turn begins when drafting does)
        self.started = self.turn_at = self.sent_at = 0.0
        self.verdict_at: float | None = None
        self.placement = pb.GENERATION_MODE_DEVICE_DRAFTS   # where the tokens come from now
        # the server may move it (Open.movable; never a loose session)
        self.movable = bool(request.movable and request.loose is None)

    @property
    def context(self) -> list[int]:
        """The prompt and every token committed so far: what the next draft continues."""
        return list(self.request.prompt_ids) + self.result.token_ids

    async def run(self) -> GenerationResult:
        """Open, then draft -> exchange -> commit until a verdict ends the session."""
        self.started = clock.now()
        try:
            await self.open(resuming=self.hooks.reopen_on is not None)
            while True:
                if self.placement != pb.GENERATION_MODE_DEVICE_DRAFTS:   # the server serves it
                    if await self.served():
                        break
                    continue
                draft = await self.next_draft()
                verdict = await self.exchange(draft)
                if verdict is not None and await self.commit(draft, verdict):
                    break
            await self.stream.done_writing()
            self.proposer.observe(self.context)       # the whole output, for later sessions
        except BaseException:
            await self.abandon()
            self.result.elapsed_s = clock.now() - self.started
            raise
        self.result.elapsed_s = clock.now() - self.started
        return self.result

    def partial(self, finish_reason: str) -> GenerationResult:
        """The committed tokens of a session that ended early (interrupted, server lost): the
        target's own output so far, ended for `finish_reason`."""
        self.result.finish_reason = finish_reason
        return self.result

    # -- open / resume ----------------------------------------------------------------------
    async def open(self, resuming: bool = False, lost: bool = False) -> None:
        """A stream for what is left: the prompt plus everything committed so far. Resuming
        (or opening with a server chooser) retries until reconnect_s has passed; lost: the last
        stream lost its server, so ask reopen_on() which one to use now."""
        self.stream = await (self.reopen(lost) if resuming else self.open_once())

    async def open_once(self, connect_s: float | None = None, switch: bool = False) -> Stream:
        """One attempt. connect_s (resuming) waits up to that long for the server to take the
        open message, then as long as the prefill takes. A server past its retries is not tried
        again (ServerGivenUp), and one that sends no Opened in time has one strike more."""
        if switch and self.hooks.reopen_on is not None:
            self.stub = self.hooks.reopen_on()
        self.reconnect.strikes.check(self.stub)
        if not self.request.fingerprint and self.stub is not None:
            # a drafter with no tokenizer of its own drafts the target's ids: say which
            fingerprint = await target_fingerprint(self.stub, connect_s)
            self.request = replace(self.request, fingerprint=fingerprint)
        opening = self.request.open_message(self.result.token_ids)
        try:
            stream = await open_stream(self.transport, self.stub, opening, self.settings.timeout,
                                       connect_s, self.settings.open_timeout_s)
        except Silence as silence:
            self.reconnect.strikes.add(self.stub, silence)
            raise
        self.placement = pb.GENERATION_MODE_DEVICE_DRAFTS      # a new open drafts, unless
        opened = stream.opened                                  # the server serves it at once
        if self.movable and opened.HasField("placement"):
            self.moved(opened.placement)
        return stream

    async def reopen(self, lost: bool) -> Stream:
        """Attempts with backoff until reconnect_s has passed (Reconnect.reopen)."""
        return await self.reconnect.reopen(self.open_once, len(self.result.token_ids), lost)

    async def resume(self, error: Exception) -> None:
        """The server freed this session (idle eviction) or went away (restart, network):
        reopen it where the committed tokens end (Reconnect: on the same server after an
        eviction; a strike against it when no verdict came since the last open). A verdict that
        never arrived committed nothing here, so no token is lost or repeated. Any other error
        ends the session."""
        evicted = isinstance(error, VerifyError) and error.reason == "REASON_EVICTED"
        if not evicted and not lost_server(error):
            raise error
        self.stream.cancel()
        await self.stop_speculating()
        self.proposer.rollback(len(self.context))
        self.result.resumes += 1
        committed = len(self.result.token_ids)
        if evicted:
            self.stream = await self.reconnect.resume_evicted(error, committed, self.open_once,
                                                              self.stub)
        else:
            self.stream = await self.reconnect.recover(error, committed, self.open_once, self.stub,
                                                       switch=self.hooks.reopen_on is not None)
        self.round, self.head, self.verdict_at = 0, None, None

    async def abandon(self) -> None:
        """The session failed or was cancelled: drop the stream and leave the drafter idle for
        whoever uses it next."""
        if self.stream is not None:
            self.stream.cancel()
        await self.stop_speculating()

    # -- the round --------------------------------------------------------------------------
    async def next_draft(self) -> Draft:
        """This round's draft of draft_len: its head (the server's hints or the tokens drafted
        ahead), then the drafter's own."""
        self.turn_at = self.verdict_at or clock.now()
        head, self.head = self.head, None
        self.proposer.observe(self.context)
        draft = await self.proposer.draft(self.context, self.draft_len, head)
        self.result.hint_tokens += draft.hinted
        self.result.pipelined_tokens += draft.pipelined
        return draft

    async def exchange(self, draft: Draft) -> pb.Verdict | None:
        """Send the draft, drafting ahead meanwhile, and wait for its verdict. None when the
        server lost the session: it is open again, and the round starts over."""
        self.speculation = self.speculate(draft.proposal)
        self.sent_at = clock.now()
        lookahead = 0 if draft.proposal.parents is not None else self.hints.ask()
        try:
            await self.stream.send(draft_message(self.round, draft.proposal, lookahead))
            verdict = (await receive_within(self.stream, self.settings.verdict_timeout_s,
                                            f"verdict for round {self.round}")).verdict
        except (VerifyError, grpc.aio.AioRpcError) as error:
            await self.resume(error)
            return None
        self.verdict_at = clock.now()   # the device's next turn starts here
        check_verdict(verdict, Asked(self.round, self.request.left(self.result.token_ids),
                                     self.vocab_size, draft.proposal, lookahead,
                                     self.request.loose is not None, self.movable))
        return verdict

    async def commit(self, draft: Draft, verdict: pb.Verdict) -> bool:
        """Take round r's verdict: what starts the next draft, the round's stats and the next
        draft length, the drafter rolled back past the rejected tokens, the emitted tokens
        committed. True when the verdict ends the session."""
        self.hints.observe(draft.hinted, verdict.accepted, verdict.emitted_ids)
        drafted_on = await self.settle(verdict)
        self.round += 1
        self.record(draft, verdict)
        if not drafted_on:
            self.proposer.rollback(len(self.context) + verdict.accepted)
        finished = self.result.add(verdict, self.started)
        if self.hooks.on_tokens is not None:
            self.hooks.on_tokens(list(verdict.emitted_ids))
        if not finished and verdict.HasField("placement"):
            self.moved(verdict.placement)
        return finished

    def moved(self, placement: int) -> None:
        """The server moved the session (Verdict.placement). To the server: what was drafted
        ahead is dropped, and the drafter rolled back to the committed context."""
        self.placement = placement
        self.result.moves += 1
        if placement != pb.GENERATION_MODE_DEVICE_DRAFTS:
            self.head = None
            self.proposer.rollback(len(self.context))

    async def served(self) -> bool:
        """The server serves the session: one verdict per server pass, each checked and
        committed, until one finishes the session (True) or moves it back to the device's
        drafting (False). A lost server reopens the session, placed as its new Opened says."""
        while True:
            try:
                verdict = (await receive_within(self.stream, self.settings.verdict_timeout_s,
                                                f"verdict for round {self.round}")).verdict
            except (VerifyError, grpc.aio.AioRpcError) as error:
                await self.resume(error)        # its Opened says where it goes on (open_once)
                return False
            check_verdict(verdict, Asked(self.round, self.request.left(self.result.token_ids),
                                         self.vocab_size, movable=True))
            self.round += 1
            finished = self.result.add(verdict, self.started, self.placement)
            if self.hooks.on_tokens is not None:
                self.hooks.on_tokens(list(verdict.emitted_ids))
            if finished:
                return True
            if verdict.HasField("placement"):
                self.moved(verdict.placement)
                if self.placement == pb.GENERATION_MODE_DEVICE_DRAFTS:
                    self.verdict_at = clock.now()
                    return False

    # -- the round's steps ------------------------------------------------------------------
    def speculate(self, proposal: Proposal) -> Speculation | None:
        """Draft ahead while this draft's verdict is in flight, when it pays, up to a next draft
        of draft_len and no further than max_new_tokens allows."""
        left = self.request.left(self.result.token_ids) - len(proposal.token_ids) - 1
        cap = min(self.draft_len, left)
        if not self.settings.pipeline or cap < 1 or proposal.parents is not None or \
                not self.policy.pipelining_pays(len(proposal.token_ids)):
            return None
        return self.proposer.speculate(self.context + proposal.token_ids, len(proposal.token_ids), cap)

    async def stop_speculating(self) -> Speculation | None:
        """Stop drafting ahead (after the step in flight); the speculation that ran, if any."""
        speculation, self.speculation = self.speculation, None
        if speculation is not None:
            await speculation.finish()
        return speculation

    async def settle(self, verdict: pb.Verdict) -> bool:
        """What starts the next draft: the server's hints, else the tokens drafted ahead when the
        verdict went the optimistic way. True when those go on from the drafter's state as it is
        (no rollback)."""
        speculation = await self.stop_speculating()
        kept = speculation.kept(verdict.accepted, verdict.emitted_ids) if speculation is not None else None
        self.head = Head(kept, ends=speculation.ended) if kept is not None else None
        if verdict.hint_ids and self.hints.take(verdict.hint_ids, self.draft_len):
            self.head = Head(Proposal(list(verdict.hint_ids)), hinted=True)
        return self.head is not None and not self.head.hinted

    def record(self, draft: Draft, verdict: pb.Verdict) -> None:
        """The round's stats, and what they say about the next draft length."""
        stat = RoundStat((self.sent_at - self.turn_at) * 1e3, (self.verdict_at - self.sent_at) * 1e3,
                         verdict.timings.forward_ms, verdict.timings.queue_ms, verdict.verified,
                         verdict.accepted, advised_draft_len(verdict, self.settings.max_draft_len),
                         draft.pipelined)
        self.result.round_stats.append(stat)
        if self.hooks.on_round is not None:
            self.hooks.on_round(stat)
        if self.settings.draft_len == "auto" and stat.suggested_draft_len:
            self.draft_len = stat.suggested_draft_len
        if self.policy is not None:
            self.policy.observe(stat.verified, stat.accepted, stat.draft_ms, stat.round_trip_ms)
        if self.settings.draft_len == "adaptive":
            self.draft_len = self.policy.choose(stat.suggested_draft_len)


# attempt(connect_s, switch) -> a Stream the session is open on again: one try at reopening it,
# waiting up to connect_s for its server (switch: ask first which server to use now)
Attempt = Callable[[float, bool], Awaitable[Stream]]


class Reconnect:
    """How any session (device drafts or server modes) waits for a lost server: it tells
    `on_server` at once (LOST), retries its opening with backoff until reconnect_s has passed,
    and tells again when a server took the session back (RESUMED); ServerLost when none did.
    A server that went silent, or failed the session with no verdict since it last opened, has
    a strike (`strikes`): the reopening then waits a pause first, longer after each strike until
    a verdict comes, and a server is retried at most silent_retries times."""

    def __init__(self, reconnect_s: float, on_server: Callable[[ServerEvent], None] | None = None,
                 silent_retries: int = SILENT_RETRIES) -> None:
        self.reconnect_s, self.on_server = reconnect_s, on_server
        self.strikes = Strikes(silent_retries)
        self.struck = Backoff(PAUSE_S, most=MAX_PAUSE_S)   # the pause before reopening after a strike
        self.opened_with = 0                                # tokens committed at the last open

    async def recover(self, error: Exception, committed: int, attempt: Attempt,
                      server: object = None, switch: bool = False) -> Stream:
        """The server went away after `committed` tokens: say so, wait for it (or another). A
        strike counts against `server`; one past its retries ends the session here
        (ServerGivenUp), unless the attempts `switch` servers (a chooser may offer another)."""
        struck = self.strike(server, error, committed, check=not switch)
        detail = printable(error.message if isinstance(error, VerifyError) else str(error), 200)
        self.tell(ServerEvent(LOST, committed, self.reconnect_s, detail,
                              silent=isinstance(error, Silence)))
        if not self.reconnect_s:
            raise self.gave_up(committed) from None
        started = clock.now()
        await self.pause(struck)
        stream = await self.reopen(attempt, committed, lost=True)
        self.tell(ServerEvent(RESUMED, committed, self.reconnect_s,
                              f"after {clock.now() - started:.1f} s"))
        return stream

    async def resume_evicted(self, error: VerifyError, committed: int, attempt: Attempt,
                      server: object = None) -> Stream:
        """The server freed the session (an idle eviction) after `committed` tokens: reopen it
        there at once, or after a pause when that is a strike (ServerGivenUp past its retries)."""
        await self.pause(self.strike(server, error, committed))
        stream = await attempt(None, False)
        self.opened_with = committed
        return stream

    def strike(self, server: object, error: Exception, committed: int, check: bool = True) -> bool:
        """Whether `error` is a strike against `server`, counted when it is: a silence, or any
        failure with no token committed since the session last opened. check: ServerGivenUp
        when that puts it past its retries."""
        if not isinstance(error, Silence) and committed > self.opened_with:
            return False
        self.strikes.add(server, error)
        if check:
            self.strikes.check(server)
        return True

    async def pause(self, struck: bool) -> None:
        """Before reopening: a pause after a strike, each longer than the last (a server that
        opens and then fails every draft is not reopened in a tight loop); none after progress."""
        if struck:
            await self.struck.wait()
        else:
            self.struck.reset()

    async def reopen(self, attempt: Attempt, committed: int, lost: bool) -> Stream:
        """Attempts with backoff until reconnect_s has passed. Each waits for its server a
        bounded time, and every attempt after a lost server asks again which server to use (the
        one it waited for may be gone for good)."""
        give_up = clock.now() + self.reconnect_s
        pauses, waits = Backoff(PAUSE_S, most=MAX_PAUSE_S), Backoff(CONNECT_S, most=MAX_CONNECT_S)
        while True:
            left = give_up - clock.now()
            try:
                stream = await attempt(max(min(left, waits.current), 0.01), lost)
                self.opened_with = committed
                return stream
            except asyncio.TimeoutError:
                if left <= waits.current:
                    raise self.gave_up(committed) from None
                waits.next()                   # the next attempt waits longer for its server
            except (VerifyError, grpc.aio.AioRpcError) as error:
                if not lost_server(error):
                    raise
                if clock.now() + pauses.current > give_up:
                    raise self.gave_up(committed) from None
            lost = True
            await pauses.wait()

    def gave_up(self, committed: int) -> ServerLost:
        return ServerLost(f"no server came back within {self.reconnect_s:g} s to resume "
                          f"the session after {committed} committed tokens")

    def tell(self, event: ServerEvent) -> None:
        if self.on_server is not None:
            self.on_server(event)


async def open_stream(transport: Transport, stub, opening: pb.DeviceMessage, timeout: float | None,
                      connect_s: float | None = None,
                      open_timeout_s: float = OPEN_TIMEOUT_S) -> Stream:
    """A Generate stream on which the session is open: `opening` sent and Opened received (the
    prompt is in the server's KV). The server must take the call (Stream.accepted) within
    connect_s when resuming (asyncio.TimeoutError: it is still away), ACCEPT_S otherwise (a lost
    server); Opened must then come within open_timeout_s (the prefill, queued behind others'
    work), else the server is treated as lost. A written message proves nothing: grpc takes it
    before any server has, and a call that reached a server as it stopped is never answered at
    all."""
    resuming = connect_s is not None
    stream = transport(stub, timeout=timeout, wait_for_ready=resuming)
    try:
        try:
            await asyncio.wait_for(_sent_and_taken(stream, opening), connect_s if resuming else ACCEPT_S)
        except asyncio.TimeoutError:
            if resuming:
                raise
            raise VerifyError(grpc.StatusCode.UNAVAILABLE,
                              f"the server took no Generate call within {ACCEPT_S:g} s (it is "
                              "stopping, or stuck)") from None
        stream.opened = (await receive_within(stream, open_timeout_s, "Opened")).opened
    except BaseException:
        stream.cancel()
        raise
    return stream


async def _sent_and_taken(stream: Stream, opening: pb.DeviceMessage) -> None:
    await stream.send(opening)
    if opening.open.mode != pb.GENERATION_MODE_DEVICE_DRAFTS:
        # A server mode: the Open is all the device sends, and it says so at once. A stream the
        # server ends while the device's side is still open is reset, not ended, and a proxy may
        # turn that reset into CANCELLED before the last verdicts get through (docs/protocol.md).
        await stream.done_writing()
    await stream.accepted()


async def target_fingerprint(stub, connect_s: float | None = None) -> str:
    """The served model's tokenizer fingerprint (ModelInfo), for a drafter that has no tokenizer
    of its own and drafts in the target's ids. connect_s (resuming) waits that long for a server
    that is not up: one still away then is asyncio.TimeoutError, as a stream's opening is."""
    try:
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=connect_s or 30.0,
                                       wait_for_ready=connect_s is not None)
    except grpc.aio.AioRpcError as error:
        if connect_s is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise asyncio.TimeoutError from None
        raise
    return info.tokenizer_fingerprint


def drafter_fingerprint(drafter: Drafter, target_fingerprint: str | None,
                        target_model: str = "") -> str:
    """The tokenizer fingerprint a session opens with: the drafter's, else the target's. A
    drafter whose tokenizer is not the target's is refused before anything is sent, named as
    the user gave it (gguf:smollm2-135m) next to the served model (target_model, when known)."""
    own = drafter.tokenizer_fingerprint
    if target_fingerprint and own and own != target_fingerprint:
        served = f"the served model {printable(target_model, 200)}" if target_model else "the served model"
        raise VerifyError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"the drafter {described(drafter)} does not share a tokenizer with "
                          f"{served}: its drafts cannot be verified (tokenizer {short(own)} vs "
                          f"{printable(short(target_fingerprint))}); xtok:{drafter_name(drafter)} "
                          "drafts across tokenizers", "REASON_TOKENIZER_MISMATCH")
    return own or target_fingerprint or ""


def drafter_name(drafter: Drafter) -> str:
    """The drafter as a person named it: its built-in alias (gguf:smollm2-135m) when it was
    loaded from one, else its own name without the device's path (what the server sees)."""
    return drafter_label(getattr(drafter, "alias", None) or drafter.name)


def described(drafter: Drafter) -> str:
    """The drafter in a message: its alias and the file behind it, or its name."""
    name, own = drafter_name(drafter), drafter_label(drafter.name)
    return f"{name} ({own.partition(':')[2] or own})" if name != own else name


def device_session(stub, drafter: Drafter, request: SessionRequest,
                   settings: RoundSettings = RoundSettings(), *, target: Target = Target(),
                   policy: DraftPolicy | None = None, transport: Transport = Stream.open,
                   hooks: SessionHooks = SessionHooks()) -> DeviceSession:
    """One generation session of `request`, ready to run (a DeviceSession); it opens with the
    drafter's name and tokenizer fingerprint (else the target's). A target whose fingerprint is
    known refuses a drafter with another tokenizer before anything is sent (naming the target's
    model). request.cache_salt scopes the server's prefix cache: sessions share cached prompt
    blocks only with the same salt from the same host. request.loose: opt-in loose verification
    (sled.wire.loose): the output is then NOT exactly the target's."""
    request = replace(request, fingerprint=drafter_fingerprint(drafter, target.fingerprint, target.model),
                      drafter=drafter_name(drafter))
    return DeviceSession(stub, drafter, request, settings, policy=policy, transport=transport,
                         hooks=hooks, vocab_size=target.vocab_size)


async def generate(stub, drafter: Drafter, request: SessionRequest,
                   settings: RoundSettings = RoundSettings(), **options) -> GenerationResult:
    """Run one generation session to its end: device_session(...).run(), the same options."""
    return await device_session(stub, drafter, request, settings, **options).run()
