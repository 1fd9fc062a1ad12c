"""Every `sled bench X` flag is range-checked by the parser (one line, exit 2, before any work),
a bench whose server's tokenizer is refused stops with one line and exit 3, and a bench
interrupted (Ctrl-C) while its server starts leaves no server behind."""
from __future__ import annotations

import argparse
import importlib

import pytest

from conftest import run_main
from sled_cli.main import COMMANDS

BENCHES = COMMANDS["bench"].commands

# (bench, flag, a value out of its range)
BAD_VALUES = [
    ("overhead", "--sessions", "0"), ("overhead", "--rounds", "0"), ("overhead", "--draft-len", "0"),
    ("overhead", "--access", "plain,ssh"), ("overhead", "--access", "tls,tls"),
    ("acceptance", "--devices", "0"), ("acceptance", "--draft-lens", "2,0"),
    ("acceptance", "--max-new-tokens", "0"),
    ("serve", "--devices", "1,-4"), ("serve", "--draft-len", "0"), ("serve", "--draft-len", "x"),
    ("serve", "--target-rate", "0"), ("serve", "--prompts", "0"), ("serve", "--max-draft-len", "0"),
    ("device", "--reps", "0"), ("device", "--devices", "0"), ("device", "--draft-lens", "1,x"),
    ("device", "--rtts", "5,-1"), ("device", "--pipeline-draft-len", "0"),
    ("device", "--min-confidence", "1.5"),
    ("engine", "--reps", "0"), ("engine", "--draft-len", "0"), ("engine", "--block-tokens", "0"),
    ("engine", "--contexts", "128,0"), ("engine", "--sessions", "nan"),
    ("engine", "--engines", "paged,vllm"), ("engine", "--shape", "llama-70b"),
    ("derive-profile", "--shape", "llama-405b"), ("derive-profile", "--gpu", "B200"),
    ("derive-profile", "--weight-dtype", "int3"),
    ("publish-profile", "--engine", "trt-llm"), ("publish-profile", "--gpu", "A100"),
    ("placement", "--devices", "0"), ("placement", "--phase-s", "0"),
    ("placement", "--placement", "fixed"),
    ("kv-windows", "--contexts", "512,0"), ("kv-windows", "--answer", "0"),
    ("kv-windows", "--max-step-tokens", "x"),
    ("drafter", "--reps", "0"), ("drafter", "--tokens", "0"), ("drafter", "--draft-len", "0"),
    ("drafter", "--threads", "0"), ("drafter", "--accept", "-1"),
    ("drafting", "--draft-len", "0"), ("drafting", "--tree", "0"), ("drafting", "--max-new-tokens", "0"),
    ("loose", "--problems", "0"), ("loose", "--timeout", "0"), ("loose", "--loose", "2:0.5,0:1"),
    ("loose", "--loose", "2:2"), ("loose", "--draft-len", "0"),
    ("sdsat", "--draft-len", "0"), ("sdsat", "--devices", "0"), ("sdsat", "--lookahead", "-1"),
    ("reliability", "--refusals", "0"), ("reliability", "--prompt-len", "0"),
    ("reliability", "--rounds", "0"), ("reliability", "--burst", "0"),
    ("reliability", "--slots", "0"), ("reliability", "--idle-timeout", "0"),
    ("startup", "--reps", "0"),
    ("fuzz", "--messages", "0"), ("fuzz", "--seed", "-1"),
    ("soak", "--devices", "0"), ("soak", "--minutes", "0"), ("soak", "--rate", "-1"),
    ("soak", "--max-tokens", "0"),
    ("footprint", "--requests", "0"), ("footprint", "--max-tokens", "0"),
    ("footprint", "--reps", "0"), ("footprint", "--slim", "gguf,server"),
]


# (bench, the draft length's flag before it was named like everywhere else, its name now, a value)
OLD_NAMES = [("acceptance", "--k", "--draft-lens", "2,6"), ("device", "--k", "--draft-lens", "1,3"),
             ("engine", "-k", "--draft-len", "3"), ("drafting", "--k", "--draft-len", "3"),
             ("loose", "--k", "--draft-len", "3"), ("sdsat", "--k", "--draft-len", "3"),
             ("serve", "--max-k", "--max-draft-len", "3")]


