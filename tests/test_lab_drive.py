"""lab.drive and lab.oracle: the lab's requests reach real devices (a real server, a real device
daemon, a real Mosquitto) over MQTT and over the OpenAI API, come back as the target's own greedy
output, and are counted, spaced and sent again as a scenario says."""
from __future__ import annotations

import asyncio
import random
import contextlib
import json
from dataclasses import dataclass
from types import SimpleNamespace

import aiomqtt
import pytest

from edge_client.daemon import Device
from edge_client.mqtt import DeviceMqtt
from edge_client.openai_api import start_api
from edge_client.settings import DeviceSettings
from lab.drive import Attempt, RequestRecord, drive, judge
from lab.drive_mqtt import MqttSender
from lab.oracle import Difference, compare, greedy_references, load_target
from verify_server.flags import served_settings
from sled.backoff import Backoff
from sled.wire.topics import decode, encode
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
        target=target, served_target=lambda: target, via=via, requests=requests,
        duration_s=duration_s, max_tokens=MAX_TOKENS,
        arrivals=SimpleNamespace(mode=mode, rate_per_s=rate),
        sampling=SimpleNamespace(temperature=temperature, top_p=1.0, top_k=0, seed=7,
                                 greedy=temperature == 0.0))


# -- compare and judge ----------------------------------------------------------------------
@pytest.mark.parametrize("received, want", [
    ([1, 2, 3, 4], (0, 0, 0)),
    ([1, 2, 4], (1, 0, 0)),              # a token lost
    ([1, 2, 2, 3, 4], (0, 1, 0)),        # a token twice
    ([1, 2, 3, 4, 3, 4], (0, 2, 0)),     # a chunk sent again
    ([1, 9, 3, 4], (0, 0, 1)),           # a wrong token: differing, neither lost nor extra
    ([1, 9, 8, 3, 4], (0, 1, 1)),        # two in place of one: one differs, one is extra
    ([], (4, 0, 0)),
])
def test_compare_counts_lost_duplicated_and_differing_tokens(received, want):
    assert compare([1, 2, 3, 4], received) == Difference(*want)


def test_an_answer_cut_short_does_not_count_its_missing_tail_as_lost():
    assert compare([1, 2, 3, 4], [1, 2], complete=False) == Difference(0, 0, 0)
    assert compare([1, 2, 3, 4], [1, 2], complete=True) == Difference(2, 0, 0)
    assert compare([1, 2, 3, 4], [1, 2, 2], complete=False) == Difference(0, 0, 1)
    assert compare([1, 2, 3, 4], [1, 3], complete=False) == Difference(1, 0, 0)


def record_of(token_ids, complete: bool, error: str | None = None) -> RequestRecord:
    return RequestRecord("dev-00", "pi5", "wifi", "ngram", "sled", 1, 0, 0.0, token_ids=token_ids,
                         complete=complete, error=error)


@pytest.mark.parametrize("token_ids, complete, error, lossless", [
    ([1, 2, 3], True, None, True),
    ([1, 2, 4], True, None, False),          # complete and different: a violation
    ([1, 2], True, None, False),             # finished early: a violation
    ([1, 2], False, "timeout", None),        # cut short, right so far: not judged
    ([], False, "no verify server", None),
    ([1, 3], False, "timeout", False),       # cut short and already different: a violation
])
def test_only_tokens_that_differ_from_the_reference_are_a_violation(token_ids, complete, error, lossless):
    record = record_of(token_ids, complete, error)
    judge(record, [1, 2, 3], greedy=True)
    assert record.lossless is lossless and record.error == error


def test_sampled_records_are_not_judged():
    record = record_of([7], True)
    judge(record, [1, 2, 3], greedy=False)
    assert record.lossless is None and (record.lost_tokens, record.differing_tokens) == (0, 0)


@pytest.mark.parametrize("args, dtype, context", [
    (None, "float32", None), ([], "float32", None), (["--dtype", "bfloat16"], "bfloat16", None),
    (["--max-sessions", "4", "--dtype=float16", "--context-length", "64"], "float16", 64)])
def test_the_references_use_the_settings_the_server_is_given(args, dtype, context):
    settings = served_settings("tiny", args)
    assert (settings.model, settings.dtype, settings.context_length) == ("tiny", dtype, context)


