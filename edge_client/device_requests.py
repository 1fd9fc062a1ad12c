"""A device's local requests: what one asks (Request), what comes back (Chunk), why one is
refused (DeviceError), and Requests, which checks each, runs it within max_sessions and streams
its chunks as they come."""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from edge_client.bootstrap import Bootstrap
from edge_client.device_status import DeviceMetrics, DeviceState
from edge_client.settings import DeviceSettings
from sled.wire.loose import Loose
from sled.wire.sampling import Sampling

# A request id comes back in every chunk and names an MQTT topic level: kept short.
MAX_REQUEST_ID_CHARS = 128


class DeviceError(Exception):
    """A request the device cannot serve. `kind` maps to an HTTP status in the local API:
    invalid (400), unavailable (503), busy (429)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(slots=True)
class Request:
    prompt_ids: list[int]
    max_tokens: int | None = None              # None: the device's max_new_tokens
    sampling: Sampling = Sampling()
    stop_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    request_id: str = ""
    loose: Loose | None = None                 # opt-in loose verification: NOT lossless


@dataclass(slots=True)
class Chunk:
    """Tokens committed by one verdict, or drafted alone (lossless=False)."""
    token_ids: list[int]
    finish_reason: str | None = None           # "eos", "stop" or "length" on the last chunk
    # the target's own output; False only for the opt-in lossy modes: drafting alone, and loose
    # verification (Request.loose)
    lossless: bool = True


# generate(request, queue) puts the request's chunks on the queue, the last with its finish reason
Generate = Callable[[Request, asyncio.Queue], Awaitable[None]]


class Requests:
    """Every request goes through stream(): checked against what the device has (bootstrap) and
    its settings as they are now (`settings()`), given an id, then generated (`generate`) with
    at most max_sessions at once, counted in the metrics."""

    def __init__(self, bootstrap: Bootstrap, state: DeviceState, metrics: DeviceMetrics,
                 settings: Callable[[], DeviceSettings], generate: Generate) -> None:
        self.bootstrap, self.state, self.metrics = bootstrap, state, metrics
        self.settings, self.generate = settings, generate
        self.slots = asyncio.Semaphore(settings().max_sessions)
        self.active = 0
        self.ids = itertools.count(1)

    def resize(self, max_sessions: int) -> None:
        """A new max_sessions, for the requests that start from now on."""
        self.slots = asyncio.Semaphore(max_sessions)

    async def stream(self, request: Request) -> AsyncIterator[Chunk]:
        """Generate one request, yielding each verdict's committed tokens as they arrive."""
        self.validate(request)
        if not request.request_id:
            request.request_id = f"req-{next(self.ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(self.run(request, queue))
        outcome = "error"
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    outcome = "ok"
                    break
        finally:
            if not task.done():
                task.cancel()
                outcome = "cancelled" if outcome == "error" else outcome
            await asyncio.gather(task, return_exceptions=True)
            self.metrics.requests.labels(outcome).inc()

    def validate(self, request: Request) -> None:
        if not self.bootstrap.ready:
            raise DeviceError("unavailable", f"the device is not ready: {self.state.reason or self.state.state}")
        if not request.prompt_ids:
            raise DeviceError("invalid", "the prompt is empty")
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise DeviceError("invalid", f"a request id may have at most {MAX_REQUEST_ID_CHARS} "
                                         f"characters (got {len(request.request_id)})")
        vocab = len(self.bootstrap.tokenizer)
        bad = [t for t in itertools.chain(request.prompt_ids, request.stop_ids) if not 0 <= t < vocab]
        if bad:
            raise DeviceError("invalid", f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        # max_tokens travels as a uint32 (MQTT requests reach here unchecked)
        if request.max_tokens is not None and not 1 <= request.max_tokens < 2**32:
            raise DeviceError("invalid", f"max_tokens must be in [1, 2**32), got {request.max_tokens}")
        if request.loose is not None:
            self.validate_loose(request.loose, request.sampling)

    def validate_loose(self, loose: Loose, sampling: Sampling) -> None:
        """Loose verification: in range, greedy, and a drafter of this device's to check."""
        problem = loose.problem(sampling.greedy)
        if problem is None and self.settings().mode == "server":
            problem = "loose verification checks a drafter's tokens: this device has none (mode server)"
        if problem is not None:
            raise DeviceError("invalid", problem)

    async def run(self, request: Request, queue: asyncio.Queue) -> None:
        try:
            async with self.slots:
                self.active += 1
                self.metrics.active.inc()
                try:
                    await self.generate(request, queue)
                finally:
                    self.active -= 1
                    self.metrics.active.dec()
        except BaseException as exc:  # handed to the reader, which raises it
            queue.put_nowait(exc)
            if not isinstance(exc, Exception):
                raise
