"""The device's local OpenAI-compatible API: the official openai client works unchanged and gets
the target's greedy output; streaming, stop strings, usage, errors, health and metrics."""
from __future__ import annotations

import asyncio
import copy
import io
import json
from contextlib import asynccontextmanager

import aiohttp
import openai
import pytest

from edge_client.daemon import DeviceError
from edge_client.openai_api import MAX_BODY_BYTES, ApiError, start_api
from edge_client.text import OutputText
from sled.chat_templates import GEMMA3
from tests.conftest import PROMPT_TEXTS, greedy_reference
from tests.test_device import make_device

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
NO_EOS = {"ignore_eos": True}


def text_of(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@asynccontextmanager
async def running_api(device):
    """The device started, its API on a free port, and an official client pointed at it."""
    await device.start()
    runner, port = await start_api(device, "127.0.0.1", 0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                timeout=60)
    try:
        yield client, f"http://127.0.0.1:{port}"
    finally:
        await client.close()
        await runner.cleanup()
        await device.close()


@pytest.fixture
async def api(serve, models, drafter_models, tokenizer):
    """(client, base url, device) against an in-process server of the tiny llama target."""
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tokenizer)
    async with running_api(device) as (client, url):
        yield client, url, device


async def post(url: str, path: str, data, **headers) -> tuple[int, dict, dict]:
    """DATA posted as JSON unless the headers say another Content-Type."""
    headers.setdefault("Content-Type", "application/json")
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, data=data, headers=headers) as response:
            return response.status, dict(response.headers), await response.json(content_type=None)


# -- the official client ------------------------------------------------------------------------
async def test_completions_match_the_target_greedy_output(api, models, tokenizer, prompts):
    client, _, _ = api
    listed = await client.models.list()
    assert [m.id for m in listed.data] == ["tiny"]
    want = text_of(tokenizer, greedy_reference(models["llama"], prompts[0], 16))

    done = await client.completions.create(model="tiny", prompt=PROMPT_TEXTS[0], max_tokens=16,
                                           temperature=0, extra_body=NO_EOS)
    assert done.choices[0].text == want and done.choices[0].finish_reason == "length"
    assert done.object == "text_completion"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == \
        (len(prompts[0]), 16, len(prompts[0]) + 16)

    stream = await client.completions.create(model="tiny", prompt=PROMPT_TEXTS[0], max_tokens=16,
                                             temperature=0, stream=True, extra_body=NO_EOS,
                                             stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16

    # Token ids as the prompt, and echo.
    echoed = await client.completions.create(model="tiny", prompt=prompts[0], max_tokens=4, temperature=0,
                                             echo=True, extra_body=NO_EOS)
    short = text_of(tokenizer, greedy_reference(models["llama"], prompts[0], 4))
    assert echoed.choices[0].text == PROMPT_TEXTS[0] + short


async def test_chat_completions_use_the_chat_template(serve, models, drafter_models, tokenizer):
    chat_tokenizer = copy.deepcopy(tokenizer)
    chat_tokenizer.chat_template = CHAT_TEMPLATE
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def add(a, b):"}]
    prompt = chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    want = text_of(tokenizer, greedy_reference(models["llama"], prompt, 12))
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], chat_tokenizer)
    async with running_api(device) as (client, _):
        done = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                    temperature=0, extra_body=NO_EOS)
        assert done.object == "chat.completion"
        assert done.choices[0].message.role == "assistant"
        assert done.choices[0].message.content == want and done.choices[0].finish_reason == "length"
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt), 12)

        stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                      temperature=0, stream=True, extra_body=NO_EOS,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == len(prompt) and chunks[-1].usage.total_tokens == len(prompt) + 12


async def test_chat_without_a_template_is_refused_clearly(api):
    client, _, _ = api
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])


async def test_a_builtin_model_chats_with_its_template_when_the_tokenizer_has_none(
        serve, models, drafter_models, tokenizer):
    """A tokenizer cached from a server before built-in models carried templates: the device
    formats the chat with the built-in model's template (here gemma3's, over the tiny vocabulary)."""
    messages = [{"role": "user", "content": "def add(a, b):"}]
    prompt = tokenizer.apply_chat_template(messages, chat_template=GEMMA3,
                                           add_generation_prompt=True)["input_ids"]
    want = text_of(tokenizer, greedy_reference(models["llama"], prompt, 8))
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tokenizer, model_name="gemma3-270m")
    async with running_api(device) as (client, _):
        done = await client.chat.completions.create(model="gemma3-270m", messages=messages, max_tokens=8,
                                                    temperature=0, extra_body=NO_EOS)
    assert done.choices[0].message.content == want and done.usage.prompt_tokens == len(prompt)


