"""The scheduler: gathers every session's pending work into one batched forward per step.

There is no fixed wait: while one forward runs on the engine thread, new work queues up, and the
next step takes what fits. Each step has a token budget: verification comes first, earliest
deadline first, then prompt prefill in chunks of whatever budget is left (so a long prompt never
holds up other devices' rounds; the oldest prompt always gets at least 1/8 of the budget, so
verification cannot starve it either). Work whose deadline has passed is dropped before the
forward.

A step, on the engine thread, is plan -> forward -> decide -> keep; its outcomes then reply to
each work's future on the loop:

    rows = [work.row(share) ...]                       # plan: the rows the budget admits
    outcomes = verify_step(engine, rows, proposals)    # forward, then acceptance.decide
    work.keep(row, outcome)                            # prefill KV committed, tree paths moved

Where the engine's forward returns before its kernels end (flex on CUDA: `launches_ahead`), the
host's part of a step hides behind the device's: step t+1 is planned, uploaded and launched
while step t's kernels run, and step t is decided while step t+1's run (`overlap`). Only a step
decided from its argmax alone (greedy rows, SAT hints, prefill) is decided after the next
launch; its argmax is on its way to the host behind its own kernels, so its decision waits for
its step alone. A step with a sampling or loose row is decided before the next is launched: its
decision reads logits the next step would overwrite, on a device the next step would occupy.
The two steps in flight never share a session (a session's next work waits on its verdict), so
every verdict is the one the serial order gives.
"""
from __future__ import annotations

import asyncio
import contextvars
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sled import clock
from verify_server import errors
from verify_server.acceptance import DraftQ, Outcome, Proposal, decide
from verify_server.engines.base import Engine, StepLogits
from verify_server.engines.rows import Row
from verify_server.errors import Reason
from verify_server.metrics import Metrics
from verify_server.placement import StepLoad
from verify_server.session import Fed, Session

# --- the work a session queues ----------------------------------------------------------------------
# Each item gives a step its row (`row`) and what deciding it takes (`proposal`: the whole step
# is decided at once). After the decision `keep` puts the KV in order on the engine thread: a
# prefill chunk is all kept, so it commits its own KV; a tree's accepted path is moved to where
# a chain's would be, and the row is recorded on its session (Session.fed). A round's tokens and
# the rest of its KV are committed by `Session.commit` when the round finishes
# (rounds.finish_round), checked against that record.

@dataclass(slots=True, eq=False)
class Work:
    session: Session
    future: asyncio.Future | None   # None until the scheduler queues it
    deadline: float | None = None        # clock.now() time after which the work is useless
    enqueued: float = field(default_factory=clock.now)

    @property
    def tokens_wanted(self) -> int:
        """Tokens this work would put into the next forward if the budget allowed."""
        raise NotImplementedError

    def row(self, budget: int) -> Row:
        raise NotImplementedError

    def proposal(self) -> Proposal | None:
        """What deciding this work's row takes; None when there is nothing to decide."""
        return None

    def keep(self, row: Row, outcome: Outcome | None) -> None:
        """After the step's decision (engine thread): the KV this work keeps now."""

    @property
    def done(self) -> bool:
        return True


@dataclass(slots=True, eq=False)
class Prefill(Work):
    """The prompt (all but its last token) into the session's KV, in chunks of the step budget;
    `round_tokens`: the most entries a row of the session's rounds has, which its KV then
    narrows to (SessionKV.narrow; 0: not told)."""
    round_tokens: int = 0

    @property
    def tokens_wanted(self) -> int:
        return len(self.session.prompt_ids) - 1 - self.session.kv.length

    def row(self, budget: int) -> Row:
        start = self.session.kv.length
        return Row(self.session.kv, self.session.prompt_ids[start:start + budget], want_logits=False)

    def keep(self, row: Row, outcome: Outcome | None) -> None:
        """The chunk committed; the prompt's full blocks published once it is in, or with every
        chunk in a windowed pool: its windowed layer groups drop the blocks out of their window
        before the next chunk, and a later prompt sharing only a prefix of this one needs those
        before its end."""
        kv = self.session.kv
        kv.commit(len(row.tokens))
        if self.done or kv.pool.windowed:
            kv.publish(self.session.prompt_ids)
        if self.done and self.round_tokens:
            kv.narrow(self.round_tokens)

    @property
    def done(self) -> bool:
        return self.tokens_wanted <= 0


