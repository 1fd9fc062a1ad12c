"""A fleet of emulated devices replaying recorded drafts against one server, all at once.

Device j of a run replays traces[j] at the board's drafting speed over its own seeded copy of
the link (seed + j), and either drafts and verifies with sled (`mode="sled"`) or lets the server
generate every token (`mode="centralized"`). Every device's output is returned beside what the
target's own greedy output says it must be, so a caller can check the run was lossless.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from edge_client.server_side import generate_server_side
from edge_client.session import RoundSettings, SessionHooks, Target, generate
from edge_client.wire import SessionRequest
from lab.link import link_transport
from lab.profiles import Link
from lab.traces.replay import TraceDrafter

MODES = ("sled", "centralized")


@dataclass(frozen=True)
class TraceFleet:
    """`board`: anything with draft_seconds(draft_len) (lab.profiles.DeviceProfile); `link`: a
    lab.profiles.LinkProfile; `on_tokens` follows every verdict's tokens, `on_paced(late)`
    every paced draft."""
    stub: Any
    fingerprint: str
    board: Any
    link: Any
    settings: RoundSettings = field(default_factory=RoundSettings)
    on_tokens: Callable[[list[int]], None] | None = None
    on_paced: Callable[[bool], None] | None = None

    async def run(self, traces: Sequence, max_new_tokens: int, *, mode: str = "sled",
                  seed: int = 0, policies: Sequence | None = None) -> list[tuple[Any, list[int]]]:
        """(result, expected output) per device; policies[j], when given, is device j's
        DraftPolicy, kept by the caller across its sessions."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: use {' or '.join(MODES)}")
        return list(await asyncio.gather(*(
            self._device(j, trace, max_new_tokens, mode, seed, policies[j] if policies else None)
            for j, trace in enumerate(traces))))

    async def _device(self, j: int, trace, max_new_tokens: int, mode: str, seed: int, policy):
        expected = trace.target_ids[:max_new_tokens]
        wire = link_transport(Link(self.link, seed=seed + j))
        if mode == "centralized":
            result = await generate_server_side(
                self.stub, SessionRequest(trace.prompt_ids, max_new_tokens=len(expected)),
                transport=wire, hooks=SessionHooks(on_tokens=self.on_tokens))
        else:
            result = await generate(self.stub, TraceDrafter(trace, self.board, self.on_paced),
                                    SessionRequest(trace.prompt_ids, max_new_tokens=len(expected)),
                                    settings=self.settings, transport=wire,
                                    target=Target(fingerprint=self.fingerprint),
                                    hooks=SessionHooks(on_tokens=self.on_tokens), policy=policy)
        return result, expected
