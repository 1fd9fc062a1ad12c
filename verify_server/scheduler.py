"""The scheduler: gathers every session's pending work into one batched forward per step.

There is no fixed wait: while one forward runs on the engine thread, new work queues up, and the
next step takes all of it. A burst of devices therefore lands in one pass, and a lone device pays
only its own forward.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from verify_server.acceptance import Outcome, SparseQ
from verify_server.engine import Engine
from verify_server.metrics import Metrics
from verify_server.session import Session
from verify_server.work import Prefill, Verify, Work


@dataclass(frozen=True, slots=True)
class StepInfo:
    queue_ms: float
    forward_ms: float
    batch_size: int


class Scheduler:
    def __init__(self, engine: Engine, metrics: Metrics, max_batch_sessions: int = 64) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_batch_sessions = max_batch_sessions
        self._queue: list[Work] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sled-engine")
        self._in_flight: set[Session] = set()
        self._release_after_step: set[Session] = set()
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

    async def prefill(self, session: Session) -> StepInfo:
        if not session.prefill_tokens():
            return StepInfo(0.0, 0.0, 0)
        _, info = await self._submit(Prefill(session, self._new_future()))
        return info

    async def verify(self, session: Session, draft: list[int],
                     q: list[SparseQ] | None) -> tuple[Outcome, StepInfo]:
        return await self._submit(Verify(session, self._new_future(), draft=draft, q=q))

    def release(self, session: Session) -> None:
        """Forget the session: drop its queued work and free its KV (after the step in flight)."""
        for work in [w for w in self._queue if w.session is session]:
            self._queue.remove(work)
            work.future.cancel()
        if session in self._in_flight:
            self._release_after_step.add(session)
        else:
            self._free(session)

    def _free(self, session: Session) -> None:
        self.metrics.kv_tokens.dec(session.kv.length)
        session.kv.free()

    def _new_future(self) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    async def _submit(self, work: Work):
        self._queue.append(work)
        self._wake.set()
        return await work.future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._queue[: self.max_batch_sessions]
                del self._queue[: len(batch)]
                batch = [w for w in batch if not w.future.done()]
                if batch:
                    await self._step(loop, batch)

    async def _step(self, loop: asyncio.AbstractEventLoop, batch: list[Work]) -> None:
        started = time.perf_counter()
        sessions = {w.session for w in batch}
        self._in_flight = sessions
        kv_before = sum(s.kv.length for s in sessions)
        try:
            results = await loop.run_in_executor(self._executor, _run_step, self.engine, batch)
        except Exception as exc:  # the forward itself failed: every session in it hears why
            results = [(None, exc)] * len(batch)
        finally:
            self._in_flight = set()
        forward_ms = (time.perf_counter() - started) * 1e3
        self.metrics.forward_passes.inc()
        self.metrics.batch_size.observe(len(batch))
        self.metrics.forward_seconds.observe(forward_ms / 1e3)
        self.metrics.kv_tokens.inc(sum(s.kv.length for s in sessions) - kv_before)
        for session in self._release_after_step:
            self._free(session)
        self._release_after_step.clear()
        for work, (result, error) in zip(batch, results):
            if work.future.done():
                continue
            if error is not None:
                work.future.set_exception(error)
            else:
                info = StepInfo((started - work.enqueued) * 1e3, forward_ms, len(batch))
                work.future.set_result((result, info))


def _run_step(engine: Engine, batch: list[Work]) -> list[tuple[object, Exception | None]]:
    """Engine thread: one forward over the batch, then each work item's acceptance."""
    logits = engine.forward([work.row() for work in batch])
    results: list[tuple[object, Exception | None]] = []
    for work, row_logits in zip(batch, logits):
        try:
            results.append((work.complete(row_logits), None))
        except Exception as exc:
            results.append((None, exc))
    return results
