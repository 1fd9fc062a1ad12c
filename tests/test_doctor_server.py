"""`sled doctor --server`: on this CPU machine it says plainly that torch has no CUDA, counts the
target's weights and KV against free memory from its config alone, and passes one step of the
target through the engine the server would use, as transformers' own forward gives it; a check
that fails is one line and exit 1."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import run_main, run_sled
from lab.tiny import save_pair
from verify_server import preflight
from verify_server.engines.blocks import KVShape
from verify_server.preflight import Footprint, PreflightFailed, footprint, memory_check
from verify_server.target import Target

CHECKS = ["torch", "gpu", "device", "model", "memory", "flex", "forward"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("tiny"), "gemma3")[0]


def keys(out: str) -> list[str]:
    return [line.split(":", 1)[0] for line in out.splitlines()]


def test_the_server_check_passes_a_cpu_step_and_says_torch_has_no_cuda(capsys, checkpoint):
    code, out, err = run_main(capsys, "doctor", "--server", "--model", str(checkpoint))
    assert code == 0, out + err
    assert keys(out) == CHECKS, out
    lines = dict(line.split(": ", 1) for line in out.splitlines())
    if not torch.backends.cuda.is_built():
        assert "built without CUDA" in lines["torch"] and lines["gpu"] == "none seen"
        assert lines["device"].startswith("cpu, float32 (no GPU seen")
    assert "parameters x 4 bytes, float32" in lines["memory"]
    assert lines["flex"].startswith("not used: the paged engine serves on cpu")
    assert "through the paged engine" in lines["forward"]
    assert lines["forward"].endswith("the same as the plain transformers forward")


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="this torch has CUDA")
def test_asking_for_cuda_on_torchs_cpu_build_fails_the_device_check(capsys, checkpoint):
    code, out, _ = run_main(capsys, "doctor", "--server", "--model", str(checkpoint),
                            "--device", "cuda")
    assert code == 1
    assert out.splitlines()[-1].startswith("device: --device cuda: this torch")
    assert "install torch's CUDA build" in out.splitlines()[-1]


def test_a_model_that_is_not_there_fails_the_model_check(capsys, tmp_path):
    code, out, _ = run_main(capsys, "doctor", "--server", "--model", str(tmp_path / "none"),
                            "--device", "cpu")
    assert code == 1
    assert keys(out)[-1] == "model" and "is not a folder here" in out.splitlines()[-1]


@pytest.mark.parametrize("argv, wanted", [
    (["--server", "--repair"], "--repair checks a device's drafter"),
    (["--model", "gemma3-270m"], "give --server too"),
    (["--server", "--device", "gpu"], "--device gpu: not a device sled serves on"),
])
def test_flags_that_do_not_go_together_are_exit_2(capsys, argv, wanted):
    code, _, err = run_main(capsys, "doctor", *argv)
    assert code == 2 and wanted in err and "Traceback" not in err


def test_the_weights_are_counted_from_the_config_as_the_loaded_model_has_them(checkpoint):
    fit = footprint(str(checkpoint), "bfloat16")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    assert fit.parameters == sum(p.numel() for p in model.parameters())   # tied: counted once
    assert fit.weight_bytes == fit.parameters * 2
    assert fit.kv_bytes_per_token == KVShape.of(model).bytes_per_token


def test_weights_past_free_memory_and_a_kv_cache_under_a_block_fail(monkeypatch):
    fit = Footprint(parameters=8_030_261_248, dtype=torch.bfloat16, kv_bytes_per_token=131072,
                    context_length=131072)
    monkeypatch.setattr(preflight, "free_memory_bytes", lambda device: 14 << 30)
    with pytest.raises(PreflightFailed, match=r"weights 14.96 GiB .* do not fit in the 14.00 GiB"):
        memory_check(fit, torch.device("cuda"), 0.25, 16)
    monkeypatch.setattr(preflight, "free_memory_bytes", lambda device: fit.weight_bytes + (4 << 20))
    with pytest.raises(PreflightFailed, match="less than one 16-token block"):
        memory_check(fit, torch.device("cuda"), 0.25, 16)
    with pytest.raises(PreflightFailed, match=r"--kv-budget 8.0 MiB does not fit in the 4.0 MiB"):
        memory_check(fit, torch.device("cuda"), 0.25, 16, kv_budget=8 << 20)
    monkeypatch.setattr(preflight, "free_memory_bytes", lambda device: 80 << 30)
    said = memory_check(fit, torch.device("cuda"), 0.25, 16)
    assert "KV at --kv-fraction 0.25 of the 65.04 GiB left: 16.26 GiB, 133,206 tokens" in said
    assert "1 full context of 131,072 tokens" in said
    said = memory_check(fit, torch.device("cuda"), 0.25, 16, kv_budget=4 << 30)
    assert "KV at --kv-budget, of the 65.04 GiB left: 4.00 GiB, 32,768 tokens" in said


def test_an_engine_whose_next_token_differs_fails_the_forward_check(checkpoint, monkeypatch):
    target = Target.load(str(checkpoint))
    said = preflight.step_check(target, "paged", 16)
    token = int(said.split("(")[-1].split(")")[0])
    monkeypatch.setattr(preflight, "_next_token", lambda target, prompt: token + 1)
    with pytest.raises(PreflightFailed, match=f"next token .* is .*\\({token}\\), transformers' "
                                              f"own forward gives {token + 1}"):
        preflight.step_check(target, "paged", 16)


def test_the_flex_check_compiles_flex_on_a_cpu_and_finds_it_agrees(capsys, checkpoint):
    code, out, err = run_main(capsys, "doctor", "--server", "--model", str(checkpoint),
                              "--device", "cpu", "--engine", "flex")
    assert code == 0, out + err
    flex = out.splitlines()[keys(out).index("flex")]
    assert flex.startswith("flex: compiled flex attention agrees with eager flex on cpu at ")
    assert "window" in flex        # Gemma 3: the full layers' shape and the windowed one
    assert "through the flex engine" in out.splitlines()[-1]


@pytest.mark.slow
def test_sled_doctor_server_checks_the_builtin_target_on_this_cpu():
    done = run_sled("doctor", "--server", timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert keys(done.stdout) == CHECKS, done.stdout
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert lines["model"].startswith("gemma3-270m")
    assert "268,098,176 parameters" in lines["memory"]
    if not torch.backends.cuda.is_built():
        assert "built without CUDA" in lines["torch"]
    assert lines["forward"].endswith("the same as the plain transformers forward")


def test_logits_that_overflow_the_dtype_fail_the_forward_check(checkpoint):
    """Gemma 3 in float16 overflows (every logit NaN, every argmax id 0, the engine agreeing):
    the check looks at the logits, not only at the two argmaxes."""
    target = Target.load(str(checkpoint), dtype="float16")
    with torch.no_grad():
        target.model.get_output_embeddings().weight.fill_(60000.0)
    with pytest.raises(PreflightFailed, match="not finite in float16 .*--dtype bfloat16 or float32"):
        preflight.step_check(target, "paged", 16)