async def test_the_turn_end_of_the_template_ends_a_chat_reply(serve, models, drafter_models, tokenizer):
    """A template that closes each turn with a special token (<pad> here, as Gemma's
    <end_of_turn>): that token ends the reply like an EOS, sent to the server as a stop id."""
    chat_tokenizer = copy.deepcopy(tokenizer)
    chat_tokenizer.chat_template = CHAT_TEMPLATE.replace("\n{% endfor %}", "<pad>\n{% endfor %}")
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], chat_tokenizer)
    sent = []
    stream = device.stream
    device.stream = lambda request: sent.append(request) or stream(request)
    async with running_api(device) as (client, _):
        messages = [{"role": "user", "content": "hi"}]
        await client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0,
                                             extra_body={"stop_token_ids": [5]})
        await client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0,
                                             extra_body={"stop_token_ids": [5], **NO_EOS})
        await client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
    pad = tokenizer.pad_token_id
    assert [request.stop_ids for request in sent] == [[5, pad], [5], []]


async def test_concurrent_streams_are_all_lossless(api, models, tokenizer, prompts):
    client, _, device = api

    async def streamed(text: str) -> str:
        stream = await client.completions.create(model="tiny", prompt=text, max_tokens=20, temperature=0,
                                                 stream=True, extra_body=NO_EOS)
        return "".join([chunk.choices[0].text async for chunk in stream])

    outputs = await asyncio.gather(*(streamed(text) for text in PROMPT_TEXTS[:4]))
    for prompt, got in zip(prompts, outputs):
        assert got == text_of(tokenizer, greedy_reference(models["llama"], prompt, 20))
    assert device.metrics.value("sled_device_requests_total", {"outcome": "ok"}) == 4


# -- stop strings and stop ids --------------------------------------------------------------------
async def test_stop_strings_cut_the_output_even_across_chunks(serve, models, drafter_models, tokenizer,
                                                              prompts):
    ids = greedy_reference(models["llama"], prompts[2], 24)
    full = text_of(tokenizer, ids)
    # A stop string spanning three tokens in the middle; small drafts split it across chunks.
    stop = full[len(text_of(tokenizer, ids[:8])):len(text_of(tokenizer, ids[:11]))]
    assert stop and "\ufffd" not in stop
    want = full[:full.index(stop)]
    used = next(i for i in range(1, len(ids) + 1) if stop in text_of(tokenizer, ids[:i]))
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tokenizer,
                         policy={"draft_len": 1, "pipeline": False})
    async with running_api(device) as (client, _):
        done = await client.completions.create(model="tiny", prompt=PROMPT_TEXTS[2], max_tokens=24,
                                               temperature=0, stop=["never appears", stop],
                                               extra_body=NO_EOS)
        stream = await client.completions.create(model="tiny", prompt=PROMPT_TEXTS[2], max_tokens=24,
                                                 temperature=0, stop=stop, stream=True,
                                                 extra_body=NO_EOS)
        pieces = [(c.choices[0].text, c.choices[0].finish_reason) async for c in stream]
    assert done.choices[0].text == want and done.choices[0].finish_reason == "stop"
    assert done.usage.completion_tokens == used
    assert "".join(text for text, _ in pieces) == want and pieces[-1][1] == "stop"


async def test_stop_token_ids_end_the_output_without_their_text(api, models, tokenizer, prompts):
    client, _, _ = api
    ids = greedy_reference(models["llama"], prompts[3], 12)
    first = ids.index(ids[5])          # the first place the stop id occurs
    done = await client.completions.create(model="tiny", prompt=PROMPT_TEXTS[3], max_tokens=12,
                                           temperature=0, extra_body={**NO_EOS, "stop_token_ids": [ids[5]]})
    assert done.choices[0].text == text_of(tokenizer, ids[:first])
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens == first + 1


