"""The target's own greedy outputs, the yardstick of losslessness, and how far a received output
is from one.

    references = greedy_references("gemma3-270m", ["def add(a, b):"], max_tokens=32,
                                   server_args=["--dtype", "bfloat16"])
    difference = compare(references[0], received_ids)     # .lost, .duplicated, .differing

The target is loaded the way `sled serve --model TARGET ARGS` loads it: its settings come from
the same flags, --config file and SLED_SERVE_* variables (served_settings), and
verify_server.target.load_target loads it (the same alias resolution, SATs, tokenizer, dtype and torch
device), capped at the same context length. A prompt is encoded the way a device encodes a text
prompt (the tokenizer's default encoding, BOS included), and generation stops where a device's
output stops: at max_tokens or at the first EOS id, which is kept in the output.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from sled.chat_templates import turn_end_ids
from sled.models import resolve_model
from verify_server.flags import served_settings
from verify_server.settings import ServerSettings
from verify_server.target import load_target as load_served


def load_target(target: str, dtype: str = "float32", settings=None):
    """The verify server's Target for a `sled serve --model` value (SETTINGS: the server's own,
    from served_settings; else the defaults with DTYPE)."""
    settings = settings if settings is not None else ServerSettings(model=target, dtype=dtype)
    served = load_served(settings)
    served.cap_context(settings.context_length)
    return served


@dataclass(frozen=True)
class References:
    """The target's greedy outputs for a list of prompts, with the prompts as a device encodes
    them and the target's vocabulary size (what synthetic traces along the outputs need)."""
    prompt_ids: list[list[int]]
    outputs: list[list[int]]
    vocab_size: int


def target_references(target: str, prompts: list[str], max_tokens: int,
                      server_args: list[str] | None = None) -> References:
    """generate(do_sample=False) of the target as the server with SERVER_ARGS computes it (same
    dtype, torch device and context length) for every prompt (index = prompt index)."""
    settings = served_settings(target, server_args)
    served = load_target(target, settings=settings)
    prompt_ids = [served.tokenizer(prompt).input_ids for prompt in prompts]
    return References(prompt_ids, [greedy_ids(served, ids, max_tokens) for ids in prompt_ids],
                      served.vocab_size)


def greedy_references(target: str, prompts: list[str], max_tokens: int,
                      server_args: list[str] | None = None) -> list[list[int]]:
    """The outputs of target_references."""
    return target_references(target, prompts, max_tokens, server_args).outputs


def greedy_ids(served, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """One prompt's generated ids: EOS ends it (kept, as the device sends it), else max_tokens."""
    inputs = torch.tensor([prompt_ids], device=served.model.device)
    eos = list(served.eos_ids) or None
    room = max(0, served.context_length - len(prompt_ids))    # the served context ends a session
    with torch.no_grad():
        out = served.model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                    max_new_tokens=min(max_tokens, room), do_sample=False, eos_token_id=eos,
                                    pad_token_id=eos[0] if eos else 0)
    generated = out[0, len(prompt_ids):].tolist()
    ends = [i for i, token in enumerate(generated) if eos and token in eos]
    return generated[:ends[0] + 1] if ends else generated


def chat_reply(served, messages: list[dict], max_tokens: int) -> str:
    """The text a device's /v1/chat/completions answers greedily: generate() on the target's
    chat template (with the generation prompt), up to the end of its turn or its EOS."""
    prompt = chat_prompt(served, messages)
    new = greedy_ids(served, prompt, max_tokens)
    return decode_text(served.tokenizer, new[:turn_end(served, new)])


def chat_prompt(served, messages: list[dict]) -> list[int]:
    """The ids a device's chat completion sends for MESSAGES: the target's chat template with
    the generation prompt."""
    return served.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


def turn_end(served, new: list[int]) -> int | None:
    """Where the assistant's turn ends in generated ids NEW: the index of the first turn-end or
    EOS id, None when it runs to the length limit."""
    ends = set(turn_end_ids(served.tokenizer)) | set(served.eos_ids)
    return next((i for i, token in enumerate(new) if token in ends), None)


def decode_text(tokenizer, ids: list[int]) -> str:
    """Text of ids as a device's API sends it (special tokens skipped, spaces as they are)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def reference_texts(tokenizer, references: list[list[int]]) -> list[str]:
    return [decode_text(tokenizer, ids) for ids in references]


def target_tokenizer(target: str):
    """The served target's tokenizer alone (no weights): for decoding references."""
    return AutoTokenizer.from_pretrained(resolve_model(target))


@dataclass(frozen=True)
class Difference:
    """How a received output differs from the reference, in tokens."""
    lost: int = 0            # reference tokens that did not come
    duplicated: int = 0      # tokens that came that the reference does not have (extra)
    differing: int = 0       # tokens that came in place of a different reference token


def compare(reference: list[int], received: list[int], complete: bool = True) -> Difference:
    """Lost, duplicated and differing tokens from difflib's edit opcodes: "delete" is lost,
    "insert" duplicated, "replace" differing (its unequal lengths' surplus lost or duplicated).
    Not COMPLETE (cut short): the reference's tail past the last token that came is not lost."""
    lost = duplicated = differing = 0
    matcher = difflib.SequenceMatcher(a=reference, b=received, autojunk=False)
    opcodes = matcher.get_opcodes()
    if not complete and opcodes and opcodes[-1][0] in ("delete", "replace"):
        tag, i1, i2, j1, j2 = opcodes[-1]          # the reference's tail past what came: not lost
        opcodes[-1] = (tag, i1, min(i2, i1 + (j2 - j1)), j1, j2)
    for tag, i1, i2, j1, j2 in opcodes:
        same = min(i2 - i1, j2 - j1) if tag == "replace" else 0
        differing += same
        if tag in ("delete", "replace"):
            lost += i2 - i1 - same
        if tag in ("insert", "replace"):
            duplicated += j2 - j1 - same
    return Difference(lost, duplicated, differing)