def test_the_servers_settings_come_from_its_config_file_and_environment(tmp_path, monkeypatch):
    config = tmp_path / "serve.toml"
    config.write_text('dtype = "float16"\ncontext_length = 128\n')
    monkeypatch.setenv("SLED_SERVE_DEVICE", "meta")
    settings = served_settings("tiny", ["--config", str(config), "--context-length", "96"])
    assert (settings.dtype, settings.device, settings.context_length) == ("float16", "meta", 96)


def test_server_flags_sled_serve_refuses_are_one_line():
    with pytest.raises(ValueError, match="server.args: .*--no-such-flag"):
        served_settings("tiny", ["--no-such-flag"])


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
    control = DeviceMqtt(device, backoff=Backoff(0.1, most=0.5, jitter=0.2, after_refusal=30.0))
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
        assert record.complete is True
        assert (record.lost_tokens, record.duplicated_tokens, record.differing_tokens) == (0, 0, 0)
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
async def say_online(client, device_id: str) -> None:
    """The retained status a device publishes once it has subscribed to its requests."""
    await client.publish(f"sled/devices/{device_id}/status", encode({"id": device_id, "online": True}),
                         qos=1, retain=True)


@contextlib.asynccontextmanager
async def flaky_device(broker, device_id: str, answer: list[int], failures: int, skip: int | None = None):
    """Answers its first FAILURES requests "unavailable", then streams ANSWER in chunks of two,
    the first chunk twice (as a QoS 1 redelivery would); SKIP: a chunk index it leaves out of its
    first answer."""
    asked: list[dict] = []

    async def serve() -> None:
        async with broker.client(f"flaky-{device_id}") as client:
            await client.subscribe(f"sled/devices/{device_id}/requests", qos=1)
            await say_online(client, device_id)
            ready.set()
            async for message in client.messages:
                request = decode(message.payload)
                asked.append(request)
                await respond(client, request, len(asked) <= failures, skip if len(asked) == 1 else None)

    async def respond(client, request: dict, fail: bool, skip: int | None) -> None:
        topic = f"sled/devices/{device_id}/responses/{request['request_id']}"
        if fail:
            await client.publish(topic, encode({"request_id": request["request_id"], "kind": "unavailable",
                                                "error": "no verify server"}), qos=1)
            return
        pieces = [answer[i:i + 2] for i in range(0, len(answer), 2)]
        for index in [0, *(i for i in range(len(pieces)) if i != skip)]:
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
    assert "no verify server" in record.error and record.complete is False
    assert record.lossless is None            # a failure, not a wrong output: reported as an error
    assert (record.lost_tokens, record.duplicated_tokens, record.differing_tokens) == (0, 0, 0)


async def test_an_answer_missing_a_chunk_times_out_and_is_sent_again(mosquitto, monkeypatch):  # noqa: F811
    import lab.drive as drive_module

    monkeypatch.setattr(drive_module, "STALL_TIMEOUT_S", 1.0)
    monkeypatch.setattr(drive_module, "RETRY_PAUSE_S", 0.1)
    answer = [5, 6, 7, 8, 9]
    fleet = SimpleNamespace(broker=mosquitto.broker())
    async with flaky_device(fleet.broker, "dev-06", answer, failures=0, skip=1) as asked:
        (record,) = await drive(fleet, scenario("unused", requests=1), [handle("dev-06")], ["x"],
                                [answer], lambda record: None)
    assert len(asked) == 2 and asked[0]["request_id"] != asked[1]["request_id"]
    assert record.attempts == 2 and record.error is None and record.complete is True
    assert record.token_ids == answer and record.lossless is True and record.missing_chunks == []


async def test_a_missing_chunk_is_named_when_every_answer_lacks_it(mosquitto):  # noqa: F811
    from lab.drive_mqtt import Pending

    pending = Pending(lambda: 0.0)
    for index, tokens in ((0, [1]), (2, [3])):
        pending.take({"request_id": "r", "index": index, "token_ids": tokens, "finish_reason": "length"}
                     if index == 2 else {"request_id": "r", "index": index, "token_ids": tokens})
    assert not pending.done.done()
    pending.fail("timeout", "no next chunk")
    attempt = pending.done.result()
    assert attempt.missing_chunks == [1] and attempt.complete is False and attempt.kind == "timeout"
    assert attempt.token_ids == [1, 3]


