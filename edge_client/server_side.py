"""Generation the server does alone, for devices without a drafter: centralized serving
(GENERATION_MODE_SERVER) or the target drafting for itself with SATs (GENERATION_MODE_SERVER_SAT).
The device opens a session, half-closes its side at once (the Open is all it sends) and reads
one verdict per server step until one carries a finish reason. A server lost mid-session is
waited for as a drafting session waits (edge_client.session.Reconnect), and the session
reopened where its committed tokens end.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import grpc

from edge_client.result import GenerationResult
from edge_client.session import OPEN_TIMEOUT_S, VERDICT_TIMEOUT_S, Reconnect, SessionHooks, open_stream
from edge_client.strikes import SILENT_RETRIES
from edge_client.transport import Stream, Transport, VerifyError, lost_server, receive_within
from edge_client.verdict_check import Asked, check_verdict
from edge_client.wire import SessionRequest
from sled import clock
from sled.v1 import verifier_pb2 as pb


class ServerSideSession:
    """One session in a server mode. It owns the stream and the result (the committed tokens);
    a lost server is waited for up to reconnect_s (ServerLost when none came back in time, and
    `result` keeps the committed tokens). wait_first: the first open waits and retries the same
    way (a daemon's request that may find its server restarting), as a drafting session does.
    Each verdict must come within verdict_timeout_s (else the server is lost, with a strike
    against it, as is a loss with no verdict since the open: Reconnect) and keep the rules a
    device can check (edge_client.verdict_check; ids against `vocab_size` when known)."""

    def __init__(self, stub, request: SessionRequest, *, timeout: float | None = None,
                 transport: Transport = Stream.open, reconnect: Reconnect | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None,
                 wait_first: bool = False, vocab_size: int = 0,
                 open_timeout_s: float = OPEN_TIMEOUT_S,
                 verdict_timeout_s: float = VERDICT_TIMEOUT_S) -> None:
        self.stub, self.request, self.timeout, self.transport = stub, request, timeout, transport
        self.wait_first, self.vocab_size = wait_first, vocab_size
        self.open_timeout_s, self.verdict_timeout_s = open_timeout_s, verdict_timeout_s
        self.step = 0          # the verdict the open stream owes next (the server's step)
        self.reconnect, self.on_tokens = reconnect or Reconnect(0.0), on_tokens
        self.result = GenerationResult()
        self.stream: Stream | None = None

    async def run(self) -> GenerationResult:
        """Open, then take each verdict the server streams until one ends the session."""
        started = clock.now()
        try:
            self.stream = await (self.reconnect.reopen(self.open_once, 0, lost=False)
                                 if self.wait_first else self.open_once())
            while not await self.next_verdict(started):
                pass
        except BaseException:
            if self.stream is not None:
                self.stream.cancel()
            raise
        finally:
            self.result.elapsed_s = clock.now() - started
        return self.result

    async def open_once(self, connect_s: float | None = None, switch: bool = False) -> Stream:
        """One attempt at opening for what is left: the prompt plus the committed tokens, and
        max_new_tokens less them (switch: no server chooser here, the same stub is asked)."""
        opening = self.request.open_message(self.result.token_ids)
        stream = await open_stream(self.transport, self.stub, opening, self.timeout, connect_s,
                                   self.open_timeout_s)
        self.step = 0
        return stream

    async def next_verdict(self, started: float) -> bool:
        """Commit the next verdict; True when it ends the session. A lost server: wait for it
        (or another on the same address) and reopen, committing nothing this time."""
        try:
            verdict = (await receive_within(self.stream, self.verdict_timeout_s,
                                            f"verdict for step {self.step}")).verdict
        except (VerifyError, grpc.aio.AioRpcError) as error:
            if not lost_server(error):
                raise
            self.stream.cancel()
            self.result.resumes += 1
            self.stream = await self.reconnect.recover(error, len(self.result.token_ids), self.open_once)
            return False
        check_verdict(verdict, Asked(self.step, self.request.left(self.result.token_ids),
                                     self.vocab_size))
        self.step += 1
        finished = self.result.add(verdict, started, self.request.mode)
        if self.on_tokens is not None:
            self.on_tokens(list(verdict.emitted_ids))
        return finished


async def generate_server_side(stub, request: SessionRequest, *, hooks: SessionHooks = SessionHooks(),
                               timeout: float | None = None, transport: Transport = Stream.open,
                               reconnect_s: float = 0.0, wait_first: bool = False,
                               vocab_size: int = 0, open_timeout_s: float = OPEN_TIMEOUT_S,
                               verdict_timeout_s: float = VERDICT_TIMEOUT_S,
                               silent_retries: int = SILENT_RETRIES) -> GenerationResult:
    """Open a session for `request` in its server mode (request.mode; one left at the device
    drafting is GENERATION_MODE_SERVER: the server generates alone) and collect the verdicts the
    server streams to its end; hooks.on_tokens sees each verdict's tokens; request.cache_salt
    scopes the server's prefix cache. reconnect_s: how long a lost server is waited for to
    resume the session (0: ServerLost at once); hooks.on_server is told the loss and the resume
    (ServerEvent); wait_first: the first open waits for the server up to reconnect_s too;
    vocab_size: the target's, which every emitted id is checked against (0: unknown);
    open_timeout_s, verdict_timeout_s and silent_retries as a drafting session's (RoundSettings)."""
    mode = pb.GENERATION_MODE_SERVER if request.mode == pb.GENERATION_MODE_DEVICE_DRAFTS else request.mode
    session = ServerSideSession(stub, replace(request, drafter="server", mode=mode), timeout=timeout,
                                transport=transport,
                                reconnect=Reconnect(reconnect_s, hooks.on_server, silent_retries),
                                on_tokens=hooks.on_tokens, wait_first=wait_first,
                                vocab_size=vocab_size, open_timeout_s=open_timeout_s,
                                verdict_timeout_s=verdict_timeout_s)
    return await session.run()
