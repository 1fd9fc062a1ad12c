"""The device daemon's core: concurrent local requests on one drafter, server choice, resume
after a restart, tokenizer mismatch, live settings, the drafting-alone fallback."""
from __future__ import annotations

import asyncio

import pytest

from drafters.hf import HFDrafter
from edge_client.daemon import Device, DeviceError, Request
from edge_client.settings import DeviceSettings, SettingsError
from sled.wire.sampling import Sampling
from tests.conftest import greedy_reference


def make_device(server_addresses, drafter_model, tokenizer, **settings) -> Device:
    settings = DeviceSettings(id="test-device", servers=list(server_addresses), **settings)
    return Device(settings, load_drafter=lambda spec: HFDrafter(drafter_model, tokenizer, name=spec),
                  tokenizer=tokenizer)


async def test_concurrent_requests_share_one_drafter_and_stay_lossless(serve, models, drafter_models,
                                                                         tokenizer, prompts):
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tokenizer)
    await device.start()
    try:
        assert device.state == "ready", device.reason
        outputs = await asyncio.gather(*(device.complete(Request(p, max_tokens=20, ignore_eos=True))
                                         for p in prompts[:5]))
    finally:
        await device.close()
    for prompt, (tokens, finish, lossless) in zip(prompts, outputs):
        assert tokens == greedy_reference(models["llama"], prompt, 20)
        assert finish == "length" and lossless
    assert device.metrics.value("sled_device_requests_total", {"outcome": "ok"}) == 5
    assert device.metrics.value("sled_device_generated_tokens_total", {"lossless": "true"}) == 100
    assert device.metrics.value("sled_device_rounds_total") > 0


async def test_tokenizer_mismatch_server_is_passed_over_with_a_reason(serve, models, drafter_models,
                                                                       tokenizer, prompts):
    """One server's target has another tokenizer: it is never used, the status says why, and
    the device keeps serving through the compatible one."""
    from lab.tiny import make_model, make_tokenizer
    from verify_server.settings import ServerSettings
    from verify_server.server import start_server
    from verify_server.target import Target

    other_tokenizer = make_tokenizer(vocab_size=300)
    other = await start_server(Target.from_model(make_model("llama", len(other_tokenizer)),
                                                 other_tokenizer, "other"),
                               ServerSettings(kv_budget=16 << 20))
    try:
        device = make_device([other.address], drafter_models["llama"], tokenizer, reconnect_s=0.5)
        await device.start()
        assert device.state == "waiting"
        assert "does not match" in device.reason and other.address in device.reason
        with pytest.raises(DeviceError) as err:
            await device.complete(Request(prompts[0], max_tokens=4))
        assert err.value.kind == "unavailable" and "tokenizer" in err.value.message
        assert device.status()["servers"][0]["problem"].startswith("tokenizer")
        good = await serve(models["llama"])
        await device.apply({"servers": [other.address, good.address]})
        assert device.state == "ready"
        tokens, _, lossless = await device.complete(Request(prompts[0], max_tokens=8, ignore_eos=True))
        assert tokens == greedy_reference(models["llama"], prompts[0], 8) and lossless
        await device.close()
    finally:
        await other.stop(grace=0)


async def test_bad_requests_get_clear_errors(serve, models, drafter_models, tokenizer, prompts):
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tokenizer)
    await device.start()
    try:
        with pytest.raises(DeviceError, match="outside the vocabulary"):
            await device.complete(Request([10**7], max_tokens=4))
        with pytest.raises(DeviceError, match="empty"):
            await device.complete(Request([], max_tokens=4))
        tokens, _, _ = await device.complete(Request(prompts[0], max_tokens=6, ignore_eos=True))
        assert tokens == greedy_reference(models["llama"], prompts[0], 6)
    finally:
        await device.close()


async def test_live_settings_apply_without_restart_and_bad_ones_change_nothing(
        serve, models, drafter_models, tokenizer, prompts):
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tokenizer)
    await device.start()
    try:
        applied = await device.apply({"policy": {"draft_len": 3, "pipeline": False}})
        assert applied.policy.draft_len == 3 and device.settings.policy.draft_len == 3
        with pytest.raises(SettingsError, match="policy.draft_len"):
            await device.apply({"policy": {"draft_len": 0}})
        with pytest.raises(SettingsError, match="cannot change while running"):
            await device.apply({"port": 9})
        assert device.settings.policy.draft_len == 3
        tokens, _, _ = await device.complete(Request(prompts[1], max_tokens=12, ignore_eos=True))
        assert tokens == greedy_reference(models["llama"], prompts[1], 12)
        assert device.metrics.value("sled_device_draft_tokens_total") <= 3 * device.metrics.value(
            "sled_device_rounds_total")
    finally:
        await device.close()