@pytest.mark.parametrize("bench, old, new, value", OLD_NAMES)
def test_the_old_draft_length_flags_still_work_but_help_shows_the_new_name(
        capsys, monkeypatch, bench, old, new, value):
    module = importlib.import_module(BENCHES[bench].module)
    seen = []
    monkeypatch.setattr(module, "run", lambda args: seen.append(args) or 0)
    for flag in (old, new):
        assert run_main(capsys, "bench", bench, flag, value)[0] == 0
    dest = new.lstrip("-").replace("-", "_")
    assert getattr(seen[0], dest) == getattr(seen[1], dest) and str(getattr(seen[0], dest)) == value
    code, out, _ = run_main(capsys, "bench", bench, "--help")
    assert code == 0 and new in out and f"{old} " not in out and f"{old}," not in out


def test_every_bench_has_bad_values_listed():
    assert set(BENCHES) <= {bench for bench, _, _ in BAD_VALUES}


@pytest.mark.parametrize("bench, flag, value", BAD_VALUES)
def test_a_bench_flag_out_of_range_is_one_line_and_exit_2(capsys, monkeypatch, bench, flag, value):
    module = importlib.import_module(BENCHES[bench].module)
    monkeypatch.setattr(module, "run", lambda args: 0)   # a flag let through would run: exit 0
    required = ["--model", "gguf:smollm2-135m"] if bench == "drafter" else []
    code, _, err = run_main(capsys, "bench", bench, *required, flag, value)
    errors = [line for line in err.splitlines() if not line.startswith(("usage:", " "))]
    assert code == 2, err
    assert len(errors) == 1 and flag in errors[0] and "Traceback" not in err, err


def test_a_refused_tokenizer_stops_a_bench_with_one_line_and_exit_3(capsys, monkeypatch, tmp_path):
    from edge_client.connection import Connection
    from sled.cache import CacheError

    async def refused(self, *args, **kwargs):
        raise CacheError(f"the tokenizer the server at {self.address} sent does not match its "
                         "fingerprint")

    monkeypatch.setattr(Connection, "tokenizer", refused)
    # A cache of its own: the tiny model is made here for the first time, as on a new machine,
    # where transformers' "Writing model shards" bars once came before the one line.
    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    code, _, err = run_main(capsys, "bench", "overhead", "--rounds", "1",
                         "--out", str(tmp_path / "overhead.json"))
    assert code == 3, err
    assert err.strip().splitlines() == [line for line in err.strip().splitlines()
                                        if line.startswith("sled bench overhead: ")], err
    assert "does not match its fingerprint" in err and "Traceback" not in err


def test_a_bench_cancelled_while_its_server_starts_ends_the_server(monkeypatch):
    """Ctrl-C cancels the bench's task (asyncio.run); the `sled serve` child must not outlive it."""
    import asyncio

    import lab.server_process
    from lab.bench import harness
    from lab.tiny import cached_pair

    started = []

    class Recorded(lab.server_process.ServerProcess):
        async def __aenter__(self):
            started.append(self)
            return await super().__aenter__()

    monkeypatch.setattr(lab.server_process, "ServerProcess", Recorded)

    async def bench() -> None:
        async with harness.serving(cached_pair()[0]):
            await asyncio.sleep(3600)

    async def interrupt() -> None:
        task = asyncio.create_task(bench())
        while not (started and started[0].proc is not None):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)              # the child is loading its target
        task.cancel()                         # what Ctrl-C does to asyncio.run's task
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupt())
    proc = started[0].proc
    try:
        proc.wait(15)
    finally:
        proc.kill()
    assert proc.returncode is not None


def test_an_unexpected_grpc_error_stops_a_bench_with_one_line_and_exit_3(capsys, monkeypatch):
    """A status the bench does not handle (here the server's GetTokenizer limit) is one line and
    exit 3: exit 1 would say an output differs from the target's."""
    import grpc

    from lab.bench import reliability

    async def refused(args):
        raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                                   grpc.aio.Metadata(),
                                   details="8 GetTokenizer replies are being sent (limit 8)")

    monkeypatch.setattr(reliability, "bench", refused)
    code, _, err = run_main(capsys, "bench", "reliability")
    assert code == 3, err
    assert err.strip().splitlines() == ["sled bench reliability: the server answered "
                                        "RESOURCE_EXHAUSTED: 8 GetTokenizer replies are being "
                                        "sent (limit 8)"], err


def reliability_args(*argv: str):
    import argparse

    from lab.bench import reliability

    parser = argparse.ArgumentParser()
    reliability.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("burst", [None, "3", "40"])
