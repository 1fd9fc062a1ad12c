"""Lab emulation on the device, in user space: a board's drafting speed and the network link
under the session streams, with cuts. Neither changes a token: drafts are padded in time only,
and a cut link loses messages the way a lost connection does, which the sessions' resume
already survives without losing or repeating a committed token.

    emulation = LinkEmulation(seed=7)
    emulation.configure(settings.emulation)        # link "wifi", link_down False
    await generate(stub, PacedDrafter(drafter, board("pi5")), prompt_ids,
                   max_new_tokens=32, transport=emulation.transport())
    emulation.configure(settings.emulation)        # link_down True: every open stream fails
"""
from __future__ import annotations

import asyncio
import functools
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import grpc
import numpy as np

from drafters.base import Drafter, Proposal
from drafters.capabilities import Capabilities, capabilities_of
from drafters.wrapper import Wrapper
from edge_client.transport import Stream, Transport, VerifyError
from sled.plugins import plugin
from sled.v1 import verifier_pb2 as pb
from sled.wire.tree import depths
from sled.wire.sampling import Sampling

LINK_DOWN = "the emulated link is down"
# A paced draft is late when it returned more than this past the board's time (a share of that
# time, and at least LATE_AFTER_S): this machine could not give the emulated board its pace.
LATE_SHARE, LATE_AFTER_S = 0.10, 0.005
USER_SPACE, NONE = "user-space", "none"
# The boards and links themselves come from the lab, injected through these entry points:
# board(spec) -> Board, link_profile(spec) (checks a spec), link(spec, seed) -> Transport.
PLUGINS = "sled.emulation"


class Board(Protocol):
    """An emulated board's drafting speed (the lab's device profiles)."""
    core_speed: float

    def draft_seconds(self, draft_len: int) -> float: ...


@functools.cache
def _plugin(name: str):
    found = plugin(PLUGINS, name)
    if found is None:
        raise ValueError(f"no {name} emulation is installed: the lab provides it (an entry point "
                         f"{name!r} in the group {PLUGINS})")
    return found.load()


def board(spec: str) -> Board:
    """The emulated board SPEC names, e.g. "pi5" (ValueError naming the known ones)."""
    return _plugin("board")(spec)


def check_link(spec: str) -> None:
    """ValueError when SPEC, e.g. "wifi:rtt_ms=20", names no emulated link."""
    _plugin("link_profile")(spec)


def link_opener(spec: str, seed: int) -> Transport:
    """How a session opens its streams over the emulated link SPEC (its jitter seeded)."""
    return _plugin("link")(spec, seed)


class PacedDrafter(Wrapper):
    """A drafter slowed to a board's speed: a proposal of k tokens that took t seconds here is
    returned after max(0, profile.draft_seconds(k) - t), the board's assumed time per model
    token. measured=True scales the work this drafter really did instead: the proposal returns
    after t / profile.core_speed plus the per-round overhead, so a drafter that costs
    microseconds (n-gram, cacheback) stays cheap and a model drafter costs what it costs here,
    slowed to the board's cores. Continuing right where its last proposal ended (drafting ahead
    of a verdict, one token at a time) skips the per-round overhead, as the drafter's KV is warm
    there. The tokens are the inner drafter's own. host_s and board_s add up the time each
    proposal took here and on the board; drafted counts the tokens."""

    OWN = Capabilities(awaitable=True)      # sessions await apropose(), paced

    def __init__(self, drafter: Drafter, profile: Board, measured: bool = False,
                 on_paced: Callable[[bool], None] | None = None) -> None:
        super().__init__(drafter)
        self.profile = profile
        self.measured = measured
        self.on_paced = on_paced      # called after every proposal: late (True) or on time
        self._drafted_to: list[int] | None = None      # context + proposal of the last proposal
        self.host_s = self.board_s = 0.0
        self.drafted = 0

    def propose(self, context: Sequence[int], draft_len: int, sampling: Sampling,
                generator: np.random.Generator | None = None, **options) -> Proposal:
        """Unpaced (a caller in a thread); sessions await apropose()."""
        return super().propose(context, draft_len, sampling, generator, **options)

    async def apropose(self, context: Sequence[int], draft_len: int, sampling: Sampling,
                       generator: np.random.Generator | None = None, **options) -> Proposal:
        """The inner drafter's proposal, after the board's drafting time."""
        warm = self._drafted_to is not None and list(context) == self._drafted_to
        started = time.perf_counter()
        proposal = await self._inner_proposal(context, draft_len, sampling, generator, options)
        took = time.perf_counter() - started
        tree = proposal.parents is not None
        self._drafted_to = None if tree else list(context) + list(proposal.token_ids)
        # a tree's siblings come with the logits of its chain: the board drafts its depth
        steps = max(depths(proposal.parents)) if tree else len(proposal.token_ids)
        board = self.board_seconds(steps, took, warm)
        self.host_s, self.board_s = self.host_s + took, self.board_s + max(board, took)
        self.drafted += len(proposal.token_ids)
        await asyncio.sleep(max(0.0, board - took))
        if self.on_paced is not None:
            self.on_paced(late(time.perf_counter() - started, board))
        return proposal

    def _inner_proposal(self, context, draft_len, sampling, generator, options) -> Awaitable[Proposal]:
        if capabilities_of(self.inner).awaitable:
            return self.inner.apropose(context, draft_len, sampling, generator, **options)
        return asyncio.to_thread(self.inner.propose, context, draft_len, sampling, generator, **options)

    def board_seconds(self, draft_len: int, took: float, warm: bool = False) -> float:
        """The board's time for a proposal of draft_len tokens that took `took` seconds here."""
        if self.measured:
            return took / self.profile.core_speed + (0.0 if warm else self.profile.draft_seconds(0))
        return self.draft_seconds(draft_len, warm)

    def draft_seconds(self, draft_len: int, warm: bool = False) -> float:
        """The board's time for draft_len tokens; warm: without the per-round overhead."""
        overhead = self.profile.draft_seconds(0) if warm else 0.0
        return self.profile.draft_seconds(draft_len) - overhead


