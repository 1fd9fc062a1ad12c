"""Chat with the built-in models, as the README shows it: `sled serve --model gemma3-270m`, a
`sled device` in front of it, and the official openai client's chat.completions. Each built-in
alias carries its family's chat template (also when its checkpoint was converted before
templates were carried), the template leaves the tokenizer's fingerprint as it was, and a greedy
chat reply is the target's own generate() on the templated prompt, up to the turn's end."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from conftest import SLED, cached_reference
from lab.oracle import chat_prompt, turn_end
from lab.server_process import free_port
from sled.chat_templates import GEMMA3, builtin_chat_template, turn_end_ids, with_chat_template
from sled.wire.fingerprint import fingerprint_tokenizer
from sled.models import BUILTIN, hf_checkpoint
from verify_server.target import load_target
from test_device_cli import wait_health
from verify_server.server import start_server
from verify_server.settings import ServerSettings
from verify_server.target import Target, serialize_tokenizer

TARGET = "gemma3-270m"
MAX_TOKENS = 16
CONVERSATION = [{"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "Name a colour."}]
# Each family's documented turn format, for CONVERSATION with add_generation_prompt=True.
RENDERED = {
    "gemma3-270m": ("<bos><start_of_turn>user\nHi there<end_of_turn>\n"
                    "<start_of_turn>model\nHello! How can I help?<end_of_turn>\n"
                    "<start_of_turn>user\nName a colour.<end_of_turn>\n"
                    "<start_of_turn>model\n"),
    "smollm2-135m": ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                     "Hugging Face<|im_end|>\n"
                     "<|im_start|>user\nHi there<|im_end|>\n"
                     "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
                     "<|im_start|>user\nName a colour.<|im_end|>\n"
                     "<|im_start|>assistant\n"),
}
BOS = {"gemma3-270m": "<bos>", "smollm2-135m": "<|im_start|>"}
TURN_END = {"gemma3-270m": "<end_of_turn>", "smollm2-135m": "<|im_end|>"}


def test_every_builtin_alias_has_a_template_in_its_family_turn_format():
    assert set(RENDERED) == set(BUILTIN)
    for alias, want in RENDERED.items():
        template = builtin_chat_template(alias)
        rendered, _ = render_jinja_template([CONVERSATION], chat_template=template,
                                            add_generation_prompt=True, bos_token=BOS[alias])
        assert rendered[0] == want, alias
    assert builtin_chat_template("no-such-model") is None


@pytest.mark.slow
@pytest.mark.parametrize("alias", sorted(BUILTIN))
def test_the_tokenizer_of_a_copy_converted_without_a_template_gets_it(alias, tmp_path, monkeypatch):
    """A converted copy from before templates were carried (its tokenizer files without one)
    gets its alias's template when loaded, with the fingerprint unchanged, and the files the
    server sends a device (GetTokenizer) carry it."""
    old = tmp_path / "hf" / alias
    old.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_checkpoint(alias) / name, old / name)
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    plain, tokenizer = (AutoTokenizer.from_pretrained(str(old)) for _ in range(2))
    plain.chat_template = tokenizer.chat_template = None   # as a conversion before templates
    tokenizer = with_chat_template(tokenizer, str(old))

    assert tokenizer.chat_template == builtin_chat_template(alias)
    assert fingerprint_tokenizer(tokenizer) == fingerprint_tokenizer(plain)
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) \
        == RENDERED[alias]
    assert turn_end_ids(tokenizer) == [tokenizer.convert_tokens_to_ids(TURN_END[alias])]
    with tempfile.TemporaryDirectory() as device_dir:   # what a device loads from GetTokenizer
        for name, content in serialize_tokenizer(tokenizer).items():
            (Path(device_dir) / name).write_bytes(content)
        on_device = AutoTokenizer.from_pretrained(device_dir)
    assert on_device.chat_template == tokenizer.chat_template
    assert fingerprint_tokenizer(on_device) == fingerprint_tokenizer(plain)


# -- the README's example, end to end ------------------------------------------------------------
def reference_reply(target: Target, messages: list[dict]) -> tuple[str, str, dict]:
    """(text, finish reason, usage) of the target's generate(do_sample=False) on the templated
    prompt, up to the end of its turn (or its EOS), which counts as a completion token."""
    tokenizer = target.tokenizer
    prompt = chat_prompt(target, messages)
    assert prompt[0] == tokenizer.bos_token_id and prompt[1] != tokenizer.bos_token_id  # one BOS
    new = cached_reference(target.model, prompt, MAX_TOKENS)
    cut = turn_end(target, new)
    finish = "length" if cut is None else "stop"
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(new) if cut is None else cut + 1}
    return tokenizer.decode(new[:cut], skip_special_tokens=True), finish, usage


@pytest.fixture(scope="module")
async def readme_setup(tmp_path_factory):
    """(device API port, target): the target as `sled serve --model gemma3-270m` loads and serves
    it, and a `sled device` in front of it (with a cache of its own, so it fetches the target's
    tokenizer from the server), started while the target loads."""
    torch.set_num_threads(2)
    port, server_port = free_port(), free_port()
    device = subprocess.Popen([*SLED, "device", "--servers", f'["127.0.0.1:{server_port}"]',
                               "--drafter", "ngram", "--port", str(port), "--id", "chat-test"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "SLED_CACHE": str(tmp_path_factory.mktemp("cache"))})
    server = None
    try:
        target = await asyncio.to_thread(load_target, ServerSettings(model=TARGET))
        server = await start_server(target, ServerSettings(model=TARGET, kv_budget="512MiB"),
                                    port=server_port)
        await wait_health(port, timeout=180)
        yield port, target
    finally:
        device.terminate()
        device.wait(10)
        if server is not None:
            await server.stop(grace=0)


@pytest.mark.slow
async def test_readme_chat_example_is_the_target_greedy_reply(readme_setup):
    port, target = readme_setup
    want, finish, usage = reference_reply(target, CONVERSATION)
    assert want.strip(), "the target's own reply is empty: nothing would be compared"
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                max_retries=0, timeout=120)
    try:
        done = await client.chat.completions.create(model=TARGET, messages=CONVERSATION,
                                                    temperature=0, max_tokens=MAX_TOKENS)
        stream = await client.chat.completions.create(model=TARGET, messages=CONVERSATION,
                                                      temperature=0, max_tokens=MAX_TOKENS, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    finally:
        await client.close()
    assert done.choices[0].message.content == want
    assert done.choices[0].finish_reason == finish
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    for answered in (done.usage, chunks[-1].usage):   # the stream's last chunk carries its usage
        assert (answered.prompt_tokens, answered.completion_tokens) == \
            (usage["prompt_tokens"], usage["completion_tokens"]), answered
