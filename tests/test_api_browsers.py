"""What a web page can do with the device's local API: with no api_key nothing but what the
device allows. A POST body must be JSON (415: a page posts text/plain and forms anywhere without
a preflight), the Host must be one the device serves (403: DNS rebinding), and a browser Origin
must be on api_origins (403), which alone gets CORS headers and preflights. The openai client and
plain JSON posts work as before; with an api_key Host and Origin are left to the key."""
from __future__ import annotations

import json

import aiohttp
import pytest

from edge_client.settings import DeviceSettings
from sled.settings_files import SettingsError
from tests.conftest import PROMPT_TEXTS
from tests.test_device import make_device
from tests.test_openai_api import NO_EOS, api, running_api  # noqa: F401 (api: a fixture)

KEY = "sk-browser-test-1"
PAGE = "http://localhost:3000"
COMPLETION = {"model": "tiny", "prompt": PROMPT_TEXTS[0], "max_tokens": 4, "temperature": 0, **NO_EOS}


async def call(url: str, method: str, path: str, body: dict | str | None = None,
               **headers) -> tuple[int, dict, dict | str]:
    """An HTTP call with exactly these headers (a dict body goes as JSON unless told otherwise)."""
    if isinstance(body, dict):
        headers.setdefault("Content-Type", "application/json")
        body = json.dumps(body)
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url + path, data=body, headers=headers) as response:
            text = await response.text()
            try:
                answer = json.loads(text)
            except ValueError:
                answer = text
            return response.status, dict(response.headers), answer


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[1]


@pytest.fixture
async def page_api(serve, models, drafter_models, tokenizer):
    """(base url) of a device without a key that lets PAGE's pages call it and answers to
    pi5-kitchen.lan."""
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tokenizer, api_origins=[PAGE],
                         api_hosts=["Pi5-Kitchen.lan"])
    async with running_api(device) as (_, url):
        yield url


# -- bodies -------------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
async def test_a_body_not_declared_json_is_a_415(api, content_type):
    _, url, _ = api
    headers = {} if content_type is None else {"Content-Type": content_type}
    status, _, answer = await call(url, "POST", "/v1/completions", json.dumps(COMPLETION), **headers)
    assert status == 415, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "unsupported_media_type" and "Content-Type: application/json" in error["message"]


async def test_the_openai_client_and_a_plain_json_post_still_work(api):
    client, url, _ = api
    done = await client.completions.create(**{k: v for k, v in COMPLETION.items() if k not in NO_EOS},
                                           extra_body=NO_EOS)
    assert done.usage.completion_tokens == 4
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        status, headers, answer = await call(url, "POST", "/v1/completions", json.dumps(COMPLETION),
                                             **{"Content-Type": content_type})
        assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer
        assert "Access-Control-Allow-Origin" not in headers


# -- Host ---------------------------------------------------------------------------------------
async def test_a_foreign_host_is_a_403_and_loopback_names_are_served(api):
    _, url, _ = api
    port = port_of(url)
    for host in ("attacker.example", f"attacker.example:{port}", f"rebind.127.0.0.1.nip.io:{port}"):
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", COMPLETION),
                                   ("GET", "/health", None)):
            status, _, answer = await call(url, method, path, body, Host=host)
            assert status == 403, (host, path, answer)
            assert answer["error"]["code"] == "host_not_allowed" and "api_hosts" in answer["error"]["message"]
    for host in ("localhost", f"localhost:{port}", f"LOCALHOST:{port}", f"127.0.0.1:{port}",
                 f"[::1]:{port}", "[::1]", "10.0.0.7"):
        status, _, answer = await call(url, "GET", "/v1/models", Host=host)
        assert status == 200, (host, answer)


async def test_api_hosts_adds_names_the_device_answers_to(page_api):
    port = port_of(page_api)
    assert (await call(page_api, "GET", "/v1/models", Host=f"pi5-kitchen.lan:{port}"))[0] == 200
    assert (await call(page_api, "GET", "/v1/models", Host=f"pi5-other.lan:{port}"))[0] == 403


