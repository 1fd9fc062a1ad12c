"""The target's own greedy outputs, the yardstick of losslessness, and how far a received output
is from one.

    references = greedy_references("gemma3-270m", ["def add(a, b):"], max_tokens=32)
    lost, duplicated = compare(references[0], received_ids)

The target is loaded the way `sled serve --model TARGET` loads it (sled_cli.serve.load_target:
the same alias resolution, SATs and tokenizer), a prompt is encoded the way a device encodes a
text prompt (the tokenizer's default encoding, BOS included), and generation stops where a
device's output stops: at max_tokens or at the first EOS id, which is kept in the output.
"""
from __future__ import annotations

import difflib


def load_target(target: str, dtype: str = "float32"):
    """The verify server's Target for a `sled serve --model` value."""
    from sled_cli.serve import load_target as load_served
    from verify_server.settings import ServerSettings

    return load_served(ServerSettings(model=target, dtype=dtype))


def greedy_references(target: str, prompts: list[str], max_tokens: int,
                      dtype: str = "float32") -> list[list[int]]:
    """generate(do_sample=False) of the served target for every prompt (index = prompt index)."""
    served = load_target(target, dtype)
    return [greedy_ids(served, served.tokenizer(prompt).input_ids, max_tokens) for prompt in prompts]


def greedy_ids(served, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """One prompt's generated ids: EOS ends it (kept, as the device sends it), else max_tokens."""
    import torch

    inputs = torch.tensor([prompt_ids], device=served.model.device)
    eos = list(served.eos_ids) or None
    with torch.no_grad():
        out = served.model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                    max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                                    pad_token_id=eos[0] if eos else 0)
    generated = out[0, len(prompt_ids):].tolist()
    ends = [i for i, token in enumerate(generated) if eos and token in eos]
    return generated[:ends[0] + 1] if ends else generated


def served_dtype(server_args: list[str] | None) -> str:
    """The --dtype a scenario's extra `sled serve` flags choose (float32 without one), so the
    references come from the weights the server computes with."""
    args = list(server_args or [])
    for i, arg in enumerate(args):
        if arg == "--dtype" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--dtype="):
            return arg.split("=", 1)[1]
    return "float32"


def decode_text(tokenizer, ids: list[int]) -> str:
    """Text of ids as a device's API sends it (special tokens skipped, spaces as they are)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def reference_texts(tokenizer, references: list[list[int]]) -> list[str]:
    return [decode_text(tokenizer, ids) for ids in references]


def target_tokenizer(target: str):
    """The served target's tokenizer alone (no weights): for decoding references."""
    from transformers import AutoTokenizer

    from sled.models import resolve_model
    return AutoTokenizer.from_pretrained(resolve_model(target))


def compare(reference: list[int], received: list[int]) -> tuple[int, int]:
    """(lost, duplicated): reference tokens missing from what was received, and received tokens
    the reference does not have, from difflib's edit opcodes ("replace" counts both sides)."""
    lost = duplicated = 0
    matcher = difflib.SequenceMatcher(a=reference, b=received, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag in ("delete", "replace"):
            lost += i2 - i1
        if tag in ("insert", "replace"):
            duplicated += j2 - j1
    return lost, duplicated
