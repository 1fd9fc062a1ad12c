"""Text in and out of a tokenizer, one small interface over every runtime's own tokenizer: what
the cross-tokenizer drafter (drafters.cross_tokenizer) needs to move a context and a draft
between the target's ids and a drafter's ids.

    codec.encode("def f(x):")      # ids, no special tokens added
    codec.decode(ids)              # text, special tokens left out
    codec.bos                      # the ids a context starts with ([] when the model adds none)
    codec.ends(token)              # whether the token ends a generation (EOS, end of turn)

codec_of(drafter) picks the codec of a model drafter's own tokenizer: llama.cpp's for gguf:,
onnxruntime-genai's for onnx:, transformers' for hf: (that drafter imports it anyway). The
target's tokenizer (edge_client.tokenizer.DeviceTokenizer, or transformers' on the server side of
a test) is TargetText.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

REPLACEMENT = "\ufffd"   # what a decoder writes for the bytes of a character cut in two


class TextCodec(Protocol):
    bos: list[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def ends(self, token: int) -> bool: ...


def text_after(decode, head: Sequence[int], new: Sequence[int]) -> str | None:
    """The text `new` adds after `head`: decode(head + new) past decode(head). Decoding with the
    ids before it keeps what a decoder does at the start of a text (strip a leading space, ...)
    out of the middle of one; None when the longer text does not start with the shorter one.
    text_after(decode, [" def", " f"], ["(x", "):"]) == "(x):" for a byte-level BPE."""
    before = decode(list(head))
    whole = decode(list(head) + list(new))
    return whole[len(before):] if whole.startswith(before) else None


class TargetText:
    """The target's tokenizer (anything with encode(text, add_special_tokens) and decode(ids,
    skip_special_tokens)): its ids and text, special tokens spelled out (so `<bos>` or a chat
    marker encodes back to itself) or, for a drafter's context, left out."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """The text with special tokens spelled out: encode(decode(ids)) gives them back."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def plain_text(self, ids: Sequence[int]) -> str:
        """The text without special tokens: what another model's tokenizer is given."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class LlamaCodec:
    """llama.cpp's tokenizer of a GGUF file (llama_cpp.Llama)."""

    def __init__(self, llm) -> None:
        import llama_cpp   # the gguf extra: a device may have the onnx runtime only

        self.llm = llm
        self.bos = llm.tokenize(b"", add_bos=True, special=False)   # [] when the model adds none
        self._vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self._is_eog = llama_cpp.llama_vocab_is_eog

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.llm.detokenize(list(ids)).decode("utf-8", errors="replace")

    def ends(self, token: int) -> bool:
        return bool(self._is_eog(self._vocab, token))


class HFCodec:
    """transformers' tokenizer of an hf: drafter's checkpoint."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.bos = [t for t in tokenizer("").input_ids if t != tokenizer.eos_token_id]
        self._specials = set(tokenizer.all_special_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def ends(self, token: int) -> bool:
        return token in self._specials


class OnnxCodec:
    """onnxruntime-genai's tokenizer of an export folder; its EOS ids from genai_config.json."""

    def __init__(self, model, folder: Path) -> None:
        import onnxruntime_genai as og   # the onnx extra: a device may have llama.cpp only

        self.tokenizer = og.Tokenizer(model)
        self.bos = [int(t) for t in self.tokenizer.encode("")]   # what it adds to any text
        config = json.loads((Path(folder) / "genai_config.json").read_text())
        eos = config["model"].get("eos_token_id", [])
        self._eos = set(eos if isinstance(eos, list) else [eos])

    def encode(self, text: str) -> list[int]:
        ids = [int(t) for t in self.tokenizer.encode(text)]
        return ids[len(self.bos):] if ids[:len(self.bos)] == self.bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def ends(self, token: int) -> bool:
        return token in self._eos


def codec_of(drafter) -> TextCodec:
    """The codec of a model drafter's own tokenizer; ValueError for a drafter with none."""
    kind, _, where = drafter.name.partition(":")
    if kind == "gguf":
        return LlamaCodec(drafter.llm)
    if kind == "onnx":
        return OnnxCodec(drafter.model, drafter.path)
    if kind == "hf":
        from transformers import AutoTokenizer   # only with an hf: drafter: the device has none
        return HFCodec(AutoTokenizer.from_pretrained(where))
    raise ValueError(f"{drafter.name} has no tokenizer of its own to re-tokenize with")