async def test_a_request_waits_until_its_device_is_online(mosquitto):  # noqa: F811
    broker = mosquitto.broker()
    async with MqttSender(broker, "sled", lambda: 0.0, {}, online_s=0.5) as sender:
        attempt = await sender.send(handle("dev-nobody"), "x")
    assert attempt.kind == "offline" and "dev-nobody" in attempt.error and not attempt.complete


async def test_a_malformed_message_is_dropped_and_the_listener_keeps_going(mosquitto):  # noqa: F811
    broker = mosquitto.broker()
    answer = [4, 5]
    from lab.drive_mqtt import Pending

    async with flaky_device(broker, "dev-05", answer, failures=0):
        async with MqttSender(broker, "sled", lambda: 0.0, {"max_tokens": 2}) as sender:
            sender.pending["x"] = Pending(lambda: 0.0)       # a chunk for it has a bad index
            async with broker.client("noise") as noise:
                for payload in (b"not json", b"[1]", encode({"request_id": "x", "index": "one"})):
                    await noise.publish("sled/devices/dev-05/responses/x", payload, qos=1)
            attempt = await asyncio.wait_for(sender.send(handle("dev-05"), "x"), 30)
            assert sender._task is not None and not sender._task.done()
    assert attempt.error is None and attempt.token_ids == answer and attempt.complete


@pytest.fixture
def unclean_disconnects(monkeypatch):
    """aiomqtt as it behaves when paho reports a connection's end as unclean: leaving
    `async with client` raises MqttCodeError("Unexpected disconnection") in place of the error or
    cancel it was handed (seen with a cancel racing the broker's side of the disconnect)."""
    from aiomqtt.exceptions import MqttCodeError

    plain_exit = aiomqtt.Client.__aexit__

    async def unclean_exit(self, exc_type, exc, tb):
        await plain_exit(self, exc_type, exc, tb)
        raise MqttCodeError(7, "Unexpected disconnection")

    monkeypatch.setattr(aiomqtt.Client, "__aexit__", unclean_exit)


async def test_a_cancelled_listener_ends_even_when_its_disconnect_is_unclean(mosquitto, unclean_disconnects):  # noqa: F811
    """The cancel must not be taken for a lost broker: before sled.mqtt.Client kept it a cancel,
    the listener reconnected and leaving MqttSender waited until the suite's time-out."""
    from sled.mqtt import MqttConnection

    broker = mosquitto.broker()
    sender = MqttSender(broker, "sled", lambda: 0.0, {})
    await asyncio.wait_for(sender.__aenter__(), 10)
    await asyncio.wait_for(sender.__aexit__(None, None, None), 10)
    connection = MqttConnection(broker, "sled-server-x", "sled/servers/x", will={"online": False})
    task = asyncio.create_task(connection.run(lambda client: asyncio.Event().wait()))
    for _ in range(100):
        if connection.connected:
            break
        await asyncio.sleep(0.05)
    assert connection.connected
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=10)
    assert done and task.cancelled()


@pytest.mark.parametrize("outcome", ["result", "error"])
async def test_a_cancel_landing_as_an_mqtt_step_completes_is_kept(outcome):
    """aiomqtt waits for each step with asyncio.wait_for, which before Python 3.12 drops a cancel
    that lands as the step completes: the announcer and the device's telemetry then publish on
    after their clean stop, and sled serve's shutdown waits forever. sled.mqtt.Client keeps it."""
    from sled.mqtt import Client

    client = Client("127.0.0.1", 1)        # never connected: only its waiting is used
    step = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(client._wait_for(step, timeout=5))
    await asyncio.sleep(0)
    if outcome == "result":
        step.set_result("published")       # the step completes ...
    else:
        step.set_exception(aiomqtt.MqttError("refused"))
    waiting.cancel()                       # ... and the cancel lands before the waiter runs
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_a_connection_that_publishes_without_pause_stops_every_time(mosquitto):  # noqa: F811
    """The same at the top: with aiomqtt's own waiting, about half of these stops never ended."""
    from sled.mqtt import MqttConnection

    async def publishing(client):
        while True:
            await client.publish("sled/test/busy", b"x", qos=1)

    for attempt in range(40):
        connection = MqttConnection(mosquitto.broker(), f"sled-busy-{attempt}", "sled/test/busy/status",
                                    will={"online": False})
        task = asyncio.create_task(connection.run(publishing))
        while not connection.connected:
            assert not task.done()
            await asyncio.sleep(0.01)
        await asyncio.sleep(random.random() * 0.03)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=10)
        assert done and task.cancelled(), f"stop {attempt} did not end"