@dataclass(slots=True, eq=False)
class Verify(Work):
    draft: list[int] = field(default_factory=list)       # [draft_len], already cut to what fits
    q: list[DraftQ] | None = None                        # [draft_len], None: deterministic drafter
    lookahead: int = 0                                   # m SAT slots after the draft
    every_cut: bool = False    # SAT slots after every place the draft may be cut, not only its end
    parents: list[int] | None = None    # a tree draft's parent indices (sled.wire.tree); None: a chain

    @property
    def tokens_wanted(self) -> int:
        return sat_step_tokens(len(self.draft), self.lookahead, self.every_cut)

    def row(self, budget: int) -> Row:
        anchors = tuple(range(1, len(self.draft) + 2)) if self.every_cut and self.lookahead else ()
        return Row(self.session.kv, [self.session.last_token, *self.draft], want_logits=True,
                   sat_slots=self.lookahead, sat_anchors=anchors, parents=tuple(self.parents or ()))

    def proposal(self) -> Proposal:
        session = self.session
        return Proposal(self.draft, session.sampling, session.generator, self.q,
                        tuple(self.parents or ()), session.loose, self.lookahead, self.every_cut,
                        len(session.prompt_ids) + len(session.generated))

    def keep(self, row: Row, outcome: Outcome | None) -> None:
        if self.parents and outcome is not None:
            self.session.kv.keep_path(outcome.path)
        self.session.fed = Fed(row.kv.length, row.tokens)    # what Session.commit checks against


def sat_step_tokens(draft_len: int, lookahead: int, every_cut: bool = False) -> int:
    """Positions a verify puts into a pass: the last token, the draft and its SAT slots (one
    block, or one after every place the draft may be cut)."""
    blocks = draft_len + 1 if every_cut else 1
    return draft_len + 1 + lookahead * blocks


# --- the scheduler -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StepInfo:
    queue_ms: float
    forward_ms: float
    batch_size: int


def _priority(work: Work) -> tuple[float, float]:
    return (work.deadline if work.deadline is not None else math.inf, work.enqueued)


