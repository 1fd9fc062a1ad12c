"""Who may call the device's local API: with an api_key every route but /health asks for
`Authorization: Bearer KEY` (401 in OpenAI's shape otherwise), and `sled device` refuses to serve
beyond loopback with no key unless api_open says so, before it loads anything."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
from pathlib import Path

import aiohttp
import openai
import pytest

from edge_client.openai_api import check_exposure, is_loopback, start_api
from edge_client.settings import DeviceSettings, load_settings
from lab import device_entry
from sled.settings_files import SettingsError
from tests.conftest import PROMPT_TEXTS, SLED
from tests.test_compose import slots
from tests.test_device import make_device
from tests.test_openai_api import NO_EOS, api, post, running_api  # noqa: F401 (api: a fixture)

KEY = "sk-kitchen-pi-7f3a"
COMPLETION = {"model": "tiny", "prompt": PROMPT_TEXTS[0], "max_tokens": 4, "temperature": 0}


@pytest.fixture
async def keyed_api(serve, models, drafter_models, tokenizer):
    """(base url, device) of a device whose API needs KEY, against the tiny llama target."""
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tokenizer, api_key=KEY)
    async with running_api(device) as (_, url):
        yield url, device


def client(url: str, api_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60)


async def get(url: str, path: str, **headers) -> tuple[int, dict, str]:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + path, headers=headers) as response:
            return response.status, dict(response.headers), await response.text()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- with a key ---------------------------------------------------------------------------------
async def test_the_openai_client_needs_the_right_key(keyed_api):
    url, _ = keyed_api
    async with client(url, KEY) as keyed:
        done = await keyed.completions.create(**COMPLETION, extra_body=NO_EOS)
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4
        assert [m.id for m in (await keyed.models.list()).data] == ["tiny"]
    async with client(url, "sk-someone-else") as wrong:
        with pytest.raises(openai.AuthenticationError, match="not this device's") as refused:
            await wrong.completions.create(**COMPLETION)
        assert (refused.value.status_code, refused.value.code) == (401, "invalid_api_key")
        with pytest.raises(openai.AuthenticationError, match="needs a key") as refused:
            await wrong.models.list(extra_headers={"Authorization": openai.omit})   # no header at all
        assert refused.value.status_code == 401


async def test_a_request_without_the_header_gets_a_401_in_openai_shape(keyed_api):
    url, _ = keyed_api
    status, headers, body = await post(url, "/v1/completions", b"{}")
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == \
        ("invalid_request_error", "invalid_api_key", None)
    assert "Authorization: Bearer KEY" in error["message"] and "api_key" in error["message"]
    # Another scheme, or the key in another case, is no key either; the key is never echoed.
    for authorization in ("Basic " + KEY, "Bearer " + KEY.upper(), KEY):
        status, _, body = await post(url, "/v1/completions", b"{}", Authorization=authorization)
        assert status == 401 and KEY not in str(body), authorization
    # Paths no route has ask for the key too (a 401, not a 404 that maps the routes).
    assert (await get(url, "/v1/nothing-here"))[0] == 401
    # The right key reaches the handler (which refuses the empty body for its own reason).
    status, _, body = await post(url, "/v1/completions", b"{}", **bearer(KEY))
    assert status == 400 and body["error"]["param"] == "model"


async def test_health_is_open_and_metrics_need_the_key(keyed_api):
    url, _ = keyed_api
    status, _, body = await get(url, "/health")
    assert status == 200 and json.loads(body)["state"] == "ready"
    status, headers, _ = await get(url, "/metrics")
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    status, _, metrics = await get(url, "/metrics", **bearer(KEY))
    assert status == 200
    # The refusals are counted like any answer.
    assert 'route="/metrics",status="401"' in metrics


# -- without a key --------------------------------------------------------------------------------
async def test_with_no_key_on_loopback_everything_answers_as_before(api):
    keyless, url, _ = api
    done = await keyless.completions.create(**COMPLETION, extra_body=NO_EOS)
    assert done.usage.completion_tokens == 4
    status, _, body = await post(url, "/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": 1}')
    assert status == 200 and body["object"] == "text_completion"
    assert [(await get(url, path))[0] for path in ("/health", "/metrics", "/v1/models")] == [200, 200, 200]


# -- where the API may listen -------------------------------------------------------------------
def test_loopback_is_localhost_127_8_and_ipv6_one_alone(monkeypatch):
    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "10.0.0.7", "192.168.1.20", "fe80::1"):
        assert not is_loopback(host), host
    # Names count by what they resolve to; one that does not resolve is not vouched for.
    resolves = {"pi.lan": ["192.168.1.20"], "both.lan": ["127.0.0.1", "10.0.0.7"],
                "self.lan": ["127.0.1.1", "::1"]}

    def resolve(host, *args, **kwargs):
        if host not in resolves:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 0)) for address in resolves[host]]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert [is_loopback(name) for name in ("pi.lan", "both.lan", "self.lan", "unknown.lan")] == \
        [False, False, True, False]


def test_an_open_bind_needs_a_key_or_api_open():
    with pytest.raises(SettingsError, match="api_key.*api_open = true") as refused:
        check_exposure("0.0.0.0", DeviceSettings(id="pi"))
    assert "\n" not in str(refused.value)
    assert check_exposure("0.0.0.0", DeviceSettings(id="pi", api_key=KEY)) is False
    assert check_exposure("0.0.0.0", DeviceSettings(id="pi", api_open=True)) is True
    assert check_exposure("127.0.0.1", DeviceSettings(id="pi")) is False


async def test_start_api_refuses_an_open_bind_and_warns_when_opened(drafter_models, tokenizer, caplog):
    with pytest.raises(SettingsError, match="api_open"):
        await start_api(make_device([], drafter_models["llama"], tokenizer), "0.0.0.0", 0)
    device = make_device([], drafter_models["llama"], tokenizer, api_open=True)
    with caplog.at_level(logging.WARNING, logger="sled.api"):
        runner, port = await start_api(device, "0.0.0.0", 0)
    try:
        assert (await get(f"http://127.0.0.1:{port}", "/metrics"))[0] == 200
    finally:
        await runner.cleanup()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "open to the network" in warnings[0]


def test_the_lab_devices_serve_their_api_open(monkeypatch):
    """The compose lab binds 0.0.0.0 for its runner: its environment says api_open, and loads."""
    env = device_entry.daemon_env(slots()[0], "user-space", "pw", Path("traces"))
    assert env["SLED_DEVICE_HOST"] == "0.0.0.0" and env["SLED_DEVICE_API_OPEN"] == "true"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = load_settings(None, [])
    assert check_exposure(settings.host, settings) is True


# -- sled device --------------------------------------------------------------------------------
def sled_device(cache, *flags: str) -> subprocess.Popen:
    """`sled device` on 0.0.0.0 and any free port, its server a closed port (it never gets ready),
    with no SLED_DEVICE_* variable of the environment."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("SLED_DEVICE_")}
    env["SLED_CACHE"] = str(cache)
    return subprocess.Popen([*SLED, "device", "--host", "0.0.0.0", "--port", "0", "--id", "pi",
                             "--servers", '["127.0.0.1:1"]', *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_sled_device_refuses_an_open_bind_before_loading_anything(tmp_path):
    """The drafter cannot load: a refusal that came after loading would say "cannot start"
    (that, not how soon the line comes, shows nothing was loaded first)."""
    refused = sled_device(tmp_path, "--drafter", "hf:/no/such/drafter")
    out, err = refused.communicate(timeout=120)     # a hang detector
    assert refused.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sled device: "), err
    assert "api_key" in lines[0] and "api_open = true" in lines[0] and "cannot start" not in err
    assert not out


async def api_port(device: subprocess.Popen) -> int:
    """The port from the daemon's start-up line."""
    line = await asyncio.wait_for(asyncio.to_thread(device.stdout.readline), 60)
    assert "OpenAI-compatible API on http://0.0.0.0:" in line, line
    return int(line.split("http://0.0.0.0:")[1].split("/")[0])


def stop(device: subprocess.Popen) -> tuple[int, str]:
    device.send_signal(signal.SIGTERM)
    try:
        _, err = device.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        device.kill()
        raise
    return device.returncode, err


async def test_sled_device_serves_the_network_with_api_open_or_a_key(tmp_path):
    opened = sled_device(tmp_path / "open", "--api-open", "true")
    keyed = sled_device(tmp_path / "keyed", "--api-key", KEY)
    try:
        open_url, keyed_url = (f"http://127.0.0.1:{port}"
                               for port in await asyncio.gather(api_port(opened), api_port(keyed)))
        assert (await get(open_url, "/v1/models"))[0] == 200
        assert (await get(keyed_url, "/v1/models"))[0] == 401
        assert (await get(keyed_url, "/v1/models", **bearer(KEY)))[0] == 200
        assert (await get(keyed_url, "/health"))[0] == 503     # open, and no server yet
    finally:
        (open_code, open_err), (keyed_code, keyed_err) = stop(opened), stop(keyed)
    assert open_code == 0 and keyed_code == 0, open_err + keyed_err
    assert open_err.count("open to the network") == 1 and "open to the network" not in keyed_err
