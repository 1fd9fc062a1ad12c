"""The device's tokenizer: the `tokenizers` library and jinja2, no transformers.

DeviceTokenizer.load(folder) reads what transformers' save_pretrained writes (the files a
server's GetTokenizer sends, a cached copy, a local folder): tokenizer.json, and when present
tokenizer_config.json, chat_template.jinja and special_tokens_map.json. It gives the same ids,
text, vocabulary (so the same sled.wire.fingerprint) and chat prompts as transformers 5's tokenizer of
that folder, for the part of its interface sled uses.

How transformers 5 reads such a folder, and so how this does:
- tokenizer.json is the tokenizer: its normalizer, pre-tokenizer, model, decoder and
  post-processor. Whether BOS/EOS are added is the post-processor's business (Gemma's adds <bos>,
  SmolLM2's adds nothing): tokenizer_config's add_bos_token/add_eos_token are ignored when
  tokenizer.json is there. A tokenizer.json without a post-processor adds nothing.
- tokenizer_config.json names the special tokens (bos_token, eos_token, unk_token, sep_token,
  pad_token, cls_token, mask_token, any other `*_token` string, extra_special_tokens); one that
  tokenizer.json lacks is added as a special token. special_tokens_map.json is read only when the
  config has no added_tokens_decoder (transformers' legacy path).
- The chat template: chat_template.jinja, else tokenizer_config's "chat_template" (a string, or a
  list of named templates). chat_template.json is a processor's file: the tokenizer ignores it.
- decode never cleans up spaces of a BPE model (transformers refuses to: it corrupts the text).

A tokenizer whose files were checked against a fingerprint (a cached copy whose manifest records
it, or the server's files just checked) carries it in `fingerprint`, so nobody hashes its
vocabulary again (about a second and 70 MB for gemma3's 262k tokens): tokenizer_fingerprint()
reads it there, else computes it. Loading gives the parser's freed heap back to the system
(sled.memory): gemma3's tokenizer.json leaves about 260 MB of it otherwise.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from sled.wire.fingerprint import fingerprint_tokenizer
from sled.memory import release_freed_heap

NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")


class Encoding(dict):
    """What tok(text) gives: {"input_ids": [...]}, also as .input_ids."""

    @property
    def input_ids(self) -> list[int]:
        return self["input_ids"]


class DeviceTokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, config: dict[str, Any] | None = None,
                 special_tokens_map: dict[str, Any] | None = None,
                 chat_template: str | dict[str, str] | None = None) -> None:
        config = dict(config or {})
        self.backend = backend
        self.chat_template = chat_template
        # sled.wire.fingerprint of these very files when they were checked against it, else None
        self.fingerprint: str | None = None
        # sled.wire.fingerprint.files_fingerprint of the files it was loaded from, when a server's
        self.files_sha256: str | None = None
        self._named, self._extra = _special_tokens(config, special_tokens_map)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._clean_up_bpe = bool(config.get(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        _add_missing_tokens(backend, config.get("added_tokens_decoder") or {}, self._named, self._extra)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        if backend.post_processor is None:   # what transformers installs then: adds nothing
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                                   special_tokens=[])

    @classmethod
    def load(cls, folder: str | Path) -> "DeviceTokenizer":
        """The tokenizer saved in FOLDER (FileNotFoundError when it has no tokenizer.json)."""
        folder = Path(folder)
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        # tokenizer.json may carry truncation/padding; transformers' tok(text) applies neither
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(folder / "tokenizer_config.json") or {}
        template = config.get("chat_template")
        if isinstance(template, (list, tuple)):   # named templates: [{"name", "template"}, ...]
            template = {entry["name"]: entry["template"] for entry in template}
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        legacy_map = None if "added_tokens_decoder" in config else \
            _read_json(folder / "special_tokens_map.json")
        tokenizer = cls(backend, config, legacy_map, template)
        release_freed_heap()    # the parsed JSON's temporaries: hundreds of MB for a big vocabulary
        return tokenizer

    # -- text to ids -----------------------------------------------------------------------
    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(input_ids=self.encode(text, add_special_tokens=add_special_tokens))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    # -- ids to text -----------------------------------------------------------------------
    def decode(self, ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        if clean and (type(self.backend.model).__name__ != "BPE" or self._clean_up_bpe):
            text = _clean_up_spaces(text)
        return text

    # -- chat ------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        """The template to render: the one given (or named, when the tokenizer has several),
        else the tokenizer's own."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                name = "tool_use" if tools is not None and "tool_use" in own else "default"
                if name not in own:
                    raise ValueError(f"this tokenizer has several chat templates and no default: "
                                     f"name one of {sorted(own)}")
                return own[name]
        if chat_template is None:
            if own is None:
                raise ValueError("the tokenizer has no chat template and none was given")
            return own
        return chat_template

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt: bool = False, tokenize: bool = True, **extra):
        """The conversation through the chat template: its text (tokenize=False) or its ids,
        encoded without adding special tokens (the template writes them)."""
        from edge_client import chat_render   # jinja2: imported by the first chat prompt, not at start

        template = self.get_chat_template(chat_template, tools)
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        text = chat_render.render(template, conversation, add_generation_prompt, tools, documents,
                                  {**self.special_tokens_map, **extra})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -- vocabulary ------------------------------------------------------------------------
    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary, added tokens not counted."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self.backend.get_added_tokens_decoder()

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {token.content: i for i, token in sorted(self.added_tokens_decoder.items())}

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        if isinstance(tokens, str):
            found = self.backend.token_to_id(tokens)
            return found if found is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int]):
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(int(i)) for i in ids]

    # -- special tokens --------------------------------------------------------------------
    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens as strings: what a chat template sees as bos_token etc."""
        return dict(self._named)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self._named.values(), *self._extra]))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    def __getattr__(self, name: str):
        """bos_token, eos_token, ... (None when unset) and their ids: bos_token_id, ..."""
        base = name.removesuffix("_id")
        if base in NAMED_SPECIAL or base in self.__dict__.get("_named", {}):
            token = self.__dict__["_named"].get(base)
            if name == base or token is None:
                return token
            return self.convert_tokens_to_ids(token)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


def tokenizer_fingerprint(tokenizer) -> str:
    """sled.wire.fingerprint of TOKENIZER: the one its files were checked against when it carries it
    (a DeviceTokenizer from a checked copy), else hashed from its vocabulary, and the hash's freed
    heap given back."""
    known = tokenizer.fingerprint if isinstance(tokenizer, DeviceTokenizer) else None
    if known:
        return known
    fingerprint = fingerprint_tokenizer(tokenizer)
    release_freed_heap()
    return fingerprint


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else None


def _content(value) -> str | None:
    """A special token as written in a config: a string, or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens(config: dict, legacy_map: dict | None) -> tuple[dict[str, str], list[str]]:
    """(named special tokens in transformers' order: the seven standard names, then the model's
    own `*_token` names; the extra special tokens)."""
    named = {key: _content(config[key]) for key in NAMED_SPECIAL if _content(config.get(key))}
    own = {key: value for key, value in config.items()
           if key.endswith("_token") and key not in NAMED_SPECIAL and isinstance(value, str)}
    extra_field = config.get("extra_special_tokens", config.get("additional_special_tokens"))
    if isinstance(extra_field, dict):
        own.update({key: _content(value) for key, value in extra_field.items() if _content(value)})
    extras = [_content(t) for t in extra_field or () if _content(t)] \
        if isinstance(extra_field, (list, tuple)) else []
    for key, value in (legacy_map or {}).items():
        if key in NAMED_SPECIAL and _content(value):
            named[key] = _content(value)
        elif key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, list):
            extras += [t for t in map(_content, value) if t and t not in extras]
        elif key.endswith("_token") and _content(value):
            own[key] = _content(value)
    ordered = {key: named[key] for key in NAMED_SPECIAL if key in named}
    return {**ordered, **own}, extras


