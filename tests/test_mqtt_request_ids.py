"""An MQTT request's request_id names its responses' topic and comes back in every chunk, so it
is one short topic level (at most 128 printable characters without whitespace, '/', '+', '#'):
anything else is refused on responses/invalid without being echoed (only a short escaped
excerpt). MQTT requests carry no stop strings (an unknown field), so they cannot pass the
local API's bounds on them."""
from __future__ import annotations

import json

import pytest

from edge_client.daemon import DeviceError, Request
from edge_client.device_requests import MAX_REQUEST_ID_CHARS
from edge_client.mqtt import parse_request
from tests.mqtt_broker import Watcher, eventually, mosquitto  # noqa: F401 (mosquitto: a fixture)
from tests.test_device import make_device
from tests.test_mqtt import collect, mqtt_device, running, topic

LONG_ID = "r" * 10_000


@pytest.mark.parametrize("request_id", [LONG_ID, "x" * (MAX_REQUEST_ID_CHARS + 1), 7, ["r1"], "",
                                        "two words", "a/b", "\x1b[2J"])
def test_a_request_id_that_is_not_one_short_topic_level_is_refused_unechoed(request_id):
    with pytest.raises(DeviceError) as refused:
        parse_request({"request_id": request_id, "prompt_ids": [5]}, None)
    message = refused.value.message
    assert refused.value.kind == "invalid" and f"1 to {MAX_REQUEST_ID_CHARS} printable" in message
    assert len(message) < 200 and (not isinstance(request_id, str) or len(request_id) < 2
                                   or request_id not in message)


def test_a_request_id_at_the_bound_is_accepted():
    request = parse_request({"request_id": "x" * MAX_REQUEST_ID_CHARS, "prompt_ids": [5]}, None)
    assert request.request_id == "x" * MAX_REQUEST_ID_CHARS


def test_stop_strings_are_no_field_of_an_mqtt_request():
    with pytest.raises(DeviceError, match="unknown field stop"):
        parse_request({"request_id": "r1", "prompt_ids": [5], "stop": ["x" * 400_000]}, None)


async def test_the_device_refuses_a_long_request_id_from_any_caller(serve, models, drafter_models,
                                                                   tokenizer, prompts):
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tokenizer)
    await device.start()
    try:
        with pytest.raises(DeviceError, match=f"at most {MAX_REQUEST_ID_CHARS} characters"):
            await device.complete(Request(prompts[0], max_tokens=2, request_id=LONG_ID))
        tokens, _, _ = await device.complete(Request(prompts[0], max_tokens=2, ignore_eos=True,
                                                     request_id="x" * MAX_REQUEST_ID_CHARS))
        assert len(tokens) == 2
    finally:
        await device.close()


async def test_a_long_request_id_is_answered_on_responses_invalid_without_it(
        serve, models, drafter_models, tokenizer, prompts, mosquitto):
    server = await serve(models["llama"])
    device = mqtt_device(mosquitto, [server.address], drafter_models["llama"], tokenizer)
    async with running(device) as control, Watcher(mosquitto.broker(), topic("responses/#")) as watcher:
        await eventually(lambda: control.connected, what="the MQTT connection")
        mark = watcher.mark()
        await watcher.publish(topic("requests"), json.dumps({"request_id": LONG_ID, "prompt_ids": prompts[0],
                                                             "max_tokens": 4}))
        seen = await watcher.wait_for(topic("responses/invalid"), lambda m: "error" in m, since=mark)
        assert seen.payload["kind"] == "invalid" and "request_id" in seen.payload["error"]
        assert LONG_ID not in json.dumps(seen.payload) and len(json.dumps(seen.payload)) < 600
        assert not any(s.topic.endswith(LONG_ID) for s in watcher.seen)

        await watcher.publish(topic("requests"), json.dumps(
            {"request_id": "ok-" + "x" * (MAX_REQUEST_ID_CHARS - 3), "prompt_ids": prompts[0],
             "max_tokens": 3, "ignore_eos": True}))
        messages = await collect(watcher, "ok-" + "x" * (MAX_REQUEST_ID_CHARS - 3))
        assert messages[-1]["finish_reason"] == "length"
