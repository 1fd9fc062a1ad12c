"""The centralized baseline is itself lossless and batched: one pass per token step for all."""
from __future__ import annotations

from conftest import greedy_reference
from verify_server.centralized import generate_centralized
from verify_server.engines import make_engine


def test_centralized_matches_generate_and_batches_every_session(models, prompts):
    model = models["gemma3"]
    run = generate_centralized(make_engine(model, kv_budget_bytes=16 << 20), prompts, max_new_tokens=12)
    assert run.outputs == [greedy_reference(model, p, 12) for p in prompts]
    # one prefill pass (one-token prompts skip it) + one pass per step for all sessions together
    assert run.forward_passes == 12 + (1 if any(len(p) > 1 for p in prompts) else 0)


def test_centralized_stops_a_session_at_eos(models, prompts):
    model = models["llama"]
    eos = greedy_reference(model, prompts[0], 12)[4]
    run = generate_centralized(make_engine(model, kv_budget_bytes=16 << 20), prompts[:3], max_new_tokens=12, eos_ids=(eos,))
    assert run.outputs == [greedy_reference(model, p, 12, eos=eos) for p in prompts[:3]]
    assert run.outputs[0][-1] == eos and len(run.outputs[0]) <= 5
