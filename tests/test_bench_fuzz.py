"""`sled bench fuzz`: generated streams against a `sled serve` child of the tiny target, a normal
session beside them; every ending clear, nothing crashed or left behind, the normal session
lossless. What it counts as a failure makes the exit code say so."""
from __future__ import annotations

import json

import grpc
import pytest

from conftest import run_main
from lab.bench import fuzz, harness
from lab.fuzz import STREAM_TIMEOUT_S, Ending
from lab.server_process import Child
from sled.v1 import verifier_pb2 as pb


@pytest.mark.slow
def test_the_fuzz_bench_runs_clean_on_the_tiny_target(capsys, tmp_path):
    out = tmp_path / "fuzz.json"
    code, stdout, err = run_main(capsys, "bench", "fuzz", "--messages", "200", "--out", str(out))
    assert code == 0, stdout + err
    results = json.loads(out.read_text())
    assert results["messages"] >= 200 and results["streams"] > 0
    assert results["crashes"] == 0 and results["unclear"] == 0
    assert results["sessions_left"] == 0 and results["kv_blocks_left"] == 0
    assert {"OK", "INVALID_ARGUMENT"} <= set(results["endings"]), results["endings"]
    normal = results["normal"]
    assert normal["lossless"] and normal["mismatches"] == 0
    assert normal["generations"] >= 2, "the normal session did not run beside the fuzzed streams"
    assert "server crashes" in stdout and "normal session" in stdout


def ending(code: grpc.StatusCode, details: str = "", replies=(), seconds: float = 0.1) -> Ending:
    return Ending(list(replies), code, details, seconds, sent=2)


def test_an_unclear_ending_is_counted_and_a_clear_one_is_not():
    tally = fuzz.Tally()
    refused = pb.ServerMessage(error=pb.ErrorDetail(
        reason=pb.ErrorDetail.REASON_EMPTY_DRAFT, message="a draft with no tokens"))
    tally.add(ending(grpc.StatusCode.INVALID_ARGUMENT, "a draft with no tokens", [refused]))
    tally.add(ending(grpc.StatusCode.OK))
    assert tally.unclear == []
    tally.add(ending(grpc.StatusCode.INTERNAL, "Exception iterating responses"))
    tally.add(ending(grpc.StatusCode.INVALID_ARGUMENT, ""))
    tally.add(ending(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded",
                     seconds=STREAM_TIMEOUT_S))
    assert len(tally.unclear) == 3 and tally.streams == 5 and tally.messages == 10
    assert tally.endings["INVALID_ARGUMENT"] == 2


def results(**changes) -> dict:
    clean = {"crash": None, "unclear": 0, "unclear_examples": [], "sessions_left": 0,
             "kv_blocks_left": 0, "rss_growth_mib": 1.0,
             "normal": {"mismatches": 0, "generations": 5, "error": None}}
    return {**clean, **changes}


@pytest.mark.parametrize("changes, code", [
    ({}, harness.DONE),
    ({"crash": "the server exited with code -9 after 40 streams"}, harness.SERVER_FAILED),
    ({"unclear": 1, "unclear_examples": ["INTERNAL: ''"]}, harness.SERVER_FAILED),
    ({"kv_blocks_left": 2}, harness.SERVER_FAILED),
    ({"rss_growth_mib": 500.0}, harness.SERVER_FAILED),
    ({"normal": {"mismatches": 1, "generations": 5, "error": None}}, harness.LOSSY),
])
def test_the_exit_code_says_what_went_wrong(changes, code):
    assert fuzz._verdict(harness.bench_console(), results(**changes)) == code


def test_a_child_logs_to_a_file_so_the_server_never_blocks_on_its_log(tmp_path):
    """A child that logs more than a pipe holds (64 KiB) finishes, and its last lines are kept."""
    import sys

    child = Child("talker", [sys.executable, "-c", "import sys\nfor i in range(20000): "
                             "print(f'session {i} refused: a draft with no tokens', file=sys.stderr)"],
                  tmp_path / "talker.log")
    child.start()
    assert child.proc.wait(timeout=30) == 0
    assert "session 19999 refused" in child.tail()


async def test_a_server_that_refuses_the_bench_stops_it_at_once_with_the_status(tmp_path):
    """A server child that answers with a refusal (here: a device token it does not know) is up;
    waiting for it is over at once, with the status, not after the 300 s start-up timeout."""
    import time

    import pytest

    from lab.fleet import FleetStartError
    from lab.server_process import ServerProcess
    from lab.tiny import cached_pair

    tokens = tmp_path / "tokens"
    tokens.write_text("dev-1 q2VhZ2xlcy1hcmUtbm90LXJlYWw\n")
    started = time.monotonic()
    with pytest.raises(FleetStartError, match="refused: UNAUTHENTICATED"):
        async with ServerProcess(str(cached_pair()[0]), "--auth-tokens", str(tokens)):
            pass
    assert time.monotonic() - started < 120
