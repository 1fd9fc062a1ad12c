"""lab.drive and lab.oracle: the lab's requests reach real devices (a real server, a real device
daemon, a real Mosquitto) over MQTT and over the OpenAI API, come back as the target's own greedy
output, and are counted, spaced and sent again as a scenario says."""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from edge_client.daemon import Device
from edge_client.mqtt import DeviceMqtt
from edge_client.openai_api import start_api
from edge_client.settings import DeviceSettings
from lab.drive import Attempt, RequestRecord, drive
from lab.oracle import compare, greedy_references, load_target, served_dtype
from sled.mqtt import Backoff, decode, encode
from tests.conftest import PROMPT_TEXTS
from tests.mqtt_broker import eventually, mosquitto  # noqa: F401
from verify_server.server import start_server
from verify_server.settings import ServerSettings

MAX_TOKENS = 12


@dataclass(frozen=True)
class Slot:
    """The fields of lab.scenario.DeviceSlot that drive() reads."""
    index: int
    id: str
    device: str = "pi5"
    link: str = "wifi"
    drafter: str = "hf"
    group: int = 0


def handle(slot_id: str, api_url: str = "", index: int = 0):
    return SimpleNamespace(slot=Slot(index, slot_id), api_url=api_url, metrics_url=api_url + "/metrics")


def scenario(target: str, via: str = "mqtt", requests: int | None = 2, mode: str = "closed",
             rate: float = 0.0, temperature: float = 0.0, duration_s: float | None = None):
    return SimpleNamespace(
        target=target, via=via, requests=requests, duration_s=duration_s, max_tokens=MAX_TOKENS,
        arrivals=SimpleNamespace(mode=mode, rate_per_s=rate),
        sampling=SimpleNamespace(temperature=temperature, top_p=1.0, top_k=0, seed=7))


# -- compare --------------------------------------------------------------------------------
@pytest.mark.parametrize("received, want", [
    ([1, 2, 3, 4], (0, 0)),
    ([1, 2, 4], (1, 0)),                 # a token lost
    ([1, 2, 2, 3, 4], (0, 1)),           # a token twice
    ([1, 2, 3, 4, 3, 4], (0, 2)),        # a chunk sent again
    ([1, 9, 3, 4], (1, 1)),              # replaced: lost and extra
    ([], (4, 0)),
])
def test_compare_counts_lost_and_duplicated_tokens(received, want):
    assert compare([1, 2, 3, 4], received) == want


@pytest.mark.parametrize("args, want", [
    (None, "float32"), ([], "float32"), (["--dtype", "bfloat16"], "bfloat16"),
    (["--max-sessions", "4", "--dtype=float16"], "float16")])
def test_the_references_use_the_dtype_the_server_is_given(args, want):
    assert served_dtype(args) == want


# -- the real thing ---------------------------------------------------------------------------
@pytest.fixture
async def device_stack(pair, mosquitto):  # noqa: F811
    """A served tiny target and one device daemon (MQTT + API) with the n-gram drafter; the device
    takes its tokenizer from the server, as `sled device` does."""
    target_dir = pair[0]
    server = await start_server(load_target(str(target_dir)), ServerSettings(kv_budget=64 << 20))
    device = Device(DeviceSettings(id="dev-00", servers=[server.address], drafter="ngram",
                                   mqtt={"host": "127.0.0.1", "port": mosquitto.port, "keepalive_s": 2}))
    await device.start()
    control = DeviceMqtt(device, backoff=Backoff(first=0.1, most=0.5))
    task = asyncio.create_task(control.run())
    runner, port = await start_api(device, "127.0.0.1", 0)
    try:
        await eventually(lambda: control.connection.connected, what="the device's MQTT connection")
        yield SimpleNamespace(target=str(target_dir), broker=mosquitto.broker(),
                              api_url=f"http://127.0.0.1:{port}", device=device)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.cleanup()
        await device.close()
        await server.stop(grace=0)


@pytest.fixture(scope="module")
def references(pair):
    return greedy_references(str(pair[0]), PROMPT_TEXTS[:3], MAX_TOKENS)


@pytest.mark.parametrize("via", ["mqtt", "openai"])
async def test_greedy_requests_come_back_as_the_targets_own_output(device_stack, references, via):
    fleet = SimpleNamespace(broker=device_stack.broker)
    seen: list[RequestRecord] = []
    records = await drive(fleet, scenario(device_stack.target, via), [handle("dev-00", device_stack.api_url)],
                          PROMPT_TEXTS[:3], references, seen.append)
    assert len(records) == 2 and seen == records
    assert [r.prompt_index for r in records] == [0, 1]
    for record in records:
        assert record.error is None and record.attempts == 1, record
        assert record.token_ids == references[record.prompt_index] and record.lossless is True
        assert (record.lost_tokens, record.duplicated_tokens) == (0, 0)
        assert record.sent_at <= record.first_token_at <= record.done_at
        assert record.text and record.device == "dev-00" and record.fleet_size == 1
    if via == "mqtt":
        assert all(r.chunks >= 1 and not r.missing_chunks and not r.duplicated_chunks for r in records)


