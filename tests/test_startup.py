"""Start-up is never silent: `sled serve` says what it loads from its first seconds (plain lines
into a pipe, a spinner on a terminal), and a warm GGUF drafter does not pay again for what its
first start computed (the tokenizer fingerprint is read from the sled cache, with no import of
transformers)."""
from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.server_process import free_port

SLED = [sys.executable, "-m", "sled_cli.main"]
# A hang detector, not a speed test: the lines come in ~1-2 s, far later on a loaded machine.
HANG_S = 120.0


def serve_command() -> list[str]:
    return [*SLED, "serve", "--model", "gemma3-270m", "--port", str(free_port()),
            "--metrics-port", str(free_port())]


def read_until(fd: int, wanted: str, timeout: float = HANG_S) -> str:
    """What FD gave until WANTED appeared (or it closed, or the timeout passed)."""
    start, seen = time.monotonic(), b""
    while time.monotonic() - start < timeout:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:   # a pty's other side closed
                break
            if not chunk:
                break
            seen += chunk
            if wanted.encode() in seen:
                break
    return seen.decode(errors="replace")


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)


def test_serve_shows_plain_progress_lines_into_a_pipe():
    proc = subprocess.Popen(serve_command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        err = read_until(proc.stderr.fileno(), "sled serve: loading gemma3-270m")
        assert "sled serve: loading gemma3-270m" in err, f"no progress line in {HANG_S} s: {err!r}"
        err += read_until(proc.stderr.fileno(), "loading the weights of gemma3-270m")
    finally:
        stop(proc)
        out = proc.stdout.read()
    lines = [line for line in err.splitlines() if line.startswith("sled serve: ")]
    assert lines[0].startswith("sled serve: loading gemma3-270m") and lines[0].endswith("...")
    assert any("loading the tokenizer of gemma3-270m" in line for line in lines), err
    assert "\r" not in err.split("Loading weights")[0] and "\x1b[" not in err, err  # no spinner
    assert out == b""          # progress never goes to stdout


def test_serve_shows_a_spinner_on_a_terminal():
    leader, follower = pty.openpty()
    proc = subprocess.Popen(serve_command(), stdin=follower, stdout=follower, stderr=follower,
                            env={**os.environ, "TERM": "xterm"})
    os.close(follower)
    try:
        seen = read_until(leader, "loading gemma3-270m")
        assert "loading gemma3-270m" in seen, f"no progress in {HANG_S} s: {seen!r}"
        seen += read_until(leader, "done in")
    finally:
        stop(proc)
        os.close(leader)
    assert "\x1b[" in seen, seen            # the spinner redraws its line
    assert "sled serve: loading the tokenizer of gemma3-270m... done in" in seen, seen


FINGERPRINT_ONCE = """
import json, sys
from drafters import load_drafter
drafter = load_drafter("gguf:smollm2-135m")
fingerprint = drafter.tokenizer_fingerprint
print(json.dumps({"fingerprint": fingerprint, "transformers": "transformers" in sys.modules}))
"""


def start_drafter(cache: Path) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", FINGERPRINT_ONCE], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "SLED_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


@pytest.mark.slow
def test_a_warm_gguf_drafter_reads_its_fingerprint_from_the_cache(tmp_path):
    first, first_err = start_drafter(tmp_path)
    second, second_err = start_drafter(tmp_path)
    assert "loading the drafter gguf:smollm2-135m..." in first_err
    assert "fingerprinting the tokenizer of SmolLM2-135M-Instruct.Q4_1.gguf" in first_err
    assert "fingerprinting" not in second_err, second_err    # the phase the warm start skips
    assert not second["transformers"]                         # and no import of transformers
    assert second["fingerprint"] == first["fingerprint"]


@pytest.mark.slow
def test_the_fingerprint_from_a_converted_copy_is_the_gguf_conversions():
    from drafters.base import tokenizer_json_fingerprint
    from drafters.gguf import gguf_vocab
    from sled.wire.fingerprint import fingerprint_vocab
    from sled.models import converted_checkpoint, gguf_path

    converted = converted_checkpoint("smollm2-135m")
    if converted is None:
        pytest.skip("smollm2-135m has no converted copy in the sled cache (sled models prepare)")
    path = gguf_path("smollm2-135m")
    assert fingerprint_vocab(gguf_vocab(path)) == \
        tokenizer_json_fingerprint(converted / "tokenizer.json")


ONNX_EXPORT = Path.home() / ".cache" / "sled" / "onnx" / "smollm2-135m-int4"


@pytest.mark.slow
@pytest.mark.skipif(not (ONNX_EXPORT / "genai_config.json").is_file(),
                    reason="needs the prepared smollm2-135m ONNX export (sled models prepare --onnx)")
def test_an_onnx_drafter_fingerprints_its_tokenizer_once(tmp_path, monkeypatch, capsys):
    from transformers import AutoTokenizer

    from drafters.onnx import ONNXDrafter
    from sled.wire.fingerprint import fingerprint_tokenizer

    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    first = ONNXDrafter(ONNX_EXPORT, max_length=256).tokenizer_fingerprint
    assert "fingerprinting the tokenizer of smollm2-135m-int4" in capsys.readouterr().err
    second = ONNXDrafter(ONNX_EXPORT, max_length=256).tokenizer_fingerprint
    assert "fingerprinting" not in capsys.readouterr().err          # read from the sled cache
    assert first == second == fingerprint_tokenizer(AutoTokenizer.from_pretrained(ONNX_EXPORT))


async def test_the_startup_bench_times_the_devices_copy_of_the_targets_tokenizer(
        serve, models, tokenizer, tmp_path, monkeypatch, capsys):
    """`sled bench startup` has a device table: the model info and the tokenizer as `sled
    generate` gets them (fetched once, then from the device's cache)."""
    import asyncio

    from lab.bench.startup import DEVICE_PHASES, _print
    from lab.bench.startup_child import _device_tokenizer
    from sled.cache import manifest_fingerprint, tokenizer_dir
    from sled.wire.fingerprint import fingerprint_tokenizer

    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    server = await serve(models["llama"])
    for _ in range(2):                                    # fetched, then from the cache
        assert await asyncio.to_thread(_device_tokenizer, server.address) > 0
    fingerprint = fingerprint_tokenizer(tokenizer)
    files = server.service.core.target.tokenizer_files_sha256
    assert manifest_fingerprint(tokenizer_dir(fingerprint, files)) == fingerprint

    class Args:
        target, drafter = "gemma3-270m", "gguf:gemma3-270m"

    from rich.console import Console
    run = {"server": {}, "drafter": {}, "device": {"device.tokenizer": 1.25}, "first_token_s": 2.0}
    _print(Console(width=200), {"warm 1": run}, Args)
    out = capsys.readouterr().out
    device = out[out.index("device start-up"):]            # the title wraps to the table's width
    assert all(phase in device for phase in DEVICE_PHASES) and "1.25" in device
