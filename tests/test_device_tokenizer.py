"""The device's tokenizer (edge_client.tokenizer.DeviceTokenizer: the tokenizers library and
jinja2, no transformers) gives what transformers' tokenizer of the same files gives: ids with and
without special tokens, text with and without them, the chat prompt as text and as ids, the
vocabulary (so the fingerprint a device and a server compare), the special ids, the token that
ends a chat turn. Checked on the tiny test tokenizer and on the built-in models (slow): their
converted checkpoints and the files a server's GetTokenizer sends.
"""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from edge_client.bootstrap import load_tokenizer
from edge_client.openai_api import ApiError, Message, chat_prompt
from edge_client.settings import SettingsError
from edge_client.tokenizer import DeviceTokenizer, tokenizer_fingerprint
from sled.chat_templates import GEMMA3, turn_end_ids, with_chat_template
from sled.wire.fingerprint import fingerprint_tokenizer
from conftest import count_fingerprints

TEXTS = [
    "", " ", "  ", "\n", "\n\n\n", "\t", "hello world", "Hello, World!", " leading space",
    "trailing space ", "two  spaces   three", "line one\nline two\r\nline three",
    "ünïcødé: café, naïve, Straße", "日本語のテキスト", "한국어", "Ελληνικά", "emoji 🙂👍🏽🇫🇷",
    "def add(a, b):\n    return a + b  # sum\n", "for (int i = 0; i < n; ++i) { x[i] = 0; }",
    "<start_of_turn>user\nhi<end_of_turn>\n", "<|im_start|>assistant\nok<|im_end|>",
    "<bos>text<eos>", "<s> and </s>", "<pad><unk>", "almost <start_of_turn special",
    "\u2581already\u2581marked", "\x00\x01 control", "a" * 300, "1234567890 3.14159 -42",
    "https://example.org/path?q=1&r=2", "😀" * 20, "\ufffd replacement", "mixed\u200bzero width",
]
GEMMA_CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "  Tell me a joke.  \n"}],
    [{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "two"}]}],
    [{"role": "system", "content": [{"type": "text", "text": "sys as parts"}]},
     {"role": "user", "content": "ünïcødé <start_of_turn> inside"}],
    [{"role": "user", "content": "x", "name": None}],
]
CHATML_CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "def f():\n    pass"}],
    [{"role": "user", "content": "<|im_end|> inside ünïcødé"}],
]
# A template that refuses what it is given, as Gemma's refuses roles that do not alternate.
REFUSING = "{{ raise_exception('roles must alternate') if messages|length > 1 }}{{ messages[0]['content'] }}"


def same_encoding(device, reference, text: str) -> None:
    for special in (True, False):
        got = device(text, add_special_tokens=special).input_ids
        assert got == reference(text, add_special_tokens=special).input_ids, (text, special)
        assert device.encode(text, add_special_tokens=special) == got


def same_decoding(device, reference, ids: list[int]) -> None:
    for skip in (True, False):
        got = device.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert got == reference.decode(ids, skip_special_tokens=skip,
                                       clean_up_tokenization_spaces=False), (ids, skip)
        assert device.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip)


def same_chat(device, reference, conversation, template=None) -> None:
    for prompt in (True, False):
        text = device.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                          add_generation_prompt=prompt)
        assert text == reference.apply_chat_template(conversation, chat_template=template,
                                                     tokenize=False, add_generation_prompt=prompt)
        ids = device.apply_chat_template(conversation, chat_template=template,
                                         add_generation_prompt=prompt)
        want = reference.apply_chat_template(conversation, chat_template=template,
                                             add_generation_prompt=prompt)["input_ids"]
        assert ids == want, (conversation, prompt)
        assert ids == reference(text, add_special_tokens=False).input_ids


