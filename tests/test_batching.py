"""Batching is real: concurrent sessions share forward passes, read from the /metrics endpoint."""
from __future__ import annotations

import asyncio
import statistics
import urllib.request

import grpc

from drafters.ngram import NgramDrafter
from edge_client.session import RoundSettings, generate
from edge_client.wire import SessionRequest
from sled.v1 import verifier_pb2_grpc as pb_grpc
from lab.server_process import free_port


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


async def run_sessions(server, prompts, count: int, max_new: int = 32):
    stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(server.address))
    return await asyncio.gather(*(
        generate(stub, NgramDrafter(),
                 SessionRequest(prompts[i % len(prompts)], max_new_tokens=max_new, ignore_eos=True),
                 settings=RoundSettings(draft_len=4)) for i in range(count)))


async def test_eight_sessions_share_forward_passes(serve, models, prompts):
    server = await serve(models["llama"])
    port = free_port()
    server.metrics.serve_http(port)
    results = await run_sessions(server, prompts, 8)
    metrics = scrape(port)
    rounds = sum(r.rounds for r in results)
    assert metrics["sled_rounds_total"] == rounds
    assert metrics["sled_sessions_total"] == 8
    # Every round and prefill alone would need rounds + 8 passes; batching needs far fewer.
    assert metrics["sled_forward_passes_total"] < 0.4 * rounds
    assert metrics["sled_batch_size_sum"] / metrics["sled_batch_size_count"] > 3
    assert metrics["sled_draft_tokens_total"] == sum(r.draft_tokens for r in results)
    assert metrics["sled_accepted_tokens_total"] == sum(r.accepted_tokens for r in results)


async def test_a_lone_session_is_not_held_back_for_a_batch(serve, models, prompts):
    """No fixed wait for company: one session gets one pass per round (plus its prefill)."""
    server = await serve(models["llama"])
    [result] = await run_sessions(server, prompts[:1], 1)
    assert server.metrics.value("sled_forward_passes_total") == result.rounds + 1
    # A fixed wait would hold every round; a busy machine's hiccups hold only a few.
    assert statistics.median(s.queue_ms for s in result.round_stats) < 50


async def test_the_engine_thread_runs_steps_under_the_settings_the_server_started_with(
        serve, models, prompts, monkeypatch):
    """torch keeps its compiler settings in context variables: a step runs in the engine's
    thread, which must see what was set where the server started (the flex engine's recompile
    limit: at the default of 8, flex fell back to eager over the whole pool)."""
    import torch._dynamo.config as dynamo

    # torch's config.patch, not monkeypatch: monkeypatch's undo would delete the setting (a
    # config module keeps none in its __dict__), which hides it from torch itself afterwards
    with dynamo.patch(recompile_limit=77):
        server = await serve(models["llama"])
        engine = server.scheduler.engine
        seen, forward = [], engine.forward
        monkeypatch.setattr(engine, "forward", lambda rows: seen.append(dynamo.recompile_limit)
                            or forward(rows))
        await run_sessions(server, prompts, 2, max_new=4)
    assert seen and set(seen) == {77}
