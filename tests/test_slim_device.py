"""A device installed as a Pi would install it: a fresh venv with `sled[gguf]` only (pip's cache
allowed), no torch and no transformers in it, running `sled device` with the gemma3 GGUF (given
as its file: the built-in aliases need the models package) against the target gemma3-270m served
from the full environment. Its greedy output is the target's generate(do_sample=False), a seeded
sampled request repeats exactly, and a chat completion is rendered as transformers' template
renders it."""
from __future__ import annotations

import asyncio
import os
import subprocess

import openai
import pytest
import torch

from conftest import cached_reference
from drafters import resolve_spec
from lab import slim_env
from lab.server_process import free_port
from verify_server.target import load_target
from test_device_cli import wait_health
from test_openai_chat import CONVERSATION, reference_reply
from verify_server.server import start_server
from verify_server.settings import ServerSettings

pytestmark = pytest.mark.slow
TARGET = "gemma3-270m"
MAX_TOKENS = 16
PROMPTS = ["def fibonacci(n):", "The capital of France is"]


@pytest.fixture(scope="session")
def slim_python(tmp_path_factory):
    """The python of a venv with sled[gguf] and nothing else, built once per session."""
    return slim_env.build(tmp_path_factory.mktemp("slim") / "venv", "gguf")


def test_the_slim_venv_has_sled_and_neither_torch_nor_transformers(slim_python, tmp_path):
    for module in ("torch", "transformers"):
        done = subprocess.run([str(slim_python), "-c", f"import {module}"], capture_output=True,
                              text=True, cwd=tmp_path, env=_clean_env())
        assert done.returncode != 0 and f"No module named '{module}'" in done.stderr, done.stderr
    where = subprocess.run([str(slim_python), "-c", "import edge_client, llama_cpp; "
                            "print(edge_client.__file__)"], capture_output=True, text=True,
                           cwd=tmp_path, env=_clean_env(), check=True).stdout
    assert str(slim_python.parents[1]) in where     # the installed copy, not the working tree


def test_the_slim_venv_runs_the_llama_cpp_sled_built_for_this_cpu(slim_python):
    """Not a build pip made with -march=native: the very library of sled.llama_build's wheel."""
    import hashlib
    import zipfile

    from sled import llama_build

    library = "lib/libggml-cpu.so"
    with zipfile.ZipFile(llama_build.wheel_for_this_cpu()) as wheel:
        built = hashlib.sha256(wheel.read(library)).hexdigest()
    installed = [folder / library for folder in slim_env.site_packages(slim_python)
                 if (folder / library).exists()]
    assert len(installed) == 1, installed
    assert hashlib.sha256(installed[0].read_bytes()).hexdigest() == built


def _clean_env(**extra: str) -> dict:
    """This environment without a PYTHONPATH that would reach the working tree's code."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return {**env, **extra}


@pytest.fixture(scope="module")
async def slim_device(slim_python, tmp_path_factory):
    """(device API port, target): `sled device` from the slim venv, with its own sled cache (the
    target's tokenizer comes from the server), in front of the target as `sled serve --model
    gemma3-270m` loads it, served from this environment, with the device's default draft length
    (a seeded request drafts a fixed length whatever that is)."""
    torch.set_num_threads(2)
    port, server_port = free_port(), free_port()
    gguf = resolve_spec(f"gguf:{TARGET}")                        # gguf:/.../the assembled file
    home = tmp_path_factory.mktemp("slim-device")
    log = (home / "device.log").open("w")
    device = subprocess.Popen([str(slim_python.parent / "sled"), "device", "--servers",
                               f'["127.0.0.1:{server_port}"]', "--drafter", gguf, "--port",
                               str(port), "--id", "slim-test"],
                              stdout=log, stderr=log, cwd=home,
                              env=_clean_env(SLED_CACHE=str(home / "cache")))
    server = None
    try:
        target = await asyncio.to_thread(load_target, ServerSettings(model=TARGET))
        server = await start_server(target, ServerSettings(model=TARGET, kv_budget="512MiB"),
                                    port=server_port)
        try:
            await wait_health(port, timeout=180)
        except TimeoutError:
            pytest.fail("the slim device never became ready:\n" +
                        (home / "device.log").read_text()[-3000:])
        yield port, target
    finally:
        device.terminate()
        device.wait(10)
        log.close()
        if server is not None:
            await server.stop(grace=0)


def reference_completion(target, prompt: str) -> tuple[str, int]:
    """(text, completion tokens) of the target's generate(do_sample=False) on PROMPT, up to
    and with its EOS."""
    ids = target.tokenizer(prompt).input_ids
    new = cached_reference(target.model, ids, MAX_TOKENS)
    cut = next((i for i, token in enumerate(new) if token in set(target.eos_ids)), None)
    text = target.tokenizer.decode(new[:cut], skip_special_tokens=True,
                                   clean_up_tokenization_spaces=False)
    return text, len(new) if cut is None else cut + 1


def client_of(port: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                              max_retries=0, timeout=120)


async def test_the_slim_device_greedy_output_is_the_target_generate(slim_device):
    port, target = slim_device
    client = client_of(port)
    try:
        for prompt in PROMPTS:
            want, tokens = reference_completion(target, prompt)
            done = await client.completions.create(model=TARGET, prompt=prompt, temperature=0,
                                                   max_tokens=MAX_TOKENS)
            assert done.choices[0].text == want, prompt
            assert done.usage.completion_tokens == tokens, prompt
    finally:
        await client.close()


async def test_a_seeded_sampled_request_repeats_exactly_on_the_slim_device(slim_device):
    port, _ = slim_device
    client = client_of(port)
    try:
        texts = [(await client.completions.create(
            model=TARGET, prompt=PROMPTS[1], temperature=0.9, top_p=0.95, seed=1234,
            max_tokens=MAX_TOKENS)).choices[0].text for _ in range(2)]
    finally:
        await client.close()
    assert texts[0] and texts[0] == texts[1], texts


async def test_the_slim_device_chat_prompt_is_transformers_template(slim_device):
    """Same prompt tokens as transformers' apply_chat_template, and the greedy reply is the
    target's generate on those ids."""
    port, target = slim_device
    want, finish, usage = reference_reply(target, CONVERSATION)
    client = client_of(port)
    try:
        done = await client.chat.completions.create(model=TARGET, messages=CONVERSATION,
                                                    temperature=0, max_tokens=16)
    finally:
        await client.close()
    assert done.usage.prompt_tokens == usage["prompt_tokens"]
    assert done.choices[0].message.content == want
    assert (done.choices[0].finish_reason, done.usage.completion_tokens) == \
        (finish, usage["completion_tokens"])