class Scheduler:
    """`overlap`: launch each step before the last is decided (see the module's docstring);
    None: where the engine launches ahead of its kernels."""

    def __init__(self, engine: Engine, metrics: Metrics, max_batch_sessions: int = 64,
                 max_step_tokens: int = 2048, overlap: bool | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.overlap = getattr(engine, "launches_ahead", False) if overlap is None else overlap
        self.max_batch_sessions = max_batch_sessions
        self.max_step_tokens = max_step_tokens
        self.min_prefill_chunk = max(1, max_step_tokens // 8)
        self.load = StepLoad()      # the GPU's recent load (the placement policy's)
        self._queue: list[Work] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sled-engine")
        # The engine thread runs steps in the context the engine was built in: torch keeps its
        # compiler settings (e.g. the flex engine's recompile limit) in context variables, which
        # a new thread would otherwise see at their defaults.
        self._context = contextvars.copy_context()
        self._in_flight: dict[Session, int] = {}     # session -> its steps in flight
        self._release_after_step: dict[Session, asyncio.Future] = {}   # -> done once freed
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sled-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for work in self._queue:
            work.future.cancel()
        self._queue.clear()
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def prefill(self, session: Session, deadline: float | None = None,
                      round_tokens: int = 0) -> StepInfo:
        """The session's prompt in; `round_tokens`: the widest row its rounds will have, which
        its KV narrows to once the prompt is in (Prefill)."""
        if session.kv.length >= len(session.prompt_ids) - 1:   # nothing left, e.g. a prefix-cache hit
            if round_tokens:
                session.kv.narrow(round_tokens)
            return StepInfo(0.0, 0.0, 0)
        _, info = await self._submit(Prefill(session, self._new_future(), deadline,
                                             round_tokens=round_tokens))
        return info

    async def verify(self, session: Session, draft: list[int], q: list[DraftQ] | None,
                     deadline: float | None = None, lookahead: int = 0,
                     parents: list[int] | None = None) -> tuple[Outcome, StepInfo]:
        """parents: a tree draft's (sled.wire.tree), None for a chain."""
        return await self._submit(Verify(session, self._new_future(), deadline, draft=draft, q=q,
                                         lookahead=lookahead, parents=parents))

    def release(self, session: Session) -> asyncio.Future:
        """Forget the session: drop its queued work and free its KV (after the step in flight).
        The future returned is done once its KV is free."""
        for work in [w for w in self._queue if w.session is session]:
            self._queue.remove(work)
            work.future.cancel()
        if session in self._release_after_step:
            return self._release_after_step[session]
        freed = asyncio.get_running_loop().create_future()
        if session in self._in_flight:
            self._release_after_step[session] = freed
        else:
            self._free(session)
            freed.set_result(None)
        return freed

    def _free(self, session: Session) -> None:
        session.kv.free()

    def _new_future(self) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    def enqueue(self, work: Work) -> asyncio.Future:
        """Queue work now; the returned future resolves to (result, StepInfo) after its step."""
        if work.future is None:
            work.future = self._new_future()
        self._queue.append(work)
        self._wake.set()
        return work.future

    async def _submit(self, work: Work):
        return await self.enqueue(work)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending: Launched | None = None      # a step launched, not yet decided (overlap)
            while self._queue or pending is not None:
                await asyncio.sleep(0)   # sessions the last step answered queue their next work first
                plan = self._plan(clock.now())
                if self.overlap:
                    pending = await self._advance(plan, pending)
                elif plan:
                    await self._step(plan)

    def _plan(self, now: float) -> list[tuple[Work, int]]:
        """Take this step's work off the queue: (work, tokens it gets) within the budget."""
        for work in [w for w in self._queue if w.future.done()]:
            self._queue.remove(work)
        expired = [w for w in self._queue if w.deadline is not None and w.deadline < now]
        for work in expired:
            self._queue.remove(work)
            self.metrics.expired.inc()
            late_ms = (now - work.deadline) * 1e3
            work.future.set_exception(errors.deadline(
                Reason.REASON_DEADLINE_EXCEEDED,
                f"round {work.session.round} of session {work.session.id} missed its deadline by "
                f"{late_ms:.0f} ms waiting behind {len(self._queue) + len(expired) - 1} queued rounds; it "
                "was not verified: send shorter drafts, allow a longer deadline, or use a less "
                "loaded server",
                work.session.round))
        budget, plan = self.max_step_tokens, []
        verifies = sorted((w for w in self._queue if isinstance(w, Verify)), key=_priority)
        prefills = sorted((w for w in self._queue if isinstance(w, Prefill)), key=_priority)
        for work in verifies:
            if len(plan) == self.max_batch_sessions or work.tokens_wanted > budget:
                break
            plan.append((work, work.tokens_wanted))
            budget -= work.tokens_wanted
        for i, work in enumerate(prefills):
            if len(plan) == self.max_batch_sessions:
                break
            # The first prefill always gets a minimum chunk, so verification cannot starve it.
            share = min(work.tokens_wanted, max(budget, self.min_prefill_chunk) if i == 0 else budget)
            if share <= 0:
                break
            plan.append((work, share))
            budget -= share
        for work, _ in plan:
            self._queue.remove(work)
        return plan

    async def execute(self, plan: list[tuple[Work, int]]) -> list[Outcome | None]:
        """Run the planned step: on the engine thread, in the context the engine was built in.
        (The fleet simulator runs it on the loop and waits out the step-cost profile's time.)"""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._context.run, run_step, self.engine, plan)

    async def _step(self, plan: list[tuple[Work, int]]) -> None:
        started = clock.now()
        self._enter(plan)
        try:
            outcomes = await self.execute(plan)
            failure = None
        except Exception as exc:  # the step failed: every session in it hears why
            outcomes, failure = [None] * len(plan), exc
        self._answer(plan, started, outcomes, failure)

    async def _advance(self, plan: list[tuple[Work, int]],
                       pending: Launched | None) -> Launched | None:
        """Overlap: launch this plan's step and decide the pending one (engine thread, in the
        order `advance` picks), answer the pending one's work; the launched step is pending."""
        if plan:
            self._enter(plan)
            if pending is not None and pending.argmax_decides:
                self.metrics.overlapped_steps.inc()
        launched, decided = await asyncio.get_running_loop().run_in_executor(
            self._executor, self._context.run, advance, self.engine, plan, pending)
        if pending is not None:
            self._answer(pending.plan, pending.started, *decided)
        return launched

    def _enter(self, plan: list[tuple[Work, int]]) -> None:
        for work, _ in plan:
            self._in_flight[work.session] = self._in_flight.get(work.session, 0) + 1

    def _leave(self, plan: list[tuple[Work, int]]) -> None:
        for work, _ in plan:
            left = self._in_flight.pop(work.session) - 1
            if left:
                self._in_flight[work.session] = left
        for session in [s for s in self._release_after_step if s not in self._in_flight]:
            freed = self._release_after_step.pop(session)
            self._free(session)
            if not freed.done():
                freed.set_result(None)

    def _answer(self, plan: list[tuple[Work, int]], started: float,
                outcomes: list[Outcome | None], failure: Exception | None) -> None:
        """After a step is decided: its metrics, the KV of sessions released meanwhile, and
        each work's reply (a prefill with chunks to go queued again)."""
        self._leave(plan)
        ended = clock.now()
        self.load.step(started, ended)
        forward_ms = (ended - started) * 1e3
        self.metrics.forward_passes.inc()
        self.metrics.forward_tokens.inc(sum(n for _, n in plan))
        self.metrics.batch_size.observe(len(plan))
        self.metrics.forward_seconds.observe(forward_ms / 1e3)
        for (work, _), result in zip(plan, outcomes):
            if work.future.done():
                continue
            if failure is not None:
                work.future.set_exception(failure)
            elif not work.done:       # a prefill with more chunks to go
                self._queue.append(work)
            else:
                info = StepInfo((started - work.enqueued) * 1e3, forward_ms, len(plan))
                work.future.set_result((result, info))


# --- a step on the engine thread -------------------------------------------------------------------

@dataclass(slots=True, eq=False)
class Launched:
    """A step launched and not yet decided: its work, rows and proposals, and its logits (or
    why it failed)."""
    plan: list[tuple[Work, int]]
    rows: list[Row]
    proposals: list[Proposal | None]
    started: float
    logits: StepLogits | None = None
    failure: Exception | None = None

    @property
    def argmax_decides(self) -> bool:
        """Whether its decision reads the argmax alone (no sampling or loose row), so it may
        wait behind the next step's launch."""
        return all(p is None or (p.sampling.greedy and p.loose is None) for p in self.proposals)


def launch_step(engine: Engine, plan: list[tuple[Work, int]]) -> Launched:
    """Engine thread: the planned rows' forward launched (on CUDA it returns before its
    kernels end); a failure is kept for the step's decision to report."""
    rows = [work.row(share) for work, share in plan]
    launched = Launched(plan, rows, [work.proposal() for work, _ in plan], clock.now())
    try:
        launched.logits = engine.launch(rows, send_argmax=launched.argmax_decides)
    except Exception as exc:  # the step failed: every session in it hears why
        launched.failure = exc
    return launched


def decide_step(launched: Launched) -> tuple[list[Outcome | None], Exception | None]:
    """Engine thread: a launched step decided (waiting for its argmax), then the KV each work
    keeps: (outcomes, None), or (Nones, why it failed)."""
    nothing = [None] * len(launched.plan)
    if launched.failure is not None:
        return nothing, launched.failure
    try:
        outcomes = decide(launched.proposals, launched.logits)
        for (work, _), row, outcome in zip(launched.plan, launched.rows, outcomes):
            work.keep(row, outcome)
    except Exception as exc:
        return nothing, exc
    return outcomes, None


def advance(engine: Engine, plan: list[tuple[Work, int]], pending: Launched | None
            ) -> tuple[Launched | None, tuple[list[Outcome | None], Exception | None] | None]:
    """Engine thread, overlapping: the next step launched while the pending one's kernels run,
    then the pending one decided while the next one's run; a pending step decided from more
    than its argmax is decided first. (launched or None, the pending step's decision or None)."""
    decided = None
    if pending is not None and not pending.argmax_decides:
        decided = decide_step(pending)
    launched = launch_step(engine, plan) if plan else None
    if pending is not None and decided is None:
        decided = decide_step(pending)
    return launched, decided


def run_step(engine: Engine, plan: list[tuple[Work, int]]) -> list[Outcome | None]:
    """Engine thread: the step of the planned work, then the KV each work keeps."""
    rows = [work.row(share) for work, share in plan]
    outcomes = verify_step(engine, rows, [work.proposal() for work, _ in plan])
    for (work, _), row, outcome in zip(plan, rows, outcomes):
        work.keep(row, outcome)
    return outcomes


def verify_step(engine: Engine, rows: list[Row],
                proposals: list[Proposal | None]) -> list[Outcome | None]:
    """One forward over the rows and the decision of all of them: the step the server runs and
    `sled bench engine` times."""
    return decide(proposals, engine.forward(rows))