async def test_an_mqtt_step_past_its_timeout_is_an_mqtt_error():
    from sled.mqtt import Client

    client = Client("127.0.0.1", 1)
    step = asyncio.get_running_loop().create_future()
    with pytest.raises(aiomqtt.MqttError, match="timed out"):
        await client._wait_for(step, timeout=0.05)
    assert step.cancelled()


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


async def test_a_failing_device_loop_cancels_the_others(monkeypatch):
    import lab.drive as drive_module

    cancelled = asyncio.Event()

    class Sender:
        async def send(self, handle, prompt, reference):
            if handle.slot.id == "dev-01":
                raise RuntimeError("the sender broke")
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    @contextlib.asynccontextmanager
    async def fake_sender(*args):
        yield Sender()

    monkeypatch.setattr(drive_module, "make_sender", fake_sender)
    for mode in ("closed", "poisson"):
        cancelled.clear()
        with pytest.raises(RuntimeError, match="the sender broke"):
            await asyncio.wait_for(drive(None, scenario("unused", requests=2, mode=mode, rate=50.0),
                                         [handle("dev-00"), handle("dev-01", index=1)], ["a"],
                                         [[1]], lambda record: None), 10)
        assert cancelled.is_set(), mode


@pytest.mark.slow
async def test_greedy_references_match_what_a_device_returns_on_gemma3(mosquitto):  # noqa: F811
    """The oracle and a real `sled serve --model gemma3-270m` + device agree token for token."""
    prompts = ["def fibonacci(n):", "The capital of France is"]
    references = greedy_references("gemma3-270m", prompts, 24)
    server = await start_server(load_target("gemma3-270m"), ServerSettings(kv_budget=256 << 20))
    device = Device(DeviceSettings(id="dev-00", servers=[server.address], drafter="ngram",
                                   mqtt={"host": "127.0.0.1", "port": mosquitto.port}))
    await device.start()
    control = DeviceMqtt(device, backoff=Backoff(0.1, most=0.5, jitter=0.2, after_refusal=30.0))
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

    async def answer_requests() -> None:
        """A device that reconnects later than the lab does (the daemon's backoff), subscribes
        with a clean session, then says it is online, as the daemon does."""
        while True:
            with contextlib.suppress(aiomqtt.MqttError):
                async with broker.client("restart-device") as client:
                    await client.subscribe("sled/devices/dev-09/requests", qos=1)
                    await say_online(client, "dev-09")
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
            await asyncio.sleep(2.5 if half_sent.is_set() else 0.2)    # well after the lab's resend

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


# -- the OpenAI route without a device: a stand-in API that is unavailable first ------------------
class CharTokenizer:
    """Token ids are character codes."""

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(c) for c in text])

    def decode(self, ids, **options):
        return "".join(chr(i) for i in ids)


async def test_an_unavailable_api_is_asked_again_and_its_finish_makes_the_answer_complete():
    from aiohttp import web

    calls: list[dict] = []

    async def models(request):
        return web.json_response({"object": "list", "data": [
            {"id": "m", "object": "model", "created": 0, "owned_by": "lab"}]})

    async def completions(request):
        calls.append(await request.json())
        if len(calls) == 1:
            return web.json_response({"error": {"message": "no verify server"}}, status=503)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text, finish in (("ab", None), ("c", "length")):
            chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        (record,) = await drive(None, scenario("unused", "openai", requests=1),
                                [handle("dev-00", f"http://127.0.0.1:{port}")], ["x"],
                                [[ord("a"), ord("b"), ord("c")]], lambda record: None,
                                tokenizer=CharTokenizer())
    finally:
        await runner.cleanup()
    assert len(calls) == 2 and calls[1]["max_tokens"] == MAX_TOKENS
    assert record.attempts == 2 and record.error is None and record.complete is True
    assert record.text == "abc" and record.lossless is True and record.chunks == 2