# -- Origin and CORS ----------------------------------------------------------------------------
async def test_a_foreign_origin_is_a_403_without_cors_headers(api):
    _, url, _ = api
    for origin in ("http://attacker.example", "null", f"http://localhost:{port_of(url)}"):
        for method, path, body in (("POST", "/v1/completions", COMPLETION), ("GET", "/v1/models", None)):
            status, headers, answer = await call(url, method, path, body, Origin=origin)
            assert status == 403, (origin, answer)
            assert answer["error"]["code"] == "origin_not_allowed" and "api_origins" in answer["error"]["message"]
            assert "Access-Control-Allow-Origin" not in headers
        status, headers, _ = await call(url, "OPTIONS", "/v1/completions", Origin=origin,
                                        **{"Access-Control-Request-Method": "POST"})
        assert status == 403 and "Access-Control-Allow-Origin" not in headers


async def test_an_allowed_origin_gets_cors_on_answers_streams_and_preflights(page_api):
    status, headers, _ = await call(page_api, "OPTIONS", "/v1/chat/completions", Origin=PAGE,
                                    **{"Access-Control-Request-Method": "POST",
                                       "Access-Control-Request-Headers": "content-type"})
    assert status == 204 and headers["Access-Control-Allow-Origin"] == PAGE
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "content-type" in headers["Access-Control-Allow-Headers"].lower()

    status, headers, answer = await call(page_api, "POST", "/v1/completions", COMPLETION, Origin=PAGE + "/")
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    assert headers["Access-Control-Allow-Origin"] == PAGE + "/" and "Origin" in headers["Vary"]
    status, headers, answer = await call(page_api, "POST", "/v1/completions", {**COMPLETION, "stream": True},
                                         Origin=PAGE)
    assert status == 200 and answer.rstrip().endswith("data: [DONE]")
    assert headers["Access-Control-Allow-Origin"] == PAGE
    status, headers, _ = await call(page_api, "POST", "/v1/completions", COMPLETION,
                                    Origin="http://localhost:3001")
    assert status == 403 and "Access-Control-Allow-Origin" not in headers


async def test_with_a_key_host_and_origin_are_left_to_the_key(serve, models, drafter_models, tokenizer):
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tokenizer, api_key=KEY,
                         api_origins=[PAGE])
    async with running_api(device) as (_, url):
        foreign = {"Host": "device.example", "Origin": "http://attacker.example"}
        status, headers, _ = await call(url, "POST", "/v1/completions", COMPLETION, **foreign)
        assert status == 401 and "Access-Control-Allow-Origin" not in headers
        status, headers, _ = await call(url, "POST", "/v1/completions", COMPLETION, **foreign,
                                        Authorization=f"Bearer {KEY}")
        assert status == 200 and "Access-Control-Allow-Origin" not in headers
        status, headers, _ = await call(url, "OPTIONS", "/v1/completions", Origin=PAGE,
                                        **{"Access-Control-Request-Method": "POST"})
        assert status == 204 and headers["Access-Control-Allow-Origin"] == PAGE
        assert "authorization" in headers["Access-Control-Allow-Headers"].lower()
        status, _, _ = await call(url, "POST", "/v1/completions", "x", **{"Content-Type": "text/plain"},
                                  Authorization=f"Bearer {KEY}")
        assert status == 415


# -- settings -----------------------------------------------------------------------------------
def test_the_settings_refuse_what_cannot_be_an_origin_or_a_host():
    assert DeviceSettings(id="pi", api_origins=["http://localhost:3000", "https://[::1]:8443/"],
                          api_hosts=["pi5.lan"]).api_origins[0] == "http://localhost:3000"
    for origin in ("localhost:3000", "http://localhost:3000/app", "*"):
        with pytest.raises((ValueError, SettingsError), match="SCHEME://HOST"):
            DeviceSettings(id="pi", api_origins=[origin])
    with pytest.raises((ValueError, SettingsError), match="not a host name"):
        DeviceSettings(id="pi", api_hosts=["http://pi5.lan/"])