async def test_poisson_arrivals_send_the_scenarios_number_of_requests(device_stack, references):
    fleet = SimpleNamespace(broker=device_stack.broker)
    records = await drive(fleet, scenario(device_stack.target, requests=4, mode="poisson", rate=5.0),
                          [handle("dev-00")], PROMPT_TEXTS[:3], references, lambda record: None)
    assert len(records) == 4
    assert sorted(r.prompt_index for r in records) == [0, 0, 1, 2]
    assert all(r.lossless is True for r in records)
    assert len({r.sent_at for r in records}) == 4


@pytest.mark.parametrize("via", ["mqtt", "openai"])
async def test_sampled_requests_are_answered_and_not_judged(device_stack, references, via):
    fleet = SimpleNamespace(broker=device_stack.broker)
    (record,) = await drive(fleet, scenario(device_stack.target, via, requests=1, temperature=0.9),
                            [handle("dev-00", device_stack.api_url)], PROMPT_TEXTS[:3], references,
                            lambda record: None)
    assert record.error is None and record.token_ids and record.lossless is None
    assert (record.lost_tokens, record.duplicated_tokens) == (0, 0)


# -- a device that fails first: a stand-in answering on a real broker ----------------------------
@contextlib.asynccontextmanager
async def flaky_device(broker, device_id: str, answer: list[int], failures: int):
    """Answers its first FAILURES requests "unavailable", then streams ANSWER in chunks of two,
    the first chunk twice (as a QoS 1 redelivery would)."""
    asked: list[dict] = []

    async def serve() -> None:
        async with broker.client(f"flaky-{device_id}") as client:
            await client.subscribe(f"sled/devices/{device_id}/requests", qos=1)
            ready.set()
            async for message in client.messages:
                request = decode(message.payload)
                asked.append(request)
                await respond(client, request, len(asked) <= failures)

    async def respond(client, request: dict, fail: bool) -> None:
        topic = f"sled/devices/{device_id}/responses/{request['request_id']}"
        if fail:
            await client.publish(topic, encode({"request_id": request["request_id"], "kind": "unavailable",
                                                "error": "no verify server"}), qos=1)
            return
        pieces = [answer[i:i + 2] for i in range(0, len(answer), 2)]
        for index in [0, *range(len(pieces))]:
            message = {"request_id": request["request_id"], "index": index, "token_ids": pieces[index],
                       "text": json.dumps(pieces[index])}
            if index == len(pieces) - 1:
                message["finish_reason"] = "length"
            await client.publish(topic, encode(message), qos=1)

    ready = asyncio.Event()
    task = asyncio.create_task(serve())
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield asked
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_unavailable_answer_is_sent_again_and_a_repeated_chunk_is_counted_once(mosquitto):  # noqa: F811
    answer = [5, 6, 7, 8, 9]
    fleet = SimpleNamespace(broker=mosquitto.broker())
    async with flaky_device(fleet.broker, "dev-07", answer, failures=1) as asked:
        records = await drive(fleet, scenario("unused", requests=1), [handle("dev-07")], ["x"],
                              [answer], lambda record: None)
    (record,) = records
    assert len(asked) == 2 and asked[0]["request_id"] != asked[1]["request_id"]
    assert asked[1]["temperature"] == 0.0 and asked[1]["max_tokens"] == MAX_TOKENS
    assert record.attempts == 2 and record.error is None
    assert record.token_ids == answer and record.lossless is True
    assert record.duplicated_chunks == [0] and record.missing_chunks == [] and record.chunks == 3


async def test_a_request_failing_every_time_gives_up_after_three_sends(mosquitto):  # noqa: F811
    fleet = SimpleNamespace(broker=mosquitto.broker())
    async with flaky_device(fleet.broker, "dev-08", [1], failures=10) as asked:
        (record,) = await drive(fleet, scenario("unused", requests=1), [handle("dev-08")], ["x"],
                                [[1]], lambda record: None)
    assert len(asked) == 3 and record.attempts == 3
    assert "no verify server" in record.error and record.lossless is False
    assert (record.lost_tokens, record.duplicated_tokens) == (1, 0)