def test_the_reliability_server_answers_the_whole_burst_at_once(burst):
    """The bench times rounds while --burst GetTokenizer calls are answered: its server must not
    refuse any of them (its default limit, 8, is below the bench's default burst, 12)."""
    from lab.bench import reliability

    args = reliability_args(*(["--burst", burst] if burst else []))
    flags = reliability.server_args(args)
    assert int(flags[flags.index("--max-tokenizer-calls") + 1]) >= args.burst


def test_a_reliability_prompt_that_fits_the_context_is_a_bad_flag(capsys):
    """A prompt the server would not refuse for its length measures nothing: exit 2, one line,
    before any server starts."""
    code, _, err = run_main(capsys, "bench", "reliability", "--prompt-len", "100")
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--prompt-len 100" in lines[0] and "Traceback" not in err, err


class RefusedOpen:
    """A Generate call whose Open was refused with REASON and CODE."""

    def __init__(self, reason: int, code) -> None:
        from sled.v1 import verifier_pb2 as pb

        self.reply = pb.ServerMessage(error=pb.ErrorDetail(reason=reason, message="refused"))
        self._code = code

    async def read(self):
        return self.reply

    async def done_writing(self) -> None:
        pass

    async def code(self):
        return self._code

    def cancel(self) -> None:
        pass


def test_the_reliability_refusals_count_only_refusals_for_length():
    """An over-long prompt refused for anything else (an empty or wrong fingerprint) stops the
    bench: it would not measure what a refused prompt keeps."""
    import asyncio

    import grpc

    from lab.bench import harness, reliability
    from sled.v1 import verifier_pb2 as pb

    Reason = pb.ErrorDetail
    asyncio.run(reliability._refused_for_size(
        RefusedOpen(Reason.REASON_CONTEXT_OVERFLOW, grpc.StatusCode.INVALID_ARGUMENT)))
    for reason, code in [(Reason.REASON_TOKENIZER_MISMATCH, grpc.StatusCode.INVALID_ARGUMENT),
                         (Reason.REASON_TOKENIZER_MISMATCH, grpc.StatusCode.FAILED_PRECONDITION),
                         (Reason.REASON_CONTEXT_OVERFLOW, grpc.StatusCode.RESOURCE_EXHAUSTED)]:
        with pytest.raises(harness.Stop, match="not for its length") as stop:
            asyncio.run(reliability._refused_for_size(RefusedOpen(reason, code)))
        assert stop.value.code == harness.SERVER_FAILED


@pytest.mark.slow
def test_the_reliability_bench_runs_on_the_tiny_target(capsys, tmp_path):
    """The whole bench, small, against the tiny target: every measurement, exit 0."""
    import json

    out = tmp_path / "reliability.json"
    code, _, err = run_main(capsys, "bench", "reliability", "--refusals", "2", "--rounds", "3",
                         "--prompt-len", "1000", "--slots", "2", "--idle-timeout", "0.5",
                         "--out", str(out))
    assert code == 0, err
    results = json.loads(out.read_text())
    assert results["refusals"]["refusals"] == 2 and results["tokenizer"]["calls"] == 12
    assert results["idle_slots"]["admitted"]


@pytest.mark.parametrize("flag, value, said", [
    ("--python", "/no/such/python", "--python /no/such/python: no such file"),
    ("--source", "/tmp", "--source /tmp: not a sled source tree"),
    ("--compare", "/no/such/before.json", "/no/such/before.json")])
def test_a_footprint_path_that_is_not_there_is_one_line_and_exit_2(capsys, tmp_path, flag, value,
                                                                      said):
    """Said before any venv is built or any server starts."""
    code, _, err = run_main(capsys, "bench", "footprint", "--slim", "none", flag, value,
                            "--out", str(tmp_path / "footprint.json"))
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and "Traceback" not in err, err


def test_the_footprint_budgets_are_the_documented_ones():
    from lab.bench.footprint import budget

    run = {"drafter": "ngram", "idle_rss_mb": 119.0, "ready_without_load_s": 1.9,
           "model_file_mb": None}
    assert budget(run) == []
    assert budget({**run, "idle_rss_mb": 121.0, "ready_without_load_s": 2.1}) == \
        ["RSS > 120", "ready > 2 s"]
    gguf = {**run, "drafter": "gguf:gemma3-270m", "idle_rss_mb": 370.0, "model_file_mb": 253.1}
    assert budget(gguf) == []
    assert budget({**gguf, "idle_rss_mb": 374.0}) == ["RSS > file + 120"]


