"""The device round on its own: a DeviceSession against a scripted server (an injected transport),
its settings, the drafts it puts together, and the emulated link's stream."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from drafters.base import Proposal, SparseQ
from edge_client.proposer import Head, Proposer
from edge_client import session as session_module
from edge_client.session import (AUTO_FIRST_DRAFT_LEN, CONNECT_S, DeviceSession, RoundSettings,
                                  SessionHooks)
from edge_client.transport import Stream, VerifyError
from edge_client.wire import SessionRequest
from lab.link import LinkStream
from lab.profiles import Link, LinkProfile
from lab.server_process import free_port
from sled.wire.sampling import Sampling
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc

# The scripted target continues any context with its length: after [10, 11] (length 2) comes 2.
PROMPT = [10, 11]


class CountingDrafter:
    """Drafts what the scripted target would, except `wrong` at the positions in `misses`."""
    name, tokenizer_fingerprint = "counting", None

    def __init__(self, misses: frozenset[int] = frozenset(), wrong: int = 99) -> None:
        self.misses, self.wrong = misses, wrong
        self.rollbacks: list[int] = []

    def propose(self, context, k, sampling, generator=None) -> Proposal:
        start = len(context)
        return Proposal([self.wrong if p in self.misses else p for p in range(start, start + k)])

    def rollback(self, length: int) -> None:
        self.rollbacks.append(length)


class ScriptedServer:
    """Plays the server's side of every stream a session opens: greedy acceptance against the
    counting target, a suggested draft length, and (when asked) an eviction at one round."""

    def __init__(self, suggest: int = 0, evict_at: int | None = None) -> None:
        self.suggest, self.evict_at = suggest, evict_at
        self.opens: list[pb.Open] = []
        self.drafts: list[list[int]] = []

    def transport(self, stub, *, timeout=None, wait_for_ready=False) -> "ScriptedStream":
        return ScriptedStream(self)


class ScriptedStream:
    def __init__(self, server: ScriptedServer) -> None:
        self.server = server
        self.replies: asyncio.Queue = asyncio.Queue()
        self.context: list[int] = []
        self.left = 0

    async def send(self, msg: pb.DeviceMessage) -> None:
        if msg.WhichOneof("kind") == "open":
            self.server.opens.append(msg.open)
            self.context, self.left = list(msg.open.prompt_ids), msg.open.max_new_tokens
            self.replies.put_nowait(pb.ServerMessage(opened=pb.Opened()))
            return
        draft = list(msg.draft.token_ids)
        self.server.drafts.append(draft)
        if self.server.evict_at == len(self.server.drafts):
            self.server.evict_at = None
            self.replies.put_nowait(VerifyError(grpc.StatusCode.ABORTED, "idle", "REASON_EVICTED"))
            return
        self.replies.put_nowait(pb.ServerMessage(verdict=self._verdict(msg.draft.round, draft)))

    def _verdict(self, round: int, draft: list[int]) -> pb.Verdict:
        accepted = 0
        while accepted < len(draft) and draft[accepted] == len(self.context) + accepted:
            accepted += 1
        emitted = list(range(len(self.context), len(self.context) + accepted + 1))[:self.left]
        self.context += emitted
        self.left -= len(emitted)
        finish = pb.FINISH_REASON_LENGTH if self.left == 0 else pb.FINISH_REASON_UNSPECIFIED
        return pb.Verdict(round=round, accepted=min(accepted, len(emitted)), emitted_ids=emitted,
                          finish_reason=finish, verified=len(draft), suggested_draft_len=self.server.suggest)

    async def accepted(self) -> None:
        pass

    async def receive(self) -> pb.ServerMessage:
        reply = await self.replies.get()
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> None:
        pass


def session(server: ScriptedServer, drafter: CountingDrafter, max_new: int, **settings) -> DeviceSession:
    return DeviceSession(None, drafter, SessionRequest(PROMPT, max_new), RoundSettings(**settings),
                         transport=server.transport)


async def test_a_round_commits_the_verdict_and_the_context_follows():
    server = ScriptedServer()
    device = session(server, CountingDrafter(), max_new=8, draft_len=3)
    result = await device.run()
    assert result.token_ids == list(range(2, 10)) and result.finish_reason == "length"
    assert device.context == PROMPT + result.token_ids
    assert server.drafts == [[2, 3, 4], [6, 7, 8]]          # each accepted whole, then a bonus
    assert [s.accepted for s in result.round_stats] == [3, 3]
    assert result.rounds == device.round == 2 and result.draft_tokens == 6


async def test_a_rejected_draft_rolls_the_drafter_back_to_what_was_accepted():
    server, drafter = ScriptedServer(), CountingDrafter(misses=frozenset({3}))
    result = await session(server, drafter, max_new=4, draft_len=3).run()
    assert server.drafts[0] == [2, 99, 4]
    assert result.round_stats[0].accepted == 1
    assert drafter.rollbacks[0] == len(PROMPT) + 1          # the context, then the accepted 2
    assert result.token_ids == [2, 3, 4, 5]


async def test_auto_drafts_what_the_server_suggests():
    server = ScriptedServer(suggest=2)
    result = await session(server, CountingDrafter(), max_new=12, draft_len="auto").run()
    assert len(server.drafts[0]) == AUTO_FIRST_DRAFT_LEN
    assert all(len(d) == 2 for d in server.drafts[1:])
    assert result.token_ids == list(range(2, 14))


async def test_an_evicted_session_reopens_where_its_committed_tokens_end():
    server = ScriptedServer(evict_at=2)
    result = await session(server, CountingDrafter(), max_new=9, draft_len=2).run()
    assert result.token_ids == list(range(2, 11)) and result.resumes == 1
    assert len(server.opens) == 2
    assert list(server.opens[1].prompt_ids) == PROMPT + [2, 3, 4]     # round 0 committed 3
    assert server.opens[1].max_new_tokens == 9 - 3


async def test_other_errors_end_the_session():
    class Refusing(ScriptedStream):
        async def send(self, msg):
            raise VerifyError(grpc.StatusCode.INVALID_ARGUMENT, "no")

    device = DeviceSession(None, CountingDrafter(), SessionRequest(PROMPT, 4),
                           transport=lambda stub, **_: Refusing(ScriptedServer()))
    with pytest.raises(VerifyError, match="no"):
        await device.run()


class ModelInfoOnly(pb_grpc.VerifierServicer):
    """A server that answers GetModelInfo only (the scripted transport plays its streams)."""
    FINGERPRINT = "sha256:" + "3" * 64

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(model_id="counting", tokenizer_fingerprint=self.FINGERPRINT)


async def test_a_session_that_asks_the_fingerprint_waits_for_a_server_not_up_yet():
    """A drafter with no tokenizer asks the server for the target's fingerprint before opening.
    A server that is still away there is waited for like any reopening (up to reconnect_s), not
    a refusal that ends the session: the daemon's sessions open this way."""
    address = f"127.0.0.1:{free_port()}"
    channel = grpc.aio.insecure_channel(address)
    stub, scripted = pb_grpc.VerifierStub(channel), ScriptedServer()
    device = DeviceSession(stub, CountingDrafter(), SessionRequest(PROMPT, 6),
                           RoundSettings(draft_len=2, reconnect_s=60), transport=scripted.transport,
                           hooks=SessionHooks(reopen_on=lambda: stub))
    running = asyncio.create_task(device.run())
    server = grpc.aio.server()
    try:
        await asyncio.sleep(CONNECT_S * 2.5)     # past the first attempts' wait for a server
        assert not running.done(), running.result()
        pb_grpc.add_VerifierServicer_to_server(ModelInfoOnly(), server)
        server.add_insecure_port(address)
        await server.start()
        result = await asyncio.wait_for(running, 60)
    finally:
        running.cancel()
        await server.stop(0)
        await channel.close()
    assert result.token_ids == list(range(2, 8))
    assert scripted.opens[0].tokenizer_fingerprint == ModelInfoOnly.FINGERPRINT