def _add_missing_tokens(backend: tokenizers.Tokenizer, saved: dict, named: dict[str, str],
                        extras: list[str]) -> None:
    """Add what transformers adds on loading: the config's added_tokens_decoder, and the special
    tokens tokenizer.json does not have yet (as special tokens), in one call."""
    tokens = [AddedToken(**{k: v for k, v in entry.items() if k != "__type"})
              for _, entry in sorted(saved.items(), key=lambda item: int(item[0]))]
    for token in tokens:
        if not token.special and token.content in named.values():
            token.special = True
    have = {token.content for token in backend.get_added_tokens_decoder().values()}
    have.update(token.content for token in tokens)
    for content in [*named.values(), *extras]:
        if content not in have:
            tokens.append(AddedToken(content, special=True))
            have.add(content)
    if tokens:
        backend.add_tokens(tokens)
    _make_special(backend, [*named.values(), *extras])


def _make_special(backend: tokenizers.Tokenizer, contents: list[str]) -> None:
    """A named or extra special token that tokenizer.json marks special=false is special all
    the same (transformers re-adds it as one): skip_special_tokens drops it."""
    plain = {token.content: token for token in backend.get_added_tokens_decoder().values()
             if not token.special and token.content in contents}
    if plain:
        backend.add_special_tokens([
            AddedToken(token.content, special=True, lstrip=token.lstrip, rstrip=token.rstrip,
                       normalized=token.normalized, single_word=token.single_word)
            for token in plain.values()])


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English clitics."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                           (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                           (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text
