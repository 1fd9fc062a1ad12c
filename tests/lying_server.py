"""A verify server that lies, for the device's checks of what a server tells it.

LyingVerifier is a real gRPC Verifier. Its target is a counting one (any context continues with
its own length: after [10, 11] comes 2), verified greedily as sled's server would, until the
round `lie_at`, whose verdict it replaces with one lie:

    undrafted    accepts tokens the device never drafted
    too_many     emits 15,000 tokens (whatever max_new_tokens was)
    huge         emits 500,000 tokens in one verdict
    silent       answers nothing from that round (a server mode: that step) on, the stream
                 open; every open is answered with Opened (set `lie` to "" to have it answer again)
    silent_open  never sends Opened
    unavailable  ends the stream with UNAVAILABLE at that round (a server mode: that step) and
                 at every one after, each open answered with Opened
    evicted      refuses that round's draft and every one after with REASON_EVICTED
    wrong_round  answers another round
    out_of_vocab emits a token past ModelInfo.vocab_size
    loose        claims loose acceptance in a session opened exact
    unfinished   reaches max_new_tokens without finishing the session
    silent_tokenizer  takes GetTokenizer and sends nothing

`serve(verifier)` starts it on a free loopback port (with the tiny target's tokenizer when given,
for `sled generate`).
"""
from __future__ import annotations

import asyncio

import grpc

from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc

VOCAB = 320
DROPPED = "the liar drops the stream"       # what `unavailable` ends each stream with
LIES = ("undrafted", "too_many", "huge", "silent", "silent_open", "unavailable", "evicted",
        "wrong_round", "out_of_vocab", "loose", "unfinished", "silent_tokenizer")


class LyingVerifier(pb_grpc.VerifierServicer):
    def __init__(self, lie: str = "", lie_at: int = 1, fingerprint: str = "",
                 chunks: list[pb.TokenizerChunk] = ()) -> None:
        assert lie in LIES or not lie, lie
        self.lie, self.lie_at, self.chunks = lie, lie_at, list(chunks)
        self.info = pb.ModelInfo(model_id="liar", vocab_size=VOCAB, tokenizer_fingerprint=fingerprint,
                                 eos_token_ids=[VOCAB - 1], context_length=4096,
                                 limits=pb.ServerLimits(max_draft_tokens=32))
        self.opens = 0

    async def GetModelInfo(self, request, context):
        return self.info

    async def GetTokenizer(self, request, context):
        if self.lie == "silent_tokenizer":
            await asyncio.Event().wait()
        for chunk in self.chunks:
            yield chunk

    async def Generate(self, request_iterator, context):
        await context.send_initial_metadata(())       # the call is taken at once, as sled's is
        context_ids: list[int] = []
        left = 0
        async for message in request_iterator:
            if message.WhichOneof("kind") == "open":
                self.opens += 1
                context_ids, left = list(message.open.prompt_ids), message.open.max_new_tokens
                if self.lie == "silent_open":
                    await asyncio.Event().wait()
                yield pb.ServerMessage(opened=pb.Opened(session_id="s", max_new_tokens=left))
                if message.open.mode != pb.GENERATION_MODE_DEVICE_DRAFTS:
                    for verdict in self.server_steps(context_ids, left):
                        if self.lie == "silent" and verdict.round >= self.lie_at:
                            await asyncio.Event().wait()
                        if self.lie == "unavailable" and verdict.round >= self.lie_at:
                            await context.abort(grpc.StatusCode.UNAVAILABLE, DROPPED)
                        yield pb.ServerMessage(verdict=verdict)
                    return
                continue
            draft = message.draft
            if self.lie == "silent" and draft.round >= self.lie_at:
                await asyncio.Event().wait()
            if self.lie == "unavailable" and draft.round >= self.lie_at:
                await context.abort(grpc.StatusCode.UNAVAILABLE, DROPPED)
            if self.lie == "evicted" and draft.round >= self.lie_at:
                yield pb.ServerMessage(error=pb.ErrorDetail(
                    reason=pb.ErrorDetail.REASON_EVICTED, message="the liar evicts every draft"))
                await refused(request_iterator, context, grpc.StatusCode.ABORTED)
                return
            verdict = honest(draft, context_ids, left)
            if draft.round == self.lie_at and self.lie:
                verdict = lied(self.lie, verdict, draft, left)
            context_ids += verdict.emitted_ids
            left -= len(verdict.emitted_ids)
            yield pb.ServerMessage(verdict=verdict)

    def server_steps(self, context_ids: list[int], left: int):
        """A server mode's verdicts: one target token a step (the lie at step lie_at)."""
        for step in range(left):
            verdict = pb.Verdict(round=step, emitted_ids=[len(context_ids) + step], finish_reason=(
                pb.FINISH_REASON_LENGTH if step == left - 1 else pb.FINISH_REASON_UNSPECIFIED))
            if step == self.lie_at and self.lie:
                verdict = lied(self.lie, verdict, pb.Draft(round=step), left - step)
            yield verdict
            if verdict.finish_reason:
                return


async def refused(request_iterator, context, code: grpc.StatusCode) -> None:
    """End a call whose refusal was sent, as sled's server does: once the device half-closed."""
    async for _ in request_iterator:
        pass
    context.set_code(code)
    context.set_details("refused")


def honest(draft: pb.Draft, context_ids: list[int], left: int) -> pb.Verdict:
    """The counting target's greedy verdict on a chain draft."""
    start = len(context_ids)
    accepted = 0
    while accepted < len(draft.token_ids) and draft.token_ids[accepted] == start + accepted:
        accepted += 1
    emitted = list(range(start, start + accepted + 1))[:left]
    finish = pb.FINISH_REASON_LENGTH if len(emitted) == left else pb.FINISH_REASON_UNSPECIFIED
    return pb.Verdict(round=draft.round, accepted=min(accepted, len(emitted)), emitted_ids=emitted,
                      finish_reason=finish, verified=len(draft.token_ids))


def lied(lie: str, verdict: pb.Verdict, draft: pb.Draft, left: int) -> pb.Verdict:
    n = len(draft.token_ids)
    if lie == "undrafted":
        return pb.Verdict(round=draft.round, accepted=n, emitted_ids=[7] * (n + 1), verified=n)
    if lie in ("too_many", "huge"):
        count = 15_000 if lie == "too_many" else 500_000
        return pb.Verdict(round=draft.round, accepted=n, emitted_ids=[5] * count, verified=n)
    if lie == "wrong_round":
        verdict.round += 5
    elif lie == "out_of_vocab":
        verdict.emitted_ids[-1] = VOCAB + 5
    elif lie == "loose":
        verdict.loose_accepted = 1
    elif lie == "unfinished":
        return pb.Verdict(round=draft.round, accepted=0, emitted_ids=[5] * left, verified=n)
    return verdict


async def serve(verifier: LyingVerifier) -> tuple[grpc.aio.Server, str]:
    """The verifier on a free loopback port: (the server, its address)."""
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    pb_grpc.add_VerifierServicer_to_server(verifier, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"