async def test_no_server_waits_and_says_why_or_drafts_alone_when_asked(drafter_models, tokenizer, prompts):
    device = make_device(["127.0.0.1:1"], drafter_models["llama"], tokenizer, reconnect_s=0.3)
    await device.start()
    try:
        assert device.state == "waiting" and "127.0.0.1:1" in device.reason
        with pytest.raises(DeviceError) as err:
            await device.complete(Request(prompts[0], max_tokens=4))
        assert err.value.kind == "unavailable" and "waited 0.3 s" in err.value.message
        await device.apply({"unverified_fallback": True})
        tokens, finish, lossless = await device.complete(Request(prompts[0], max_tokens=5, ignore_eos=True))
        assert len(tokens) == 5 and finish == "length" and not lossless
        assert tokens == greedy_reference(drafter_models["llama"], prompts[0], 5)
        assert device.metrics.value("sled_device_generated_tokens_total", {"lossless": "false"}) == 5
    finally:
        await device.close()


async def test_drafting_alone_draws_a_fresh_stream_per_unseeded_request(drafter_models, tokenizer,
                                                                          prompts):
    """The fallback samples like a session: two unseeded requests draw different random streams,
    two with the same seed the same one."""
    device = make_device(["127.0.0.1:1"], drafter_models["llama"], tokenizer, reconnect_s=0.1,
                         unverified_fallback=True)

    def sampled(seed: int | None = None) -> Request:
        return Request(prompts[0], max_tokens=24, ignore_eos=True,
                       sampling=Sampling(temperature=1.0, seed=seed))

    await device.start()
    try:
        first, _, lossless = await device.complete(sampled())
        second, _, _ = await device.complete(sampled())
        seeded = [(await device.complete(sampled(seed=7)))[0] for _ in range(2)]
    finally:
        await device.close()
    assert not lossless and len(first) == len(second) == 24
    assert first != second
    assert seeded[0] == seeded[1] and len(seeded[0]) == 24


def test_settings_come_from_file_env_and_flags_in_that_order(tmp_path, monkeypatch):
    from pathlib import Path

    from edge_client.settings import load_settings

    example = load_settings(Path(__file__).parent.parent / "docs" / "device.example.toml")
    assert example.id == "pi5-kitchen" and example.mqtt.ca_file is None and not example.mqtt.enabled
    config = tmp_path / "device.yaml"
    config.write_text("id: pi-1\npolicy:\n  draft_len: 6\n  min_confidence: 0.2\nmqtt:\n  host: broker\n")
    monkeypatch.setenv("SLED_DEVICE_POLICY__DRAFT_LEN", "5")
    monkeypatch.setenv("SLED_DEVICE_MQTT__PORT", "8883")
    settings = load_settings(config, ["--policy.draft-len", "auto", "--servers", '["a:1","b:2"]'])
    assert settings.policy.draft_len == "auto"            # flag over variable over file
    assert settings.mqtt.port == 8883 and settings.mqtt.host == "broker"
    assert settings.policy.min_confidence == 0.2 and settings.servers == ["a:1", "b:2"]
    with pytest.raises(SettingsError, match="servers"):
        load_settings(config, ["--servers", '["nohost"]'])
    with pytest.raises(SettingsError, match="unknown key"):
        load_settings(config, [], policy={"draft_length": 3})
    monkeypatch.setenv("SLED_DEVICE_MQTT__PASSWORD", "hunter2")
    assert "hunter2" not in str(load_settings(config).public())


async def test_the_cache_salt_is_derived_from_a_secret_the_device_keeps(drafter_models, tokenizer,
                                                                       tmp_path, monkeypatch):
    """Not the device id (a topic level, the hostname by default, which any client of the same
    host can send): HMAC of the id under a secret made once in the cache, mode 0600."""
    import os
    import stat

    from edge_client.salt import SECRET_FILE, device_salt

    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    salt = device_salt("kitchen")
    assert salt == device_salt("kitchen") != device_salt("hall")          # kept across calls
    assert len(salt) == 64 and "kitchen" not in salt
    secret = tmp_path / "cache" / SECRET_FILE
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert [p.name for p in secret.parent.iterdir()] == [SECRET_FILE]     # no partial left
    assert device_salt("kitchen", tmp_path / "other") != salt            # another secret
    secret.write_text("damaged")
    assert device_salt("kitchen") != salt and device_salt("kitchen") == device_salt("kitchen")

    device = make_device(["127.0.0.1:1"], drafter_models["llama"], tokenizer)
    await device.start()
    try:
        assert device.cache_salt == device_salt("test-device") != "test-device"
    finally:
        await device.close()


def test_a_device_id_too_long_to_use_is_refused_at_start(tmp_path):
    from edge_client.settings import MAX_DEVICE_ID_CHARS, load_settings

    assert load_settings(None, ["--id", "d" * MAX_DEVICE_ID_CHARS]).id == "d" * MAX_DEVICE_ID_CHARS
    with pytest.raises(SettingsError, match="id"):
        load_settings(None, ["--id", "d" * (MAX_DEVICE_ID_CHARS + 1)])
