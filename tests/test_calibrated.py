"""Calibrated pairs and the trace drafter a lab device drafts with: the shipped pairs carry
their provenance; the traces the lab writes keep a pair's acceptance; `trace:FILE` reaches the
daemon through the `sled.drafters` entry point and picks each prompt's trace; a device drafting
from it produces the target's own greedy output."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from drafters import load_drafter
from lab.traces.calibrated import (MAX_K, calibrations, load_calibration, trace_spec,
                                   write_traces)
from lab.traces.format import Trace, TraceSet
from lab.traces.replay import TraceDivergence, TraceSetDrafter
from lab.traces.synthetic import acceptance_profile
from sled.wire.sampling import Sampling

GREEDY = Sampling(temperature=0.0)


def test_the_shipped_pairs_carry_their_acceptance_and_provenance():
    pairs = calibrations()
    assert set(pairs) == {"gemma3-gguf", "smollm2-xtok"}
    for pair in pairs.values():
        assert len(pair.acceptance) == 8 and all(0.5 < a < 1 for a in pair.acceptance)
        assert {"machine", "date", "command", "workload"} <= set(pair.recorded)
        assert pair.recorded["command"].startswith(("sled trace record", "SLED_DRAFTER_THREADS"))
    # the same-weights pair keeps more of its drafts than the cross-family one
    assert min(pairs["gemma3-gguf"].acceptance) > max(pairs["smollm2-xtok"].acceptance)
    with pytest.raises(ValueError, match="gemma3-gguf, smollm2-xtok"):
        load_calibration("calibrated:nope")


def test_a_slot_drafter_becomes_its_trace_file():
    assert trace_spec("calibrated:smollm2-xtok", Path("run/traces")) == \
        "trace:run/traces/smollm2-xtok.jsonl"
    assert trace_spec("gguf:gemma3-270m", Path("run/traces")) == "gguf:gemma3-270m"


def test_written_traces_keep_the_pairs_acceptance(tmp_path):
    rng = np.random.default_rng(3)
    outputs = [rng.integers(1000, size=64).tolist() for _ in range(32)]
    prompts = [[1, i] for i in range(32)]
    written = write_traces(["calibrated:smollm2-xtok", "ngram", "calibrated:smollm2-xtok"],
                           prompts, outputs, 1000, tmp_path, "tiny")
    assert written == [tmp_path / "smollm2-xtok.jsonl"]
    traces = TraceSet.load(written[0])
    assert all(len(p) == MAX_K for t in traces.traces for p in t.proposals)
    measured = acceptance_profile(traces, 8)
    expected = load_calibration("smollm2-xtok").acceptance
    assert max(abs(m - e) for m, e in zip(measured, expected)) < 0.05, (measured, expected)


def two_prompt_set(tmp_path) -> Path:
    """Two traces whose prompts share a start: [1, 2] and [1, 2, 3]."""
    short = Trace([1, 2], [7, 8], [[7, 8], [8, 5]])
    long = Trace([1, 2, 3], [9, 4], [[9, 6], [4, 4]])
    return TraceSet("tiny", "calibrated:x", 2, [short, long]).save(tmp_path / "set.jsonl")


def test_the_trace_kind_is_found_through_its_entry_point(tmp_path):
    drafter = load_drafter(f"trace:{two_prompt_set(tmp_path)}")
    assert isinstance(drafter, TraceSetDrafter)
    assert drafter.propose([1, 2], 2, GREEDY).token_ids == [7, 8]
    assert drafter.propose([1, 2, 7], 1, GREEDY).token_ids == [8]
    assert drafter.propose([1, 2, 3], 2, GREEDY).token_ids == [9, 6]     # the longer prompt
    assert drafter.propose([1, 2, 3, 9], 1, GREEDY).token_ids == [4]
    with pytest.raises(TraceDivergence, match="2 starts"):
        drafter.propose([5, 5], 1, GREEDY)


@pytest.mark.parametrize("spec, said", [
    ("trace:", "use trace:FILE"),
    ("trace:/no/such/file.jsonl", "no such trace file"),
    ("warp:1", "trace:ARG"),
])
def test_a_bad_trace_spec_is_one_clear_error(spec, said):
    with pytest.raises(ValueError, match=said):
        load_drafter(spec)


def test_a_trace_file_without_a_draft_length_is_one_clear_error(tmp_path):
    """A header that says neither max_draft_len nor the older max_k is refused when loaded."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"sled_traces": 1, "target": "t", "drafter": "d"}\n'
                    '{"prompt_ids": [1], "target_ids": [2], "proposals": [[2]]}\n')
    with pytest.raises(ValueError, match="max_draft_len"):
        load_drafter(f"trace:{path}")


async def test_a_device_drafting_from_calibrated_traces_matches_the_target(
        serve, models, tokenizer, prompts, tmp_path):
    from edge_client.daemon import Device, Request
    from edge_client.settings import DeviceSettings
    from tests.conftest import greedy_reference

    target = models["llama"]
    server = await serve(target)
    references = [greedy_reference(target, p, 20) for p in prompts[:3]]
    [path] = write_traces(["calibrated:smollm2-xtok"], prompts[:3], references,
                          target.config.vocab_size, tmp_path, "tiny")
    device = Device(DeviceSettings(id="t", servers=[server.address], drafter=f"trace:{path}"),
                    tokenizer=tokenizer)
    await device.start()
    try:
        assert device.state == "ready", device.reason
        outputs = [await device.complete(Request(p, max_tokens=20, ignore_eos=True))
                   for p in prompts[:3]]
    finally:
        await device.close()
    assert [tokens for tokens, _, _ in outputs] == references
    assert device.metrics.value("sled_device_accepted_tokens_total") > 0