# -- the loops without devices -----------------------------------------------------------------
class EchoSender:
    """Answers every request at once with its reference."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    async def send(self, handle, prompt, reference):
        self.sent.append((handle.slot.id, prompt))
        return Attempt(first_token_at=0.0, done_at=0.0, token_ids=list(reference), chunks=1)


async def test_devices_start_at_different_prompts_and_sampling_is_not_judged(monkeypatch):
    import lab.drive as drive_module

    sender = EchoSender()

    @contextlib.asynccontextmanager
    async def fake_sender(*args):
        yield sender

    monkeypatch.setattr(drive_module, "make_sender", fake_sender)
    prompts = ["a", "b", "c"]
    records = await drive(None, scenario("unused", requests=2, temperature=0.8),
                          [handle("dev-00", index=0), handle("dev-01", index=1)], prompts,
                          [[1], [2], [3]], lambda record: None)
    firsts = {device: prompt for device, prompt in reversed(sender.sent)}
    assert firsts == {"dev-00": "a", "dev-01": "b"}
    assert len(records) == 4 and all(r.lossless is None for r in records)


@pytest.mark.slow
async def test_greedy_references_match_what_a_device_returns_on_gemma3(mosquitto):  # noqa: F811
    """The oracle and a real `sled serve --model gemma3-270m` + device agree token for token."""
    prompts = ["def fibonacci(n):", "The capital of France is"]
    references = greedy_references("gemma3-270m", prompts, 24)
    server = await start_server(load_target("gemma3-270m"), ServerSettings(kv_budget=256 << 20))
    device = Device(DeviceSettings(id="dev-00", servers=[server.address], drafter="ngram",
                                   mqtt={"host": "127.0.0.1", "port": mosquitto.port}))
    await device.start()
    control = DeviceMqtt(device, backoff=Backoff(first=0.1, most=0.5))
    task = asyncio.create_task(control.run())
    try:
        await eventually(lambda: control.connection.connected, what="the device's MQTT connection")
        records = await drive(SimpleNamespace(broker=mosquitto.broker()),
                              SimpleNamespace(**{**vars(scenario("gemma3-270m")), "max_tokens": 24}),
                              [handle("dev-00")], prompts, references, lambda record: None)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await device.close()
        await server.stop(grace=0)
    assert all(r.token_ids == references[r.prompt_index] and r.lossless for r in records), records


async def test_a_request_cut_by_a_broker_restart_is_sent_again(mosquitto, tmp_path, monkeypatch):  # noqa: F811
    """The broker dies after the first chunk and comes back on its port: the lab sends the request
    again and records the second answer whole."""
    import aiomqtt

    import tests.mqtt_broker as broker_helpers

    answer, asked, half_sent = [3, 4, 5, 6], [], asyncio.Event()
    broker = mosquitto.broker()

    async def answer_requests() -> None:          # a device that reconnects, as the daemon does
        while True:
            with contextlib.suppress(aiomqtt.MqttError):
                async with broker.client("restart-device") as client:
                    await client.subscribe("sled/devices/dev-09/requests", qos=1)
                    async for message in client.messages:
                        request = decode(message.payload)
                        asked.append(request)
                        topic = f"sled/devices/dev-09/responses/{request['request_id']}"
                        last = 1 if len(asked) == 1 else 2    # the first answer never ends
                        for index in range(last):
                            message = {"request_id": request["request_id"], "index": index,
                                       "token_ids": answer[2 * index:2 * index + 2], "text": ""}
                            if index == 1:
                                message["finish_reason"] = "length"
                            await client.publish(topic, encode(message), qos=1)
                        half_sent.set()
            await asyncio.sleep(0.2)

    async def restart_broker():
        await half_sent.wait()
        mosquitto.stop()
        await asyncio.sleep(0.5)
        monkeypatch.setattr(broker_helpers, "_free_port", lambda: mosquitto.port)
        return await asyncio.to_thread(broker_helpers.start_mosquitto, tmp_path)

    device_task = asyncio.create_task(answer_requests())
    await asyncio.sleep(0.5)
    restarted = asyncio.create_task(restart_broker())
    try:
        phase = drive(SimpleNamespace(broker=broker), scenario("unused", requests=1), [handle("dev-09")],
                      ["x"], [answer], lambda r: None)
        (record,) = await asyncio.wait_for(phase, 60)
    finally:
        device_task.cancel()
        await asyncio.gather(device_task, return_exceptions=True)
        (await restarted).stop()
    assert len(asked) == 2 and record.attempts == 2
    assert record.error is None and record.token_ids == answer and record.lossless is True