def test_incomplete_characters_and_stop_prefixes_are_held_back(tokenizer):
    ids = tokenizer("日本 x\n\ny").input_ids
    output = OutputText(tokenizer, ["\n\n"], set())
    sent = []
    for token in ids:
        output.add([token])
        sent.append(output.take())
        assert "\ufffd" not in sent[-1] and not sent[-1].endswith("\n")
    assert "".join(sent) == "日本 x" and output.stopped


# -- errors ------------------------------------------------------------------------------------
async def test_bad_requests_get_openai_errors(api):
    client, url, _ = api
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model="tiny", prompt="x", max_tokens=4, n=2)
    assert err.value.body["param"] == "n" and "n=1" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        await client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        await client.completions.create(model="tiny", prompt=[5, 10**7], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="batches"):
        await client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=4)

    status, _, body = await post(url, "/v1/completions", "{not json", **{"Content-Type": "application/json"})
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status, _, body = await post(url, "/v1/completions", json.dumps({"model": "tiny", "prompt": "x",
                                                                     "max_tokens": "many"}))
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, _, body = await post(url, "/v1/completions", json.dumps({"model": "tiny"}))
    assert status == 400 and body["error"]["message"] == "prompt is required"
    big = json.dumps({"model": "tiny", "prompt": "x" * (MAX_BODY_BYTES + 10)})
    status, _, body = await post(url, "/v1/completions", io.BytesIO(big.encode()))
    assert status == 413 and body["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("kind, status", [("invalid", 400), ("busy", 429), ("unavailable", 503)])
def test_device_refusals_map_to_http_statuses(kind, status):
    error = ApiError.from_device(DeviceError(kind, "why"))
    assert error.status == status and error.body()["error"]["message"] == "why"


async def test_a_client_that_leaves_cancels_its_generation(serve, models, drafter_models, tokenizer):
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tokenizer,
                         policy={"draft_len": 1, "pipeline": False})
    async with running_api(device) as (_, url):
        request = {"model": "tiny", "prompt": "x", "max_tokens": 900, "temperature": 0, "stream": True,
                   "ignore_eos": True}
        async with aiohttp.ClientSession() as http:
            response = await http.post(url + "/v1/completions", json=request)
            assert (await response.content.readline()).startswith(b"data: ")
            response.close()
        for _ in range(100):
            if device.metrics.value("sled_device_requests_total", {"outcome": "cancelled"}):
                break
            await asyncio.sleep(0.05)
        assert device.metrics.value("sled_device_requests_total", {"outcome": "cancelled"}) == 1
        assert device.metrics.value("sled_device_generated_tokens_total", {"lossless": "true"}) < 900
        assert device.status()["active_sessions"] == 0


# -- health, metrics, the lossy mark ---------------------------------------------------------------
async def test_health_and_metrics(api):
    client, url, _ = api
    await client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0)
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/health") as response:
            assert response.status == 200 and (await response.json())["state"] == "ready"
        async with http.get(url + "/metrics") as response:
            text = await response.text()
    assert 'sled_device_requests_total{outcome="ok"} 1.0' in text
    assert 'sled_device_http_requests_total{method="POST",route="/v1/completions",status="200"} 1.0' in text


async def test_without_a_server_health_is_503_and_fallback_output_is_marked(drafter_models, tokenizer):
    device = make_device(["127.0.0.1:1"], drafter_models["llama"], tokenizer, reconnect_s=0.2,
                         model_name="tiny-edge")
    async with running_api(device) as (client, url):
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/health") as response:
                assert response.status == 503 and (await response.json())["state"] == "waiting"
        with pytest.raises(openai.InternalServerError) as err:
            await client.completions.create(model="tiny-edge", prompt="x", max_tokens=3)
        assert err.value.status_code == 503

        await device.apply({"unverified_fallback": True})
        request = {"model": "tiny-edge", "prompt": "x", "max_tokens": 3, "temperature": 0}
        status, headers, body = await post(url, "/v1/completions", json.dumps(request))
        assert status == 200 and headers["X-Sled-Lossless"] == "false"
        assert body["sled"] == {"lossless": False}
        stream = await client.completions.create(model="tiny-edge", prompt="x", max_tokens=3, temperature=0,
                                                 stream=True)
        chunks = [chunk async for chunk in stream]
    assert chunks and all(chunk.model_extra["sled"] == {"lossless": False} for chunk in chunks)