class Deaf(pb_grpc.VerifierServicer):
    """A server whose Generate calls are never answered, as one is that a call reaches while it
    stops (grpc takes the device's Open, no handler ever answers, the call never ends)."""

    async def Generate(self, requests, context):
        await asyncio.Event().wait()
        yield pb.ServerMessage()


@pytest.fixture
async def deaf():
    server, port = grpc.aio.server(), free_port()
    pb_grpc.add_VerifierServicer_to_server(Deaf(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.VerifierStub(channel)
    await channel.close()
    await server.stop(0)


async def test_a_resume_on_a_server_that_never_takes_the_call_moves_on_to_another(deaf):
    """The written Open proves nothing (grpc takes it before any server has): a resuming open
    waits connect_s for the server to take the call, then asks for another server."""
    scripted, asked = ScriptedServer(), []
    other = object()                 # the stub the scripted server plays

    def transport(stub, **options):
        return Stream.open(stub, **options) if stub is deaf else scripted.transport(stub, **options)

    def reopen_on():
        asked.append(True)
        return other
    device = DeviceSession(deaf, CountingDrafter(), SessionRequest(PROMPT, 6, fingerprint="sha256:x"),
                           RoundSettings(draft_len=2, reconnect_s=60), transport=transport,
                           hooks=SessionHooks(reopen_on=reopen_on))
    started = time.monotonic()
    result = await asyncio.wait_for(device.run(), 30)
    assert result.token_ids == list(range(2, 8)) and asked
    assert time.monotonic() - started < CONNECT_S + 5


async def test_a_first_open_a_server_never_takes_is_a_lost_server(deaf, monkeypatch):
    monkeypatch.setattr(session_module, "ACCEPT_S", 0.5)
    device = DeviceSession(deaf, CountingDrafter(), SessionRequest(PROMPT, 6, fingerprint="sha256:x"))
    with pytest.raises(VerifyError) as error:
        await asyncio.wait_for(device.run(), 30)
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    assert "took no Generate call within 0.5 s" in error.value.message


@pytest.mark.parametrize("bad", [{"draft_len": 0}, {"draft_len": "long"}, {"draft_len": True},
                                 {"max_draft_len": 0}, {"min_confidence": 1.5}, {"lookahead": -1},
                                 {"reconnect_s": -1.0}])
def test_round_settings_refuse_bad_values(bad):
    with pytest.raises(ValueError):
        RoundSettings(**bad)


def test_the_servers_draft_limit_must_be_positive():
    with pytest.raises(ValueError, match="max_draft_tokens"):
        RoundSettings(max_draft_tokens=0)


async def test_a_draft_starts_with_its_head():
    proposer = Proposer(CountingDrafter(), Sampling())
    hinted = await proposer.draft([0, 1], 4, Head(Proposal([2, 3]), hinted=True))
    assert hinted.proposal.token_ids == [2, 3, 4, 5] and (hinted.hinted, hinted.pipelined) == (2, 0)
    ahead = await proposer.draft([0, 1], 2, Head(Proposal([2, 3, 4], confidence=[0.9, 0.9, 0.9])))
    assert ahead.proposal.token_ids == [2, 3] and (ahead.hinted, ahead.pipelined) == (0, 2)
    ended = await proposer.draft([0, 1], 4, Head(Proposal([2]), ends=True))
    assert ended.proposal.token_ids == [2]                 # an early stop ends the draft there


async def test_hints_before_sampled_tokens_are_sent_with_a_one_hot_q():
    class Sampled(CountingDrafter):
        def propose(self, context, k, sampling, generator=None):
            start = len(context)
            tokens = list(range(start, start + k))
            return Proposal(tokens, [SparseQ([t], [1.0]) for t in tokens])

    proposer = Proposer(Sampled(), Sampling(temperature=1.0))
    draft = await proposer.draft([0, 1], 3, Head(Proposal([2]), hinted=True))
    assert draft.proposal.token_ids == [2, 3, 4]
    assert draft.proposal.q[0] == SparseQ([2], [1.0]) and len(draft.proposal.q) == 3


async def test_a_link_stream_delays_both_ways_and_keeps_the_rate_of_a_stream():
    server = ScriptedServer()
    inner = server.transport(None)
    # a long rtt, so that a busy machine's scheduling (tens of ms) cannot pass for a latency
    stream = LinkStream(inner, Link(LinkProfile("far", rtt_ms=400.0, jitter_ms=0.0, bandwidth_mbps=0.0)))
    started = time.perf_counter()
    await stream.send(pb.DeviceMessage(open=pb.Open(prompt_ids=PROMPT, max_new_tokens=4)))
    assert time.perf_counter() - started >= 0.200                  # half the rtt up
    await stream.receive()
    assert time.perf_counter() - started >= 0.400                  # and half down
    for _ in range(3):                                             # three verdicts at once
        inner.replies.put_nowait(pb.ServerMessage(verdict=pb.Verdict()))
    waiting = time.perf_counter()
    for _ in range(3):
        await stream.receive()
    assert time.perf_counter() - waiting < 0.400                   # one latency (0.2 s), not three
    stream.cancel()


class ServedFromTheOpen(ScriptedServer):
    """Serves every session itself from its Opened (Opened.placement), a token a verdict; the
    first stream is evicted after two verdicts."""

    def transport(self, stub, *, timeout=None, wait_for_ready=False) -> "ScriptedStream":
        return ServingStream(self)


class ServingStream(ScriptedStream):
    async def send(self, msg: pb.DeviceMessage) -> None:
        if msg.WhichOneof("kind") != "open":
            self.server.drafts.append(list(msg.draft.token_ids))
            return
        self.server.opens.append(msg.open)
        self.context, self.left = list(msg.open.prompt_ids), msg.open.max_new_tokens
        self.replies.put_nowait(pb.ServerMessage(opened=pb.Opened(
            placement=pb.GENERATION_MODE_SERVER)))
        first = len(self.server.opens) == 1
        for step in range(2 if first else self.left):
            self.replies.put_nowait(pb.ServerMessage(verdict=self._verdict(step, [])))
        if first:
            self.replies.put_nowait(VerifyError(grpc.StatusCode.ABORTED, "idle", "REASON_EVICTED"))


async def test_a_served_session_reopened_goes_on_where_its_new_opened_places_it():
    """Evicted while the server served it, the session reopens and its new Opened places it on
    the server again: it never drafts, and its tokens are the target's."""
    server = ServedFromTheOpen()
    result = await session(server, CountingDrafter(), max_new=6, draft_len=3).run()
    assert result.token_ids == list(range(2, 8)) and result.resumes == 1
    assert server.drafts == [] and len(server.opens) == 2
    assert result.placements == {"server": 6} and result.moves == 2