def test_a_slim_venv_gets_a_built_in_drafter_as_its_file(monkeypatch):
    """A venv without the model packages cannot resolve gguf:ALIAS: it is given the file the
    alias resolves to here; the full environment keeps the alias."""
    from lab.bench import footprint
    from lab.bench.footprint import Env, _daemon_spec

    monkeypatch.setattr(footprint, "resolve_spec", lambda spec: "gguf:/cache/gemma.gguf")
    slim, full = Env("slim gguf", "python", extras="gguf"), Env("full", "python")
    assert _daemon_spec(slim, "gguf:gemma3-270m") == "gguf:/cache/gemma.gguf"
    assert _daemon_spec(full, "gguf:gemma3-270m") == "gguf:gemma3-270m"
    assert _daemon_spec(slim, "ngram") == "ngram"
    assert _daemon_spec(slim, "gguf:/my/own.gguf") == "gguf:/my/own.gguf"


def test_an_environment_size_leaves_out_llama_cpp_when_asked(monkeypatch, tmp_path):
    """What llama-cpp-python installed, its RECORD says (lib/ beside its package too); a file no
    RECORD names counts for the distribution whose files share its folder."""
    from lab import slim_env

    files = {"llama_cpp/llama.py": 1_000_000, "lib/libggml.so": 2_000_000,
             "llama_cpp/__pycache__/llama.cpython-311.pyc": 500_000,
             "numpy/core.so": 2_000_000, "numpy/__init__.py": 100_000, "six.py": 400_000}
    for name, size in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    records = {"llama_cpp_python-0.3.36": ["llama_cpp/llama.py", "lib/libggml.so"],
               "numpy-2.1.0": ["numpy/core.so", "numpy/__init__.py"]}
    for dist, recorded in records.items():
        (tmp_path / f"{dist}.dist-info").mkdir()
        (tmp_path / f"{dist}.dist-info" / "RECORD").write_text(
            "".join(f"{name},sha256=x,{files[name]}\n" for name in recorded))
    monkeypatch.setattr(slim_env, "site_packages", lambda python: [tmp_path])
    size = slim_env.environment_size("python")
    assert size["site_packages_mb"] == 6.0 and size["without_llama_cpp_mb"] == 2.5
    assert size["largest"][:3] == [["llama_cpp_python", 3.5], ["numpy", 2.1], ["six.py", 0.4]]


@pytest.mark.slow
def test_the_footprint_bench_runs_an_ngram_daemon_on_the_tiny_target(capsys, tmp_path):
    """The whole bench, small (this environment only, the tiny target, an n-gram daemon), then
    again set beside the first run: every measurement, a ratio, exit 0."""
    import json
    import re

    from lab.tiny import cached_pair

    first, second = tmp_path / "first.json", tmp_path / "second.json"
    flags = ["--target", str(cached_pair()[0]), "--drafters", "ngram", "--slim", "none",
             "--requests", "2", "--max-tokens", "4"]
    code, _, err = run_main(capsys, "bench", "footprint", *flags, "--out", str(first))
    assert code == 0, err
    code, out, err = run_main(capsys, "bench", "footprint", *flags, "--compare", str(first),
                              "--out", str(second))
    assert code == 0, err
    results = json.loads(second.read_text())
    [run] = results["runs"]
    assert run["env"] == "full" and run["drafter"] == "ngram" and run["load_s"] == 0
    assert 0 < run["idle_rss_mb"] <= run["loaded_hwm_mb"] and 0 < run["ready_s"] < 120
    env = results["envs"]["full"]
    assert env["modules"]["torch"] and 0 < env["without_llama_cpp_mb"] <= env["site_packages_mb"]
    assert re.search(r"\b\d+\.\d\dx\b", out) and second.with_suffix(".png").exists()   # a ratio


def test_placement_with_a_target_of_its_own_needs_a_drafter_of_its_own():
    from lab.bench import harness
    from lab.bench.placement import _pair

    with pytest.raises(harness.Stop, match="--model needs --drafter") as stop:
        _pair(argparse.Namespace(model="gemma3-270m", drafter=None))
    assert stop.value.code == harness.BAD_FLAGS
    assert _pair(argparse.Namespace(model="gemma3-270m", drafter="ngram"))[1] == "ngram"