def same_tables(device, reference) -> None:
    assert fingerprint_tokenizer(device) == fingerprint_tokenizer(reference)
    assert device.get_vocab() == reference.get_vocab() and len(device) == len(reference)
    assert device.all_special_ids == reference.all_special_ids
    assert {i: str(t) for i, t in device.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in reference.added_tokens_decoder.items()}
    assert (device.bos_token, device.eos_token) == (reference.bos_token, reference.eos_token)
    assert device.eos_token_id == reference.eos_token_id


def saved(tokenizer, folder: Path) -> Path:
    tokenizer.save_pretrained(folder)
    return folder


# -- the tiny test tokenizer -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tokenizer, tmp_path_factory):
    """(DeviceTokenizer, transformers tokenizer) of the tiny tokenizer's saved files."""
    folder = saved(tokenizer, tmp_path_factory.mktemp("tiny-tokenizer"))
    return DeviceTokenizer.load(folder), AutoTokenizer.from_pretrained(folder)


def test_tiny_tokenizer_encodes_decodes_and_fingerprints_as_transformers(tiny):
    device, reference = tiny
    same_tables(device, reference)
    for text in TEXTS:
        same_encoding(device, reference, text)
        same_decoding(device, reference, reference(text).input_ids + [reference.eos_token_id])


def test_the_device_tokenizer_imports_without_torch_and_transformers():
    blocker = ("import sys, importlib.abc\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path, target=None):\n"
               "        if name.split('.')[0] in ('torch', 'transformers'):\n"
               "            raise ImportError('blocked ' + name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "import edge_client.tokenizer, edge_client.connection\n"
               "print('imported')\n")
    run = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True,
                         cwd=Path(__file__).parent.parent, timeout=120)
    assert run.returncode == 0 and "imported" in run.stdout, run.stderr[-2000:]


def test_a_template_that_raises_is_a_400_from_the_api(tiny):
    device, reference = tiny
    conversation = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    for tokenizer in (device, reference):
        with pytest.raises(Exception, match="roles must alternate"):
            tokenizer.apply_chat_template(conversation, chat_template=REFUSING)
    assert device.apply_chat_template(conversation[:1], chat_template=REFUSING, tokenize=False) == "a"
    stand_in = types.SimpleNamespace(tokenizer=device, reason="", state="ready", model_id="tiny")
    with pytest.raises(ApiError) as raised:
        chat_prompt(stand_in, [Message(**m) for m in conversation], REFUSING)
    assert raised.value.status == 400 and "roles must alternate" in str(raised.value.message)


def test_templates_see_what_transformers_gives_them(tiny):
    """Special tokens as strings, extra variables, tools, the sandbox's names and filters."""
    device, reference = tiny
    template = ("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ greeting }}|"
                "{{ messages | tojson }}|{{ tools | tojson(indent=1) }}|{{ documents }}|"
                "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 5 %}"
                "{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|"
                "{{ dict(a=1) }}|{{ strftime_now('%Y') | length }}|"
                "{% generation %}{{ add_generation_prompt }}{% endgeneration %}\n  {% if true %}\n"
                "  x\n  {% endif %}")
    conversation = [{"role": "user", "content": "é <s>", "reasoning": "because", "extra": None}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "<b>&"}}}]
    for prompt in (True, False):
        got = device.apply_chat_template(conversation, chat_template=template, tools=tools,
                                         tokenize=False, add_generation_prompt=prompt, greeting="hi")
        assert got == reference.apply_chat_template(conversation, chat_template=template, tools=tools,
                                                    tokenize=False, add_generation_prompt=prompt,
                                                    greeting="hi")
        assert "<s>|</s>|<pad>|hi|" in got and '"reasoning_content": "because"' in got
    escape = "{% set ns = namespace() %}{% set ns._x = 1 %}"
    for tokenizer in (device, reference):
        with pytest.raises(Exception):
            tokenizer.apply_chat_template(conversation, chat_template=escape)


