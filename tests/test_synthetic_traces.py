"""Synthetic drafter traces: a stated acceptance process along the server's own output. The
profile measured back from synthetic traces is the one they were drawn with; a real recorded
trace calibrates a profile; devices replaying synthetic traces against the same server produce
its server-mode output exactly; bad profiles are refused."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from drafters.base import common_prefix
from lab.traces.format import Trace, TraceSet
from lab.traces.synthetic import (SyntheticDrafter, acceptance_profile, check_profile,
                                  synthetic_trace_set)


def random_outputs(n: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(vocab, size=length).tolist() for _ in range(n)]


def test_the_profile_measured_back_is_the_one_drawn_with():
    outputs = random_outputs(40, 200, 1000)
    traces = synthetic_trace_set([[1]] * 40, outputs,
                                 SyntheticDrafter([0.9, 0.6, 0.3], 4, seed=3, source="given"),
                                 1000, target="t", fingerprint=None)
    measured = acceptance_profile(traces, 4)
    assert measured == pytest.approx([0.9, 0.6, 0.3, 0.3], abs=0.03)


def test_a_certain_profile_drafts_the_output_and_an_impossible_one_never_does():
    outputs = random_outputs(3, 30, 50)
    sure = synthetic_trace_set([[1]] * 3, outputs, SyntheticDrafter([1.0], 4, 0, "given"), 50, "t",
                               None)
    never = synthetic_trace_set([[1]] * 3, outputs, SyntheticDrafter([0.0], 4, 0, "given"), 50, "t",
                                None)
    for s, n, out in zip(sure.traces, never.traces, outputs):
        assert all(p == out[i:i + 4] for i, p in enumerate(s.proposals) if i + 4 <= len(out))
        assert all(p[0] != out[i] and len(p) == 4 for i, p in enumerate(n.proposals))


def test_a_recorded_trace_calibrates_the_profile():
    # proposals right for 2, 0, 1 tokens after each prefix of [5, 6, 7, 8]
    trace = Trace([1], [5, 6, 7, 8], [[5, 6, 0], [0, 0, 0], [7, 0, 0], [8]])
    profile = acceptance_profile(TraceSet("t", "d", 3, [trace]), 3)
    # position 1: 3 right of 4; position 2: 1 of 2 reached (the 4th ran out of target); 3: 0 of 1
    assert profile == [0.75, 0.5, 0.0]


@pytest.mark.parametrize("profile", [[], [1.5], [-0.1], [0.5] * 65])
def test_bad_profiles_are_refused(profile):
    with pytest.raises(ValueError, match="1 to 64 probabilities"):
        check_profile(profile)


async def test_devices_replaying_synthetic_traces_reproduce_the_servers_own_output(
        serve, models, tmp_path):
    from edge_client.session import RoundSettings, generate
    from edge_client.wire import SessionRequest
    from lab.traces.replay import TraceDrafter
    from sled_cli.trace_synthesize import _synthesize
    from tests.test_lossless import server_stub

    server = await serve(models["llama"])
    out = tmp_path / "traces.jsonl"
    args = argparse.Namespace(server=server.address, workload="tiny", prompts=4, max_new_tokens=20,
                              max_draft_len=6, draft_ms_per_token=0.0, seed=0, out=str(out))
    assert await _synthesize(args, [0.8, 0.6], "given: 0.8,0.6") == 0
    traces = TraceSet.load(out)
    assert traces.drafter == "synthetic[given: 0.8,0.6]" and len(traces.traces) == 4
    accepted = verified = 0
    for trace in traces.traces:
        result = await generate(server_stub(server), TraceDrafter(trace),
                                SessionRequest(trace.prompt_ids, max_new_tokens=20),
                                settings=RoundSettings(draft_len=4))
        assert result.token_ids == trace.target_ids        # the server-mode output, exactly
        accepted, verified = accepted + result.accepted_tokens, verified + result.draft_tokens
    assert 0.2 < accepted / verified < 0.9
    assert common_prefix(traces.traces[0].proposals[0], traces.traces[0].target_ids) <= 6


def test_sled_trace_synthesize_needs_a_profile_source(capsys):
    from sled_cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["trace", "synthesize", "--server", "127.0.0.1:1", "--out", "x.jsonl"])
    assert exit_.value.code == 2 and "--acceptance" in capsys.readouterr().err
