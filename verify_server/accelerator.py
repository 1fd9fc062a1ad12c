"""Where the target runs: a torch device checked before anything loads, and the GPUs torch sees.

`sled serve --device D --dtype T` asks `check_device` first, so a device this torch cannot
use is one line and exit 2, never a traceback from inside transformers:

    --device cuda on torch's CPU build      install torch's CUDA build, or --device cpu
    --device cuda:7 on a machine of 2 GPUs  the GPUs there are, cuda:0 to cuda:1
    --device mps / xpu where torch has none --device cpu
    --dtype bfloat16 on a GPU before Ampere --dtype float16 (compute capability 8.0 is needed)

check_device reads what the driver reports and allocates nothing (a split server's ranks each
ask it before they pick their GPU); describe_gpus, for `sled doctor --server`, asks each GPU for
its free memory, which makes a CUDA context there.
"""
from __future__ import annotations

import torch

from sled.printable import counted

SERVED_TYPES = ("cpu", "cuda", "mps", "xpu")
BF16_CAPABILITY = (8, 0)      # bfloat16 matmuls in hardware from Ampere on
MIB, GIB = 1 << 20, 1 << 30
CUDA_BUILD_HELP = ('install torch\'s CUDA build for this machine\'s driver (docs/server.md, "On '
                   'a CUDA machine")')


class DeviceUnavailable(ValueError):
    """A torch device sled serves on, which this machine or this torch cannot give."""


def parse_device(text: str) -> torch.device:
    """TEXT as a torch device of a type sled serves on; ValueError (one line) otherwise."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in SERVED_TYPES:
        raise ValueError(f"--device {text}: not a device sled serves on; use cpu, cuda, cuda:N "
                         "(a GPU of this machine), mps or xpu")
    return device


def check_device(text: str, dtype: str) -> torch.device:
    """The device TEXT names, once this torch and machine can run a DTYPE target there;
    ValueError for a bad spelling, DeviceUnavailable (one line, what to do) for the rest."""
    device = parse_device(text)
    if device.type == "cuda":
        _check_cuda(device, text)
        _check_cuda_dtype(device, dtype)
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceUnavailable(f"--device {text}: this torch ({torch.__version__}) has no "
                                    "MPS device (Apple GPUs, on macOS): serve with --device cpu")
        if dtype == "float64":
            raise DeviceUnavailable("--dtype float64: MPS computes in at most 32 bits: give "
                                    "--dtype float32, bfloat16 or float16")
    elif device.type == "xpu":
        _check_xpu(device, text)
    return device


def _check_cuda(device: torch.device, text: str) -> None:
    if not torch.backends.cuda.is_built():
        raise DeviceUnavailable(f"--device {text}: this torch ({torch.__version__}) is built "
                                f"without CUDA: {CUDA_BUILD_HELP}, or serve with --device cpu")
    count = torch.cuda.device_count()
    if count == 0:
        raise DeviceUnavailable(
            f"--device {text}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: "
            "nvidia-smi should list one, with a driver for that CUDA version; CUDA_VISIBLE_DEVICES "
            "may hide them; or serve with --device cpu")
    if device.index is not None and device.index >= count:
        raise DeviceUnavailable(f"--device {text}: this machine shows {counted(count, 'GPU')} "
                                f"({_indices('cuda', count)})")


def _check_cuda_dtype(device: torch.device, dtype: str) -> None:
    """bfloat16 needs a GPU of compute capability 8.0 (Ampere) or newer."""
    if dtype != "bfloat16":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < BF16_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise DeviceUnavailable(
            f"--dtype bfloat16 needs a GPU of compute capability {_dotted(BF16_CAPABILITY)} or "
            f"newer (Ampere); {name} is {_dotted(capability)}: give --dtype float16")


def _check_xpu(device: torch.device, text: str) -> None:
    count = torch.xpu.device_count() if torch.xpu.is_available() else 0
    if count == 0:
        raise DeviceUnavailable(f"--device {text}: this torch ({torch.__version__}) sees no "
                                "Intel GPU (xpu): serve with --device cpu")
    if device.index is not None and device.index >= count:
        raise DeviceUnavailable(f"--device {text}: this machine shows {counted(count, 'XPU')} "
                                f"({_indices('xpu', count)})")


def default_device() -> str:
    """cuda when torch sees a GPU, else cpu."""
    return "cuda" if torch.backends.cuda.is_built() and torch.cuda.device_count() else "cpu"


def describe_torch() -> str:
    """torch's build and the GPUs it sees, in a phrase."""
    if not torch.backends.cuda.is_built():
        return (f"{torch.__version__}, built without CUDA (a GPU server needs torch's CUDA "
                "build: docs/server.md, \"On a CUDA machine\")")
    runtime = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}"
    count = torch.cuda.device_count()
    if not count:
        return (f"{torch.__version__}, {runtime}, no GPU seen (nvidia-smi should list one; "
                "CUDA_VISIBLE_DEVICES may hide them)")
    return f"{torch.__version__}, {runtime}, {counted(count, 'GPU')} seen"


def describe_gpus() -> list[str]:
    """One phrase per GPU torch sees: its name, compute capability and memory (free, of its
    total: asking makes a CUDA context on each)."""
    if not torch.backends.cuda.is_built():
        return []
    lines = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        lines.append(f"cuda:{index} {props.name}, compute capability {props.major}.{props.minor}, "
                     f"{size_text(free)} of {size_text(total)} free")
    return lines


def size_text(n: float) -> str:
    """Bytes as a person reads them: "1.50 GiB", "512.0 MiB"."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def _indices(kind: str, count: int) -> str:
    return f"{kind}:0" if count == 1 else f"{kind}:0 to {kind}:{count - 1}"


def _dotted(capability: tuple[int, int]) -> str:
    return ".".join(str(part) for part in capability)