@pytest.mark.parametrize("config_change", [
    {"additional_special_tokens": ["<tool>", "<s>"]},              # one new, one known
    {"extra_special_tokens": {"image_token": "<image>"}},          # named by the model
    {"image_token": "<img>", "mask_token": "<mask>"},              # new named tokens
    {"add_bos_token": True, "add_eos_token": True},                # tokenizer.json decides
    {"chat_template": [{"name": "default", "template": "D{{ messages[0]['content'] }}"},
                       {"name": "tool_use", "template": "T{{ messages[0]['content'] }}"}]},
    {"split_special_tokens": True},
    {"clean_up_tokenization_spaces": True},
    {"tokenizer.json": {                                           # tok(text) applies neither
        "truncation": {"direction": "Right", "max_length": 4, "strategy": "LongestFirst",
                       "stride": 0},
        "padding": {"strategy": {"Fixed": 12}, "direction": "Right", "pad_to_multiple_of": None,
                    "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"}}},
])
def test_tokenizer_config_entries_mean_what_they_mean_to_transformers(tokenizer, tmp_path, config_change):
    folder = saved(tokenizer, tmp_path / "tok")
    config_change = dict(config_change)
    backend_change = config_change.pop("tokenizer.json", {})
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **config_change}))
    backend = json.loads((folder / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps({**backend, **backend_change}))
    device, reference = DeviceTokenizer.load(folder), AutoTokenizer.from_pretrained(folder)
    same_tables(device, reference)
    assert device.special_tokens_map == reference.special_tokens_map
    for text in ("<s> a <tool>, b <image> . c's", "<img><mask> it 's ok !"):
        same_encoding(device, reference, text)
        same_decoding(device, reference, reference(text).input_ids)
    if "chat_template" in config_change:
        chat = [{"role": "user", "content": "q"}]
        assert device.apply_chat_template(chat, tokenize=False) == "Dq"
        assert device.apply_chat_template(chat, tokenize=False, tools=[{}]) == "Tq" == \
            reference.apply_chat_template(chat, tokenize=False, tools=[{}])


def test_legacy_special_tokens_map_and_missing_post_processor(tokenizer, tmp_path):
    folder = saved(tokenizer, tmp_path / "tok")
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "unk_token": {"content": "<unk>", "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False}, "additional_special_tokens": ["<legacy>"]}))
    data = json.loads((folder / "tokenizer.json").read_text())
    data["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data))
    device, reference = DeviceTokenizer.load(folder), AutoTokenizer.from_pretrained(folder)
    same_tables(device, reference)
    assert device.unk_token == "<unk>" and "<legacy>" in device.get_vocab()
    same_encoding(device, reference, "x <legacy> <unk> y")


def test_a_tokenizer_folder_without_tokenizer_json_is_one_line(tokenizer, tmp_path):
    folder = saved(tokenizer, tmp_path / "tok")
    assert fingerprint_tokenizer(load_tokenizer(str(folder))) == fingerprint_tokenizer(tokenizer)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(SettingsError, match="has no tokenizer.json") as raised:
        load_tokenizer(str(folder))
    assert "\n" not in str(raised.value)
    with pytest.raises(SettingsError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nowhere"))
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(SettingsError, match="cannot load the tokenizer"):
        load_tokenizer(str(folder))


# -- the built-in models (real tokenizers: slow) -----------------------------------------------

def _builtin(alias: str, source: str, tmp_path_factory):
    """(device tokenizer, reference) for ALIAS: from its converted checkpoint (both given the
    alias's template as sled does), or from what its server's GetTokenizer sends (the reference
    is then the server's own tokenizer)."""
    from sled.models import hf_checkpoint
    from verify_server.target import serialize_tokenizer

    checkpoint = hf_checkpoint(alias)
    reference = with_chat_template(AutoTokenizer.from_pretrained(checkpoint), str(checkpoint))
    if source == "checkpoint":
        return with_chat_template(DeviceTokenizer.load(checkpoint), str(checkpoint)), reference
    folder = tmp_path_factory.mktemp(f"served-{alias}")
    for name, content in serialize_tokenizer(reference).items():
        (folder / name).write_bytes(content)
    return DeviceTokenizer.load(folder), reference


_LOADED: dict = {}


@pytest.fixture(params=[("gemma3-270m", "checkpoint"), ("gemma3-270m", "served"),
                        ("smollm2-135m", "checkpoint"), ("smollm2-135m", "served")],
                ids=lambda p: "-".join(p))
def builtin(request, tmp_path_factory):
    if request.param not in _LOADED:
        _LOADED[request.param] = _builtin(*request.param, tmp_path_factory)
    return request.param[0], *_LOADED[request.param]


@pytest.mark.slow
def test_builtin_vocabulary_fingerprint_and_special_ids(builtin):
    alias, device, reference = builtin
    same_tables(device, reference)
    assert device.chat_template == reference.chat_template and device.chat_template
    if alias == "gemma3-270m":
        assert device.chat_template == GEMMA3


@pytest.mark.slow
def test_builtin_encode_and_decode(builtin):
    _, device, reference = builtin
    for text in TEXTS:
        same_encoding(device, reference, text)
        ids = reference(text).input_ids
        same_decoding(device, reference, ids + [reference.eos_token_id])
    specials = reference.all_special_ids + sorted(reference.added_tokens_decoder)[:40]
    same_decoding(device, reference, specials + reference("mixed", add_special_tokens=False).input_ids)


@pytest.mark.slow
def test_builtin_random_text_and_ids(builtin):
    _, device, reference = builtin
    pieces = st.sampled_from(["<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>",
                              "<bos>", "<eos>", " ", "  ", "\n", "\u2581", "é", "🙂"])
    texts = st.lists(st.one_of(st.text(max_size=20), pieces), max_size=8).map("".join)
    vocab = len(reference)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(text=texts, ids=st.lists(st.integers(0, vocab - 1), max_size=12))
    def check(text, ids):
        same_encoding(device, reference, text)
        same_decoding(device, reference, ids)

    check()


@pytest.mark.slow
def test_builtin_chat_prompts(builtin):
    alias, device, reference = builtin
    for conversation in GEMMA_CHATS if alias == "gemma3-270m" else CHATML_CHATS:
        same_chat(device, reference, conversation)
    same_chat(device, reference, CHATML_CHATS[0], template=GEMMA3)   # a template passed in
    assert turn_end_ids(device) == turn_end_ids(reference) != []
    # <end_of_turn> is a special token of Gemma's only: SmolLM2 reads it as text
    assert turn_end_ids(device, GEMMA3) == turn_end_ids(reference, GEMMA3)
    assert (turn_end_ids(device, GEMMA3) != []) == (alias == "gemma3-270m")
    alternating = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    for tokenizer in (device, reference):
        with pytest.raises(Exception, match="alternate"):
            tokenizer.apply_chat_template(alternating, chat_template=GEMMA3)


@pytest.mark.slow
def test_a_named_special_token_marked_plain_in_tokenizer_json_is_special(tmp_path):
    """SmolLM2's <|im_end|> (its eos) written special=false in tokenizer.json: transformers makes
    it special again, so decode(skip_special_tokens=True) drops it; the device does the same."""
    from sled.models import hf_checkpoint

    checkpoint = hf_checkpoint("smollm2-135m")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (checkpoint / name).is_file():
            (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    backend = json.loads((tmp_path / "tokenizer.json").read_text())
    for token in backend["added_tokens"]:
        if token["content"] == "<|im_end|>":
            token["special"] = False
            end = token["id"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(backend))
    device, reference = DeviceTokenizer.load(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    ids = reference("hi").input_ids + [end]
    assert device.decode(ids, skip_special_tokens=True) == \
        reference.decode(ids, skip_special_tokens=True) == "hi"
    assert device.added_tokens_decoder[end].special and device.all_special_ids == reference.all_special_ids
    same_encoding(device, reference, "hi<|im_end|> there <|im_start|>")


# -- the fingerprint a checked tokenizer carries -----------------------------------------------

@pytest.fixture
def hashes(monkeypatch):
    """Counts the vocabulary hashes made through edge_client.tokenizer.tokenizer_fingerprint."""
    import edge_client.tokenizer as device_tokenizer

    return count_fingerprints(monkeypatch, device_tokenizer)


def test_a_loaded_folder_carries_no_fingerprint_and_is_hashed(tiny, hashes, tmp_path):
    _, reference = tiny
    loaded = DeviceTokenizer.load(saved(reference, tmp_path))
    assert loaded.fingerprint is None
    assert tokenizer_fingerprint(loaded) == fingerprint_tokenizer(reference) and len(hashes) == 1
    assert tokenizer_fingerprint(reference) == fingerprint_tokenizer(reference)   # any tokenizer


def test_a_checked_copy_carries_its_fingerprint_and_is_not_hashed_again(tokenizer, hashes,
                                                                         tmp_path, monkeypatch):
    from edge_client.connection import cached_tokenizer, save_tokenizer
    from sled.cache import tokenizer_dir, write_manifest

    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    fingerprint = fingerprint_tokenizer(tokenizer)
    files = {path.name: path.read_bytes() for path in saved(tokenizer, tmp_path / "files").iterdir()}
    fetched = save_tokenizer(fingerprint, files, "server:1")      # checked against the server's
    cached = cached_tokenizer(fingerprint, fetched.files_sha256)  # its manifest records it
    assert fetched.fingerprint == cached.fingerprint == fingerprint
    assert tokenizer_fingerprint(fetched) == tokenizer_fingerprint(cached) == fingerprint
    assert hashes == []
    write_manifest(tokenizer_dir(fingerprint, fetched.files_sha256))   # a manifest recording none
    unrecorded = cached_tokenizer(fingerprint, fetched.files_sha256)   # hashed, then carried
    assert unrecorded.fingerprint == fingerprint and tokenizer_fingerprint(unrecorded) == fingerprint
    assert hashes == []


def test_the_device_compares_the_carried_fingerprint_with_its_drafter(tokenizer, tmp_path,
                                                                       monkeypatch, hashes):
    """A carried fingerprint stands for the tokenizer in the device's check: a drafter of
    another vocabulary is refused just as when the tokenizer is hashed."""
    from edge_client.daemon import Device
    from edge_client.settings import DeviceSettings

    device_tok = DeviceTokenizer.load(saved(tokenizer, tmp_path / "tok"))
    device_tok.fingerprint = fingerprint_tokenizer(tokenizer)
    device = Device(DeviceSettings(id="carried", servers=["127.0.0.1:1"], drafter="ngram"),
                    tokenizer=device_tok)
    device.drafter = types.SimpleNamespace(tokenizer_fingerprint=None)
    device.bootstrap.set_fingerprint(device.settings)
    assert device.directory.fingerprint == device_tok.fingerprint and hashes == []
    device.drafter = types.SimpleNamespace(tokenizer_fingerprint="sha256:" + "0" * 64)
    with pytest.raises(SettingsError, match="does not match the drafter"):
        device.bootstrap.set_fingerprint(device.settings)
    assert hashes == []


def test_loading_and_hashing_give_the_freed_heap_back(tiny, tmp_path, monkeypatch):
    import edge_client.tokenizer as device_tokenizer

    calls = []
    monkeypatch.setattr(device_tokenizer, "release_freed_heap", lambda: calls.append(1))
    loaded = DeviceTokenizer.load(saved(tiny[1], tmp_path))
    assert calls == [1]
    tokenizer_fingerprint(loaded)
    assert calls == [1, 1]
