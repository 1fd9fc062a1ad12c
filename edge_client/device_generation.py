"""How a device generates one request: on the server it chooses, the device drafting and the
server verifying (mode "draft"), or the server generating alone (mode "server": the centralized
baseline); with no server and unverified_fallback, the drafter alone (lossy, opt-in)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc

from edge_client.bootstrap import Bootstrap
from edge_client.device_requests import Chunk, DeviceError, Request
from edge_client.device_status import DeviceMetrics, Window
from edge_client.emulation import LinkEmulation, PacedDrafter, board
from edge_client.proposer import Proposer
from edge_client.result import LOST, RoundStat, ServerEvent
from edge_client.server_choice import ServerChoice, log_server_event
from edge_client.server_side import generate_server_side
from edge_client.servers import Server
from edge_client.session import RoundSettings, SessionHooks, Target, generate
from edge_client.settings import DeviceSettings
from edge_client.transport import ServerGivenUp, ServerLost, ServerSilent, VerifyError
from edge_client.verdict_check import BrokenVerdict
from edge_client.wire import SessionRequest


@dataclass(frozen=True, slots=True)
class Generation:
    """What one request's generation runs with: its settings as they were when it started,
    and where its tokens and server events go."""
    request: Request
    max_tokens: int
    settings: DeviceSettings
    on_tokens: Callable[[list[int]], None]
    on_server: Callable[[ServerEvent], None]

    def session_request(self, cache_salt: str) -> SessionRequest:
        """What its session asks the server for; cache_salt: the device's own (its sessions
        share a system prompt's cached blocks)."""
        request = self.request
        return SessionRequest(request.prompt_ids, self.max_tokens, request.sampling,
                              request.stop_ids, request.ignore_eos, cache_salt=cache_salt,
                              loose=request.loose)


@dataclass(frozen=True, slots=True)
class Telemetry:
    """Where a device counts what its sessions do: the metrics, and the recent window."""
    metrics: DeviceMetrics
    window: Window

    def round(self, stat: RoundStat) -> None:
        """One round of any session."""
        self.metrics.count_round(stat)
        self.window.round(stat)

    def emitted(self, tokens: int, lossless: bool) -> None:
        self.metrics.tokens.labels(lossless=str(lossless).lower()).inc(tokens)
        self.window.emitted(tokens)


