"""Every `sled bench X` flag is range-checked by the parser (one line, exit 2, before any work),
a bench whose server's tokenizer is refused stops with one line and exit 3, and a bench
interrupted (Ctrl-C) while its server starts leaves no server behind."""
from __future__ import annotations

import importlib

import pytest

from sled_cli.main import COMMANDS, main

BENCHES = COMMANDS["bench"].commands

# (bench, flag, a value out of its range)
BAD_VALUES = [
    ("overhead", "--sessions", "0"), ("overhead", "--rounds", "0"), ("overhead", "--draft-len", "0"),
    ("acceptance", "--devices", "0"), ("acceptance", "--k", "2,0"),
    ("acceptance", "--max-new-tokens", "0"),
    ("serve", "--devices", "1,-4"), ("serve", "--draft-len", "0"), ("serve", "--draft-len", "x"),
    ("serve", "--target-rate", "0"), ("serve", "--prompts", "0"), ("serve", "--max-k", "0"),
    ("device", "--reps", "0"), ("device", "--devices", "0"), ("device", "--k", "1,x"),
    ("device", "--rtts", "5,-1"), ("device", "--pipeline-draft-len", "0"),
    ("device", "--min-confidence", "1.5"),
    ("engine", "--reps", "0"), ("engine", "-k", "0"), ("engine", "--block-tokens", "0"),
    ("engine", "--contexts", "128,0"), ("engine", "--sessions", "nan"),
    ("drafter", "--reps", "0"), ("drafter", "--tokens", "0"), ("drafter", "--draft-len", "0"),
    ("drafter", "--threads", "0"), ("drafter", "--accept", "-1"),
    ("sdsat", "--k", "0"), ("sdsat", "--devices", "0"), ("sdsat", "--lookahead", "-1"),
    ("reliability", "--refusals", "0"), ("reliability", "--prompt-len", "0"),
    ("reliability", "--rounds", "0"), ("reliability", "--burst", "0"),
    ("reliability", "--slots", "0"), ("reliability", "--idle-timeout", "0"),
    ("startup", "--reps", "0"),
]


def run_main(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_every_bench_has_bad_values_listed():
    assert set(BENCHES) <= {bench for bench, _, _ in BAD_VALUES}


@pytest.mark.parametrize("bench, flag, value", BAD_VALUES)
def test_a_bench_flag_out_of_range_is_one_line_and_exit_2(capsys, monkeypatch, bench, flag, value):
    module = importlib.import_module(BENCHES[bench].module)
    monkeypatch.setattr(module, "run", lambda args: 0)   # a flag let through would run: exit 0
    required = ["--model", "gguf:smollm2-135m"] if bench == "drafter" else []
    code, err = run_main(capsys, "bench", bench, *required, flag, value)
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
    code, err = run_main(capsys, "bench", "overhead", "--rounds", "1",
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
