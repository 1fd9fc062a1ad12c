"""`sled doctor --server`: can this machine serve its target? torch's build and the GPUs it
sees, the device and dtype asked for, where the model comes from, free memory against the weights
and a KV cache, the compiled flex attention against eager flex (where the flex engine serves),
and one step of the target through the server's engine against transformers' own forward.

    $ sled doctor --server --model synthetic:gemma3-4b --dtype bfloat16
    torch: 2.13.0+cu128, CUDA 12.8, 1 GPU seen
    gpu: cuda:0 NVIDIA H200, compute capability 9.0, 139.7 of 140.4 GiB free
    device: cuda, bfloat16 (torch sees a GPU; --device chooses)
    model: synthetic:gemma3-4b
    memory: 139.70 GiB free on cuda; weights 7.23 GiB (3,880,099,328 parameters x 2 bytes, ...
    flex: compiled flex attention agrees with eager flex on cuda at head_dim 256, 8/4 heads, ...
    forward: one step of 7 tokens through the flex engine in ... s: next token ...

The settings are the server's (verify_server.settings: --config FILE, SLED_SERVE_* variables,
these flags), so the check sees what `sled serve` would. Exit 0 when every check passes, 1 when
one does not (its line says what to do), 2 for a bad flag. sled_cli.doctor imports this module
only for --server, once the server extra is there: torch loads with it.
"""
from __future__ import annotations

import sys

import torch

from sled.flags import one_line
from verify_server.accelerator import (DeviceUnavailable, check_device, default_device,
                                       describe_gpus, describe_torch)
from verify_server.preflight import (PreflightFailed, engine_kind, flex_check, footprint,
                                     memory_check, step_check)
from verify_server.settings import load_settings
from verify_server.target import load_target, locate_target

DEFAULT_MODEL = "gemma3-270m"      # the built-in target: the check needs nothing downloaded
SETTINGS_FLAGS = ("model", "device", "dtype", "engine")


def run_server(args) -> int:
    print(f"torch: {describe_torch()}", flush=True)
    for gpu in describe_gpus() or ["none seen"]:
        print(f"gpu: {gpu}", flush=True)
    try:
        settings, note = doctor_settings(args)
    except ValueError as exc:
        print(f"sled doctor: {one_line(exc)}", file=sys.stderr)
        return 2
    try:
        return _checks(settings, note)
    except PreflightFailed as exc:
        print(exc, flush=True)
        return 1
    except torch.OutOfMemoryError as exc:
        print(f"memory: out of memory on {settings.device} ({one_line(exc)}): a smaller "
              "--dtype, --kv-fraction, or a device with more memory", flush=True)
        return 1


def doctor_settings(args):
    """The server's settings as sled serve would read them (--config FILE, SLED_SERVE_*, these
    flags), with the built-in target and the device torch sees where none is set; and a note
    for the device line when the doctor chose the device."""
    flags = {name: getattr(args, name) for name in SETTINGS_FLAGS
             if getattr(args, name, None) is not None}
    settings = load_settings(args.config, flags)
    chosen = {"model": settings.model or DEFAULT_MODEL, "tp": 1}   # one rank's GPU is checked
    note = ""
    if "device" not in settings.model_fields_set:
        chosen["device"] = default_device()
        note = (" (torch sees a GPU" if chosen["device"] == "cuda" else " (no GPU seen") + \
            "; --device chooses)"
    return settings.model_copy(update=chosen), note


def _checks(settings, note: str) -> int:
    """device, model, memory, flex, forward: each one line; the first that fails ends them
    (PreflightFailed, its line starting with the check's name; "load" for loading the target)."""
    try:
        device = check_device(settings.device, settings.dtype)
    except DeviceUnavailable as exc:
        raise PreflightFailed(f"device: {exc}") from None
    except ValueError as exc:       # not a device at all: a bad flag
        print(f"sled doctor: {exc}", file=sys.stderr)
        return 2
    print(f"device: {device}, {settings.dtype}{note}", flush=True)
    located = _check("model", locate_target, settings.model)
    print(f"model: {settings.model}" + (f" ({located})" if located != settings.model else ""),
          flush=True)
    fit = _check("memory", footprint, located, settings.dtype, settings.trust_remote_code)
    memory = _check("memory", memory_check, fit, device, settings.kv_fraction,
                    settings.kv_block_tokens, settings.kv_budget)
    print(f"memory: {memory}", flush=True)
    target = _check("load", load_target, settings, located)
    kind = engine_kind(target, settings.engine)
    flex = (_check("flex", flex_check, target, settings.kv_block_tokens) if kind == "flex" else
            f"not used: the {kind} engine serves on {device.type} (--engine flex checks it)")
    print(f"flex: {flex}", flush=True)
    forward = _check("forward", step_check, target, kind, settings.kv_block_tokens)
    print(f"forward: {forward}", flush=True)
    return 0


def _check(name: str, check, *args):
    """CHECK(*ARGS); its one-line failure (ValueError, PreflightFailed) as NAME's line."""
    try:
        return check(*args)
    except (PreflightFailed, ValueError) as exc:
        raise PreflightFailed(f"{name}: {one_line(exc)}") from None