class RequestRunner:
    """generate(request, queue) puts one request's chunks on the queue. It reads the drafter,
    the EOS ids and the cache salt from `bootstrap`, the servers from `choice`, the settings as
    they are now from `settings()`, and streams through the emulated `link`."""

    def __init__(self, bootstrap: Bootstrap, choice: ServerChoice, telemetry: Telemetry,
                 link: LinkEmulation, settings: Callable[[], DeviceSettings]) -> None:
        self.bootstrap, self.choice, self.telemetry = bootstrap, choice, telemetry
        self.link, self.settings = link, settings

    async def generate(self, request: Request, queue: asyncio.Queue) -> None:
        settings = self.settings()        # this request keeps the settings it started with
        max_tokens = request.max_tokens or settings.max_new_tokens
        metrics = self.telemetry.metrics
        metrics.prompt_tokens.inc(len(request.prompt_ids))
        committed: list[int] = []
        server = await self.choice.for_request()
        if server is None:   # no server, and drafting alone (lossy) was asked for
            await self.draft_alone(request, request.prompt_ids, max_tokens, queue)
            return
        current = {"server": server}

        def reopen():
            # The last attempt lost its server: prefer another compatible one (the directory
            # moves on failover).
            current["server"] = self.choice.failover(current["server"])
            return current["server"].stub

        def on_tokens(tokens: list[int]) -> None:
            committed.extend(tokens)
            lossless = request.loose is None
            self.telemetry.emitted(len(tokens), lossless)
            self.choice.answered(current["server"])       # a verdict came: it is not silent
            queue.put_nowait(Chunk(list(tokens), lossless=lossless))

        def on_server(event: ServerEvent) -> None:
            log_server_event(request.request_id, current["server"], event)
            if event.kind == LOST and event.silent:
                self.choice.went_silent(current["server"], event.detail)

        generation = Generation(request, max_tokens, settings, on_tokens, on_server)
        try:
            if settings.mode == "server":
                result = await self.centralized(server, generation)
            else:
                result = await self.drafted(server, generation, reopen)
        except VerifyError as exc:
            if isinstance(exc, ServerSilent):
                self.choice.went_silent(current["server"], exc.last.message)
            lost = exc.code == grpc.StatusCode.UNAVAILABLE or isinstance(exc, ServerGivenUp)
            if lost and settings.unverified_fallback:
                await self.draft_alone(request, request.prompt_ids + committed,
                                       max_tokens - len(committed), queue)
                return
            raise _failure(exc, current["server"]) from None
        metrics.resumes.inc(result.resumes)
        metrics.count_placements(result.placements, result.moves)
        queue.put_nowait(Chunk([], result.finish_reason))

    async def drafted(self, server: Server, generation: Generation, reopen: Callable[[], object]):
        """The device drafts, the server verifies (mode "draft")."""
        settings = generation.settings
        policy = settings.policy
        return await generate(
            server.stub, self.session_drafter(settings),
            generation.session_request(self.bootstrap.cache_salt),
            RoundSettings(
                draft_len=policy.draft_len, max_draft_len=policy.max_draft_len,
                min_confidence=policy.min_confidence, pipeline=policy.pipeline,
                lookahead=policy.lookahead, hints=policy.hints, tree=policy.tree,
                max_draft_tokens=server.max_draft_tokens or 32, reconnect_s=settings.reconnect_s,
                open_timeout_s=settings.open_timeout_s, verdict_timeout_s=settings.verdict_timeout_s,
                silent_retries=settings.silent_retries),
            target=Target(server.fingerprint or None, server.model, server.vocab_size),
            transport=self.link.transport(),
            hooks=SessionHooks(reopen_on=reopen, on_tokens=generation.on_tokens,
                               on_round=self.telemetry.round, on_server=generation.on_server))

    async def centralized(self, server: Server, generation: Generation):
        """The server generates every token, the device only streams them (mode "server": the
        centralized baseline). The first open waits for a server (or a cut link) up to
        reconnect_s, as a drafting session's does."""
        request = replace(generation.session_request(self.bootstrap.cache_salt), loose=None)
        settings = generation.settings
        return await generate_server_side(
            server.stub, request,
            hooks=SessionHooks(on_tokens=generation.on_tokens, on_server=generation.on_server),
            transport=self.link.transport(), reconnect_s=settings.reconnect_s,
            wait_first=True, vocab_size=server.vocab_size, open_timeout_s=settings.open_timeout_s,
            verdict_timeout_s=settings.verdict_timeout_s, silent_retries=settings.silent_retries)

    def session_drafter(self, settings: DeviceSettings):
        """The shared drafter, paced to the emulated board's speed when there is one."""
        if not settings.emulation.device:
            return self.bootstrap.drafter
        return PacedDrafter(self.bootstrap.drafter, board(settings.emulation.device),
                            on_paced=self.telemetry.metrics.count_paced)

    async def draft_alone(self, request: Request, context: list[int], budget: int,
                          queue: asyncio.Queue) -> None:
        """No server: the drafter's own tokens (at the emulated board's pace, when there is
        one), marked lossless=False (opt-in only)."""
        proposer = Proposer(self.session_drafter(self.settings()), request.sampling)
        context = list(context)
        ends = set(request.stop_ids) | (set() if request.ignore_eos else set(self.bootstrap.eos_ids))
        for produced in range(1, budget + 1):
            proposal = await proposer.propose(context, 1)
            token = proposal.token_ids[0]
            context.append(token)
            self.telemetry.emitted(1, lossless=False)
            finish = "eos" if token in self.bootstrap.eos_ids and not request.ignore_eos else \
                "stop" if token in ends else "length" if produced == budget else None
            queue.put_nowait(Chunk([token], finish, lossless=False))
            if finish:
                return
        queue.put_nowait(Chunk([], "length", lossless=False))


def _failure(error: VerifyError, server: Server) -> DeviceError:
    """What a request answers when its session on `server` ended with `error`: one line."""
    if isinstance(error, ServerGivenUp):
        return DeviceError("unavailable", error.naming(server.endpoint))
    if isinstance(error, ServerLost):
        return DeviceError("unavailable", f"lost the verify server: {error.message}")
    if isinstance(error, BrokenVerdict):
        return DeviceError("unavailable", f"the verify server {server.endpoint} sent a verdict "
                           f"that breaks the protocol, so nothing of it was kept: {error.problem}")
    return DeviceError(_kind(error), f"the verify server refused: {error}")


def _kind(error: VerifyError) -> str:
    if error.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return "invalid"
    if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "busy"
    return "unavailable"
