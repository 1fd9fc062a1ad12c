"""Greedy oracle: sled's output is token-identical to the target's generate(do_sample=False),
for every architecture, drafter and draft length, with 8 sessions batched on one server."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from conftest import greedy_reference
from drafters.cacheback import CachebackDrafter
from drafters.hf import HFDrafter
from drafters.hier import HierDrafter
from drafters.ngram import NgramDrafter
from edge_client.session import RoundSettings, generate
from edge_client.wire import SessionRequest
from verify_server.server import start_server
from verify_server.target import Target

MAX_NEW = 24


@pytest.fixture(scope="module")
def references(models, prompts):
    return {arch: [greedy_reference(model, p, MAX_NEW) for p in prompts] for arch, model in models.items()}


def make_drafter(kind: str, arch: str, drafter_models, tokenizer):
    if kind == "hf":
        return HFDrafter(drafter_models[arch], tokenizer, name="hf:noisy")
    if kind == "hier":   # n-gram guesses checked by the noisy model drafter
        return HierDrafter(NgramDrafter(), HFDrafter(drafter_models[arch], tokenizer, name="hf:noisy"))
    return CachebackDrafter() if kind == "cacheback" else NgramDrafter()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", ["hf", "ngram", "cacheback", "hier"])
@pytest.mark.parametrize("k", range(1, 9))
async def test_eight_concurrent_sessions_match_generate(serve, models, drafter_models, tokenizer,
                                                        prompts, references, arch, kind, k):
    server = await serve(models[arch])
    # Cacheback's one table serves every session, as on a device.
    shared = make_drafter(kind, arch, drafter_models, tokenizer) if kind == "cacheback" else None
    results = await asyncio.gather(*(
        generate(server_stub(server), shared or make_drafter(kind, arch, drafter_models, tokenizer),
                 SessionRequest(prompt, max_new_tokens=MAX_NEW),
                 settings=RoundSettings(draft_len=k))
        for prompt in prompts))
    for result, reference in zip(results, references[arch]):
        assert result.token_ids == reference
        assert result.finish_reason == "length"
    assert sum(r.draft_tokens for r in results) > 0
    if kind in ("hf", "hier"):  # a good drafter is accepted often, and sometimes rejected
        accepted = sum(r.accepted_tokens for r in results) / sum(r.draft_tokens for r in results)
        assert 0.1 < accepted < 1.0


_stubs = {}


def server_stub(server):
    """One channel per server for the whole test."""
    import grpc

    from sled.v1 import verifier_pb2_grpc as pb_grpc

    if server.port not in _stubs:
        _stubs[server.port] = pb_grpc.VerifierStub(grpc.aio.insecure_channel(server.address))
    return _stubs[server.port]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("k", [1, 4, 8])
async def test_eos_inside_an_accepted_run_ends_where_generate_ends(models, drafter_models, tokenizer,
                                                                    prompts, references, arch, k):
    """Pick a token the target emits mid-output as EOS: output stops exactly there, EOS included."""
    model = models[arch]
    finished_inside_run = 0
    for prompt, reference in zip(prompts, references[arch]):
        eos = reference[6]
        expected = greedy_reference(model, prompt, MAX_NEW, eos=eos)
        target = dataclasses.replace(Target.from_model(model, tokenizer, "tiny"), eos_ids=(eos,))
        server = await start_server(target)
        try:
            # The target itself as drafter: every draft is accepted, so EOS lands inside a run.
            drafter = HFDrafter(model, tokenizer) if prompt is prompts[0] else \
                HFDrafter(drafter_models[arch], tokenizer)
            result = await generate(server_stub(server), drafter,
                                    SessionRequest(prompt, max_new_tokens=MAX_NEW),
                                    settings=RoundSettings(draft_len=k))
        finally:
            await server.stop(grace=0)
        assert result.token_ids == expected
        assert result.token_ids[-1] == eos and result.finish_reason == "eos"
        finished_inside_run += result.accepted_tokens > 0
    assert finished_inside_run > 0


async def test_stop_ids_end_the_session_like_eos(serve, models, drafter_models, tokenizer, prompts,
                                                 references):
    server = await serve(models["llama"])
    for prompt, reference in zip(prompts[:4], references["llama"]):
        stop = reference[3]
        result = await generate(server_stub(server), HFDrafter(drafter_models["llama"], tokenizer),
                                SessionRequest(prompt, max_new_tokens=MAX_NEW, stop_ids=[stop]),
                                settings=RoundSettings(draft_len=4))
        assert result.token_ids == greedy_reference(models["llama"], prompt, MAX_NEW, eos=stop)
        assert result.finish_reason == "stop"


async def test_ignore_eos_runs_to_the_length_limit(models, tokenizer, prompts, references):
    reference = references["llama"][0]
    target = dataclasses.replace(Target.from_model(models["llama"], tokenizer, "tiny"),
                                 eos_ids=(reference[2],))
    server = await start_server(target)
    try:
        result = await generate(server_stub(server), NgramDrafter(),
                                SessionRequest(prompts[0], max_new_tokens=MAX_NEW, ignore_eos=True),
                                settings=RoundSettings(draft_len=3))
    finally:
        await server.stop(grace=0)
    assert result.token_ids == reference and result.finish_reason == "length"


@pytest.mark.parametrize("max_new", [1, 2, 3, 9])
@pytest.mark.parametrize("k", [1, 8])
async def test_length_limit_is_exact_for_any_draft_length(serve, models, tokenizer, prompts, max_new, k):
    server = await serve(models["gemma3"])
    for prompt in prompts[:3]:
        result = await generate(server_stub(server), HFDrafter(models["gemma3"], tokenizer),
                                SessionRequest(prompt, max_new_tokens=max_new),
                                settings=RoundSettings(draft_len=k))
        assert result.token_ids == greedy_reference(models["gemma3"], prompt, max_new)
        assert len(result.token_ids) == max_new and result.finish_reason == "length"


async def test_one_token_prompt_and_long_prompt_batched_together(serve, models, drafter_models,
                                                                 tokenizer):
    """Very different context lengths (1 token with no prefill, ~200 tokens) in the same passes."""
    long_prompt = tokenizer(" ".join(["def fib(n): return n"] * 20)).input_ids
    batch = [[5], long_prompt, [7, 8], long_prompt[:50]]
    server = await serve(models["gemma3"])
    results = await asyncio.gather(*(
        generate(server_stub(server), HFDrafter(drafter_models["gemma3"], tokenizer),
                 SessionRequest(p, max_new_tokens=MAX_NEW), settings=RoundSettings(draft_len=3))
        for p in batch))
    for prompt, result in zip(batch, results):
        assert result.token_ids == greedy_reference(models["gemma3"], prompt, MAX_NEW)
    assert server.metrics.value("sled_batch_size_sum") > server.metrics.value("sled_batch_size_count")
