"""`sled bench reliability`: what careless or hostile clients cost a `sled serve` child.

Three measurements side by side, one server:
  refusals   the server's RSS before and after many refused Opens of a multi-million-id prompt
             (refused for context overflow): MiB kept per refusal;
  tokenizer  a normal session's round time alone and while a burst of GetTokenizer calls is
             answered (the server answers --burst at once): the ratio of the medians, and the
             slowest round;
  idle slots every slot taken by a finished session whose stream stays open: seconds until a
             new client gets in (the idle timeout frees them).
"""
from __future__ import annotations

import asyncio
import statistics
import time

import grpc
import psutil
from rich.progress import Progress
from rich.table import Table

from edge_client.transport import half_close
from lab.bench import harness
from lab.tiny import cached_pair
from sled.flags import positive_float, positive_int
from sled.models import resolve_model
from sled.v1 import verifier_pb2 as pb
from sled.v1.verifier_pb2_grpc import VerifierStub

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]      # ids every served vocabulary has
CONTEXT_LENGTH = 256                       # the server's: a refused prompt is longer


def add_arguments(parser) -> None:
    harness.add_target_flags(parser, model_help="target path or alias (default: a tiny random "
                             "model)")
    parser.add_argument("--refusals", type=positive_int, default=40, help="refused Opens measured")
    parser.add_argument("--prompt-len", type=positive_int, default=2_000_000,
                        help="ids in each refused prompt")
    parser.add_argument("--rounds", type=positive_int, default=40,
                        help="rounds timed alone, and at least as many during the burst")
    parser.add_argument("--burst", type=positive_int, default=12,
                        help="GetTokenizer calls sent at once")
    parser.add_argument("--slots", type=positive_int, default=8, help="the server's max_sessions")
    parser.add_argument("--idle-timeout", type=positive_float, default=5.0,
                        help="the server's idle timeout (s); longer than filling the slots takes")
    harness.add_out_flag(parser, "reliability")


def run(args) -> int:
    return harness.run_bench("reliability", bench, args)


def server_args(args) -> list[str]:
    # The refused prompts must reach the service, so the receive limit is raised for them; the
    # whole burst is answered at once, so the server's limit on GetTokenizer calls is the burst.
    return ["--dtype", args.dtype, "--context-length", str(CONTEXT_LENGTH),
            "--max-sessions", str(args.slots), "--idle-timeout", str(args.idle_timeout),
            "--max-message-bytes", str(args.prompt_len * 6 + (1 << 20)),
            "--max-tokenizer-calls", str(args.burst)]


async def bench(args) -> int:
    if args.prompt_len < CONTEXT_LENGTH:
        raise harness.Stop(f"--prompt-len {args.prompt_len} fits the server's context length "
                           f"{CONTEXT_LENGTH}, so it would not be refused: use {CONTEXT_LENGTH} "
                           "or more")
    console = harness.bench_console()
    model = resolve_model(args.model) if args.model else cached_pair()[0]
    async with harness.serving(model, server_args(args), console) as served:
        with Progress(console=console, transient=True) as progress:
            refusals = await _refusals(served, args, progress)
            tokenizer = await _tokenizer_burst(served, args, progress)
            slots = await _idle_slots(served, args, progress)
    results = {"model": args.model or "tiny random llama", "refusals": refusals,
               "tokenizer": tokenizer, "idle_slots": slots}
    _table(console, results, args)
    harness.write_results(console, args.out, results)
    return harness.DONE


# --- refusals -------------------------------------------------------------------------------------

async def _refusals(served, args, progress) -> dict:
    """The server's RSS before and after --refusals refused Opens (after a few to warm up)."""
    server = psutil.Process(served.server.proc.pid)
    big = pb.DeviceMessage(open=pb.Open(prompt_ids=[5] * args.prompt_len, max_new_tokens=1,
                                        tokenizer_fingerprint=served.fingerprint))
    wire = big.SerializeToString()
    async with grpc.aio.insecure_channel(served.server.address, options=[
            ("grpc.max_send_message_length", len(wire) + 1024)]) as channel:
        generate = channel.stream_stream("/sled.v1.Verifier/Generate",
                                         request_serializer=lambda b: b,
                                         response_deserializer=pb.ServerMessage.FromString)
        task = progress.add_task("refused prompts", total=args.refusals + 5)
        for i in range(args.refusals + 5):
            if i == 5:
                before = server.memory_info().rss
            call = generate()
            await call.write(wire)
            await _refused_for_size(call)
            progress.update(task, advance=1)
        await asyncio.sleep(0.5)
        after = server.memory_info().rss
    mib = (after - before) / (1 << 20)
    return {"refusals": args.refusals, "prompt_ids": args.prompt_len, "wire_bytes": len(wire),
            "rss_before_mib": before / (1 << 20), "rss_after_mib": after / (1 << 20),
            "mib_per_refusal": mib / args.refusals}