def late(elapsed_s: float, board_s: float) -> bool:
    """Whether a draft that took elapsed_s came later than the board's board_s allows."""
    return elapsed_s > board_s + max(LATE_AFTER_S, LATE_SHARE * board_s)


class LinkEmulation:
    """One device's emulated network: its link (profile and seeded jitter; a zero-delay loopback
    when only a cut is asked for) and whether it is cut. It owns the open streams so a cut can
    fail them all; new streams wait until the link is back (as gRPC's wait_for_ready does) or,
    when they do not wait, fail as a lost connection at once."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.spec = ""
        self.down = False
        self.opener: Transport | None = None       # streams over the link; None: no link
        self._up = asyncio.Event()
        self._up.set()
        self._streams: weakref.WeakSet[CutStream] = weakref.WeakSet()

    @property
    def kind(self) -> str:
        """How the link is emulated here: "user-space", or "none" (no link profile, no cut)."""
        return USER_SPACE if self.opener is not None else NONE

    def configure(self, emulation) -> None:
        """Take emulation.link and emulation.link_down (the device's EmulationSettings): a new
        link profile applies to streams opened from now on; a cut fails every open stream."""
        wanted = emulation.link or ("loopback" if emulation.link_down else "")
        if wanted != self.spec:
            self.spec = wanted
            self.opener = link_opener(wanted, self.seed) if wanted else None
        self.set_down(emulation.link_down)

    def set_down(self, down: bool) -> None:
        if down and not self.down:
            self._up.clear()
            for stream in list(self._streams):
                stream.cut()
        elif not down:
            self._up.set()
        self.down = down

    async def wait_up(self, timeout: float | None = None) -> bool:
        """Wait until the link is up, at most timeout seconds; whether it is."""
        try:
            await asyncio.wait_for(self._up.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return not self.down

    def forget(self, stream: CutStream) -> None:
        """A stream that ended: a cut no longer concerns it."""
        self._streams.discard(stream)

    def transport(self) -> Transport:
        """The Transport a session opens its streams with: over the link when one is emulated,
        and always cuttable, so a cut also fails the streams opened before it."""
        opener = self.opener or Stream.open

        def open_stream(stub, *, timeout: float | None = None, wait_for_ready: bool = False):
            stream = CutStream(self, opener, stub, timeout, wait_for_ready)
            self._streams.add(stream)
            return stream
        return open_stream


def link_lost() -> VerifyError:
    """What a cut link looks like to a session: a lost server (UNAVAILABLE)."""
    return VerifyError(grpc.StatusCode.UNAVAILABLE, LINK_DOWN)


class CutStream:
    """A session stream (edge_client.transport.Stream) over an emulated link that can be cut.
    The gRPC call opens with the first message, once the link is up; after a cut every step
    fails as a lost connection and the call is dropped (the server frees the session)."""

    def __init__(self, emulation: LinkEmulation, opener: Transport, stub,
                 timeout: float | None, wait_for_ready: bool) -> None:
        self.emulation, self.opener, self.stub = emulation, opener, stub
        self.timeout, self.wait_for_ready = timeout, wait_for_ready
        self.inner = None
        self._cut = asyncio.get_running_loop().create_future()

    def cut(self) -> None:
        if not self._cut.done():
            self._cut.set_result(None)
        if self.inner is not None:
            self.inner.cancel()

    async def send(self, msg) -> None:
        if self.inner is None:
            await self._connect()
        await self._unless_cut(self.inner.send(msg))

    async def accepted(self) -> None:
        if self.inner is None:
            raise link_lost()
        await self._unless_cut(self.inner.accepted())

    async def receive(self):
        if self.inner is None:
            raise link_lost()
        msg = await self._unless_cut(self.inner.receive())
        if msg.verdict.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.emulation.forget(self)     # the last verdict: a cut now loses nothing
        return msg

    async def done_writing(self) -> None:
        """The device sends nothing more: after its last verdict, or at once after the Open
        in a server mode (whose stream stays cuttable until its last verdict)."""
        if self.inner is not None and not self._cut.done():
            await self.inner.done_writing()

    def cancel(self) -> None:
        self.emulation.forget(self)
        if self.inner is not None:
            self.inner.cancel()

    async def _connect(self) -> None:
        """Open the call once the link is up (a stream that does not wait fails at once)."""
        if self.emulation.down:
            if not self.wait_for_ready:
                raise link_lost()
            await self.emulation.wait_up()
        if self._cut.done():
            raise link_lost()
        self.inner = self.opener(self.stub, timeout=self.timeout, wait_for_ready=self.wait_for_ready)

    async def _unless_cut(self, step: Awaitable):
        """step's result, unless the link is cut first: then what a lost connection raises."""
        if self._cut.done():
            if asyncio.iscoroutine(step):
                step.close()
            raise link_lost()
        task = asyncio.ensure_future(step)
        try:
            await asyncio.wait({task, self._cut}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        if self._cut.done():
            task.cancel()
            task.add_done_callback(_consume)
            raise link_lost()
        return task.result()


def _consume(task: asyncio.Future) -> None:
    """A step dropped by a cut: its outcome is the lost connection's, never logged as unread."""
    if not task.cancelled():
        task.exception()
