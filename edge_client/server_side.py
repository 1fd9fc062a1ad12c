"""Generation the server does alone, for devices without a drafter: centralized serving
(GENERATION_MODE_SERVER) or the target drafting for itself with SATs (GENERATION_MODE_SERVER_SAT).
The device opens a session and reads one verdict per server step until one carries a finish
reason; it sends no drafts.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from edge_client.result import GenerationResult
from edge_client.transport import Stream, Transport
from edge_client.wire import open_message
from sled.sampling import Sampling
from sled.v1 import verifier_pb2 as pb


async def generate_server_side(
    stub,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    mode: int = pb.GENERATION_MODE_SERVER,
    on_tokens: Callable[[list[int]], None] | None = None,
    timeout: float | None = None,
    transport: Transport = Stream.open,
    cache_salt: str = "",
) -> GenerationResult:
    """Open a session in `mode` and collect the verdicts the server streams to its end;
    on_tokens sees each verdict's tokens; cache_salt scopes the server's prefix cache."""
    started = time.perf_counter()
    stream = transport(stub, timeout=timeout, wait_for_ready=False)
    result = GenerationResult()
    try:
        await stream.send(open_message(prompt_ids, sampling, max_new_tokens, stop_ids,
                                       drafter="server", ignore_eos=ignore_eos, mode=mode,
                                       cache_salt=cache_salt))
        await stream.receive()  # opened
        finished = False
        while not finished:
            verdict = (await stream.receive()).verdict
            finished = result.add(verdict, started)
            if on_tokens is not None:
                on_tokens(list(verdict.emitted_ids))
        await stream.done_writing()
    except BaseException:
        stream.cancel()
        raise
    result.elapsed_s = time.perf_counter() - started
    return result