async def _refused_for_size(call) -> None:
    """The Open on CALL was refused for its length (context overflow, INVALID_ARGUMENT), not for
    anything else; otherwise the benchmark stops (exit 3)."""
    reply = await call.read()
    if reply is grpc.aio.EOF or reply.WhichOneof("kind") != "error":
        call.cancel()
        raise harness.Stop(f"an over-long prompt was not refused: {reply}", harness.SERVER_FAILED)
    await half_close(call)          # as a device does: the status follows at once
    code, error = await call.code(), reply.error
    if (error.reason != pb.ErrorDetail.REASON_CONTEXT_OVERFLOW
            or code != grpc.StatusCode.INVALID_ARGUMENT):
        raise harness.Stop(f"an over-long prompt was refused, but not for its length: {code.name}, "
                           f"{pb.ErrorDetail.Reason.Name(error.reason)}: {error.message}",
                           harness.SERVER_FAILED)


# --- a normal session under a GetTokenizer burst ------------------------------------------------

async def _tokenizer_burst(served, args, progress) -> dict:
    """Round times of one session alone (--rounds), then of every round it gets done while
    --burst GetTokenizer calls, sent at once, are answered."""
    session = await _Session.open(served, args.rounds * 4 + 64)
    alone = await session.rounds(args.rounds, progress, "rounds alone")
    started = time.perf_counter()
    burst = asyncio.gather(*(_tokenizer_bytes(served.stub) for _ in range(args.burst)))
    during = await session.rounds_until(burst, progress)
    replies = await burst
    burst_s = time.perf_counter() - started
    session.close()
    alone_ms, during_ms = statistics.median(alone), statistics.median(during)
    return {"calls": args.burst, "reply_mib": replies[0] / (1 << 20),
            "burst_s": burst_s, "alone_p50_ms": alone_ms, "alone_max_ms": max(alone),
            "during_rounds": len(during), "during_p50_ms": during_ms,
            "during_max_ms": max(during), "ratio_p50": during_ms / alone_ms,
            "ratio_max": max(during) / max(alone)}


async def _tokenizer_bytes(stub) -> int:
    """Bytes of the tokenizer files in one whole GetTokenizer stream."""
    return sum([len(chunk.data) async for chunk in stub.GetTokenizer(pb.GetTokenizerRequest())])


class _Session:
    """One greedy session drafting one token a round, timed per round."""

    def __init__(self, call, max_new_tokens: int) -> None:
        self.call, self.round, self.max_new_tokens = call, 0, max_new_tokens

    @classmethod
    async def open(cls, served, max_new_tokens: int) -> "_Session":
        call = served.stub.Generate()
        await call.write(pb.DeviceMessage(open=pb.Open(
            prompt_ids=PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True,
            tokenizer_fingerprint=served.fingerprint)))
        await call.read()
        return cls(call, max_new_tokens)

    async def one_round(self) -> float:
        """ms for one round."""
        started = time.perf_counter()
        await self.call.write(pb.DeviceMessage(draft=pb.Draft(round=self.round, token_ids=[5])))
        verdict = (await self.call.read()).verdict
        if verdict.finish_reason:
            raise harness.Stop("the timed session ran out of tokens: use fewer --rounds")
        self.round += 1
        return (time.perf_counter() - started) * 1e3

    async def rounds(self, n: int, progress, what: str) -> list[float]:
        task = progress.add_task(what, total=n)
        times = []
        for _ in range(n):
            times.append(await self.one_round())
            progress.update(task, advance=1)
        return times

    async def rounds_until(self, burst: asyncio.Future, progress) -> list[float]:
        task = progress.add_task("rounds during the burst", total=None)
        times = []
        while not burst.done() or not times:
            times.append(await self.one_round())
            progress.update(task, advance=1)
        return times

    def close(self) -> None:
        self.call.cancel()


# --- slots held by finished sessions -------------------------------------------------------------

async def _idle_slots(served, args, progress) -> dict:
    """Fill every slot with a finished session whose stream stays open; then seconds until a
    new client's Open is accepted (retried every 50 ms, for at most 5 idle timeouts + 5 s),
    counted from the first session's last verdict: the idle timeout runs from there."""
    task = progress.add_task("finished sessions left open", total=args.slots)
    held, first_idle = [], None
    for _ in range(args.slots):
        call = served.stub.Generate()
        await call.write(pb.DeviceMessage(open=pb.Open(prompt_ids=PROMPT, max_new_tokens=1,
                                                       tokenizer_fingerprint=served.fingerprint)))
        await call.read()
        await call.write(pb.DeviceMessage(draft=pb.Draft(round=0, token_ids=[5])))
        await call.read()
        first_idle = first_idle or time.perf_counter()
        held.append(call)
        progress.update(task, advance=1)
    fill_s = time.perf_counter() - first_idle
    admitted_at, tries = await _until_admitted(served, 5 * args.idle_timeout + 5)
    for call in held:
        call.cancel()
    return {"slots": args.slots, "idle_timeout_s": args.idle_timeout, "fill_s": fill_s,
            "tries": tries, "admitted": admitted_at is not None,
            "admitted_after_s": admitted_at - first_idle if admitted_at else None,
            "waited_s": time.perf_counter() - first_idle}


async def _until_admitted(served, limit_s: float) -> tuple[float | None, int]:
    """(when an Open was accepted, or None within limit_s; Opens tried), on a channel of its
    own: a refused Open is a RESOURCE_EXHAUSTED status, or any error while the server is full."""
    started, tries = time.perf_counter(), 0
    open_msg = pb.DeviceMessage(open=pb.Open(prompt_ids=PROMPT, max_new_tokens=2,
                                             tokenizer_fingerprint=served.fingerprint))
    async with grpc.aio.insecure_channel(served.server.address) as channel:
        stub = VerifierStub(channel)
        while time.perf_counter() - started < limit_s:
            tries += 1
            call = stub.Generate()
            try:
                await call.write(open_msg)
                reply = await call.read()
            except grpc.aio.AioRpcError:
                reply = grpc.aio.EOF
            call.cancel()
            if reply is not grpc.aio.EOF and reply.WhichOneof("kind") == "opened":
                return time.perf_counter(), tries
            await asyncio.sleep(0.1)
    return None, tries


# --- the table -----------------------------------------------------------------------------------

def _table(console, results: dict, args) -> None:
    refusals, burst, slots = results["refusals"], results["tokenizer"], results["idle_slots"]
    table = Table(title="reliability: one `sled serve` child on loopback")
    for column in ("measurement", "figure", "detail"):
        table.add_column(column)
    table.add_row("RSS kept per refused prompt", f"{refusals['mib_per_refusal']:.2f} MiB",
                  f"{refusals['refusals']} refusals of {refusals['prompt_ids']:,} ids: "
                  f"{refusals['rss_before_mib']:.0f} -> {refusals['rss_after_mib']:.0f} MiB")
    table.add_row("round time during a GetTokenizer burst",
                  f"x{burst['ratio_p50']:.2f} p50, x{burst['ratio_max']:.2f} max",
                  f"{burst['alone_p50_ms']:.1f} ms alone, {burst['during_p50_ms']:.1f} ms over "
                  f"{burst['during_rounds']} rounds during {burst['calls']} calls of "
                  f"{burst['reply_mib']:.1f} MiB ({burst['burst_s']:.2f} s); slowest "
                  f"{burst['alone_max_ms']:.1f} / {burst['during_max_ms']:.1f} ms")
    after = slots["admitted_after_s"]
    table.add_row("new client in, after the first slot idles", f"{after:.2f} s" if after
                  else f"locked out > {slots['waited_s']:.0f} s",
                  f"{slots['slots']} finished sessions left open (filled in "
                  f"{slots['fill_s']:.1f} s), idle timeout {slots['idle_timeout_s']:g} s")
    console.print(table)
