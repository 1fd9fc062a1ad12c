"""The MQTT control plane against a real Mosquitto: retained status and last will, telemetry,
live config, generation requests, server announcements, refused credentials, and failover
between two announced servers with a mismatched one never chosen."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket

import aiomqtt
import pytest
import grpc

from drafters.hf import HFDrafter
from edge_client.daemon import Device, DeviceError, Request
from edge_client.mqtt import DeviceMqtt, parse_request
from edge_client.settings import DeviceSettings
from edge_client.wire import SessionRequest, open_message
from sled.backoff import Backoff
from sled.wire.sampling import Sampling
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc
from tests.conftest import PROMPT_TEXTS, greedy_reference
from tests.mqtt_broker import (Mosquitto, Watcher, eventually, mosquitto,  # noqa: F401
                                mosquitto_tls, mosquitto_with_passwords)
from verify_server.announce import AnnounceConfig, Announcer

DEVICE = "dev-1"


def topic(leaf: str, device_id: str = DEVICE) -> str:
    return f"sled/devices/{device_id}/{leaf}"


def quick_backoff() -> Backoff:
    return Backoff(0.1, most=0.5, jitter=0.2, after_refusal=0.5)


def mqtt_device(broker: Mosquitto, servers, drafter_model, tokenizer, device_id: str = DEVICE,
                settings: dict | None = None, **mqtt) -> Device:
    mqtt = {"host": "127.0.0.1", "port": broker.port, "keepalive_s": 2, "telemetry_s": 0.2, **mqtt}
    config = DeviceSettings(id=device_id, servers=list(servers), mqtt=mqtt, **(settings or {}))
    return Device(config, load_drafter=lambda spec: HFDrafter(drafter_model, tokenizer, name=spec),
                  tokenizer=tokenizer)


@contextlib.asynccontextmanager
async def connected_until_the_end(runner):
    """runner.run() as a task, cancelled (a clean stop) at the end; yields its MQTT connection."""
    task = asyncio.create_task(runner.run())
    try:
        yield runner.connection
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def running(device: Device):
    """The device started with its control plane, whose MQTT connection it yields; a clean stop
    (offline status) at the end."""
    await device.start()
    try:
        async with connected_until_the_end(DeviceMqtt(device, backoff=quick_backoff())) as connection:
            yield connection
    finally:
        await device.close()


def announcing(server, broker: Mosquitto, server_id: str, **options):
    """The server announced until the end; yields the announcer's MQTT connection."""
    return connected_until_the_end(Announcer(server.service, AnnounceConfig(
        broker.broker(**options), server_id, server.address, interval_s=0.2, backoff=quick_backoff())))


def sever(client: aiomqtt.Client) -> None:
    """End a client's connection without DISCONNECT, as a crash or a pulled cable would: the
    broker must publish its last will."""
    client._client.socket().shutdown(socket.SHUT_RDWR)


def online(payload) -> bool:
    return bool(payload) and payload.get("online") is True


def offline(payload) -> bool:
    return bool(payload) and payload.get("online") is False


async def collect(watcher: Watcher, request_id: str) -> list[dict]:
    """Every response message of one request, once its last one arrived, in index order."""
    where = f"sled/devices/{DEVICE}/responses/{request_id}"
    await watcher.wait_for(where, lambda m: "finish_reason" in m or "error" in m)
    return sorted((s.payload for s in watcher.seen if s.topic == where), key=lambda m: m.get("index", 0))


async def test_status_is_retained_and_the_last_will_says_offline(serve, models, drafter_models,
                                                                  tokenizer, mosquitto):
    server = await serve(models["llama"])
    device = mqtt_device(mosquitto, [server.address], drafter_models["llama"], tokenizer)
    async with running(device) as control:
        await eventually(lambda: control.connected, what="the MQTT connection")
        async with Watcher(mosquitto.broker(), topic("status")) as late:   # joins after: retained
            seen = await late.wait_for(topic("status"), online)
            assert seen.retain and seen.payload["id"] == DEVICE and seen.payload["state"] == "ready"
            assert seen.payload["mqtt"]["connected"] and seen.payload["servers"][0]["endpoint"] == server.address

            mark = late.mark()
            sever(control.client)
            will = await late.wait_for(topic("status"), offline, since=mark)
            assert will.payload["state"] == "offline" and "lost its MQTT connection" in will.payload["reason"]
            back = await late.wait_for(topic("status"), online, since=late.mark())
            assert back.payload["state"] == "ready"
    async with Watcher(mosquitto.broker(), topic("status")) as after:   # a clean stop says so too
        seen = await after.wait_for(topic("status"))
    assert seen.retain and seen.payload == {"id": DEVICE, "online": False, "state": "offline",
                                            "reason": "the device stopped"}


async def test_telemetry_reports_speed_acceptance_rtt_sessions_and_load(serve, models, drafter_models,
                                                                          tokenizer, prompts, mosquitto):
    server = await serve(models["llama"])
    device = mqtt_device(mosquitto, [server.address], drafter_models["llama"], tokenizer)
    async with running(device), Watcher(mosquitto.broker(), topic("telemetry")) as watcher:
        await device.complete(Request(prompts[0], max_tokens=12, ignore_eos=True))
        mark = watcher.mark()       # a report sent during the generation would count the session
        seen = await watcher.wait_for(topic("telemetry"), lambda m: m.get("acceptance") is not None,
                                      since=mark)
    telemetry = seen.payload
    assert telemetry["drafter"] == device.settings.drafter and telemetry["state"] == "ready"
    assert telemetry["tokens_per_s"] > 0 and 0 <= telemetry["acceptance"] <= 1 and telemetry["rtt_ms"] > 0
    assert telemetry["active_sessions"] == 0 and "cpu_load" in telemetry and telemetry["time"] > 0
    assert not seen.retain


async def test_live_config_is_applied_and_echoed_and_a_bad_one_changes_nothing(
        serve, models, drafter_models, tokenizer, prompts, mosquitto):
    server = await serve(models["llama"])
    device = mqtt_device(mosquitto, [server.address], drafter_models["llama"], tokenizer)
    applied = topic("config/applied")
    async with running(device) as control, Watcher(mosquitto.broker(), applied) as watcher:
        await eventually(lambda: control.connected, what="the MQTT connection")
        mark = watcher.mark()
        await watcher.publish(topic("config"), json.dumps({"policy": {"draft_len": 3, "pipeline": False}}))
        echo = (await watcher.wait_for(applied, since=mark)).payload
        assert echo["ok"] is True and echo["policy"]["draft_len"] == 3 and echo["id"] == DEVICE
        assert device.settings.policy.draft_len == 3 and device.settings.policy.pipeline is False

        for bad, says in ((b'{"policy": {"draft_len": 0}}', "policy.draft_len"),
                          (b'{"port": 9}', "cannot change while running"),
                          (b"draft_len=4", "not JSON")):
            mark = watcher.mark()
            await watcher.publish(topic("config"), bad)
            echo = (await watcher.wait_for(applied, since=mark)).payload
            assert echo["ok"] is False and says in echo["error"], echo
        assert device.settings.policy.draft_len == 3 and device.settings.port == 8000

        tokens, _, _ = await device.complete(Request(prompts[1], max_tokens=10, ignore_eos=True))
        assert tokens == greedy_reference(models["llama"], prompts[1], 10)
        async with Watcher(mosquitto.broker(), applied) as late:   # errors are not retained
            retained = await late.wait_for(applied)
        assert retained.retain and retained.payload["ok"] is True and retained.payload["policy"]["draft_len"] == 3


async def test_requests_stream_the_targets_greedy_output_and_bad_ones_get_errors(
        serve, models, drafter_models, tokenizer, prompts, mosquitto):
    server = await serve(models["llama"])
    device = mqtt_device(mosquitto, [server.address], drafter_models["llama"], tokenizer)
    async with running(device) as control, Watcher(mosquitto.broker(), topic("responses/#")) as watcher:
        await eventually(lambda: control.connected, what="the MQTT connection")
        await watcher.publish(topic("requests"), json.dumps(
            {"request_id": "r1", "prompt": PROMPT_TEXTS[0], "max_tokens": 16, "ignore_eos": True}))
        await watcher.publish(topic("requests"), json.dumps(
            {"request_id": "r2", "prompt_ids": prompts[1], "max_tokens": 12, "ignore_eos": True,
             "temperature": 0, "stop_ids": []}))
        for request_id, prompt, n in (("r1", prompts[0], 16), ("r2", prompts[1], 12)):
            messages = await collect(watcher, request_id)
            tokens = [t for m in messages for t in m["token_ids"]]
            assert tokens == greedy_reference(models["llama"], prompt, n)
            assert [m["index"] for m in messages] == list(range(len(messages)))
            assert "".join(m["text"] for m in messages) == tokenizer.decode(tokens, skip_special_tokens=True)
            last = messages[-1]
            assert last["finish_reason"] == "length" and last["lossless"] is True
            assert last["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n,
                                     "total_tokens": len(prompt) + n}

        for payload, where, says in (
                (b"{not json", "invalid", "not JSON"),
                (json.dumps({"prompt_ids": [5, 6]}), "invalid", "request_id"),
                (json.dumps({"request_id": "r3", "max_tokens": 4}), "r3", "exactly one of prompt"),
                (json.dumps({"request_id": "r4", "prompt_ids": [10**7]}), "r4", "outside the vocabulary"),
                (json.dumps({"request_id": "r5", "prompt": "x", "temperature": "hot"}), "r5", "temperature"),
                (json.dumps({"request_id": "r6", "prompt": "x", "colour": 1}), "r6", "unknown field colour")):
            mark = watcher.mark()
            await watcher.publish(topic("requests"), payload)
            seen = await watcher.wait_for(topic(f"responses/{where}"), lambda m: "error" in m, since=mark)
            assert seen.payload["kind"] == "invalid" and says in seen.payload["error"], seen.payload

        mark = watcher.mark()       # a huge id that cannot be a topic is not echoed whole
        await watcher.publish(topic("requests"), json.dumps({"request_id": {"x": "y" * 200_000},
                                                             "prompt": "x"}))
        seen = await watcher.wait_for(topic("responses/invalid"), lambda m: "error" in m, since=mark)
        assert "request_id" in seen.payload["error"] and len(json.dumps(seen.payload)) < 1000

        await watcher.publish(topic("requests"), json.dumps(
            {"request_id": "r7", "prompt_ids": prompts[2], "max_tokens": 5, "ignore_eos": True}))
        tokens = [t for m in await collect(watcher, "r7") for t in m["token_ids"]]
        assert tokens == greedy_reference(models["llama"], prompts[2], 5)


async def test_announced_servers_join_the_directory_and_leave_it(serve, models, drafter_models,
                                                                  tokenizer, prompts, mosquitto):
    server = await serve(models["llama"], model_id="tiny-a")
    device = mqtt_device(mosquitto, [], drafter_models["llama"], tokenizer, settings={"reconnect_s": 2})
    async with running(device) as control:
        assert device.state == "waiting"
        async with announcing(server, mosquitto, "gpu-a"):
            await eventually(lambda: device.state == "ready", what="the device using the announced server")
            (entry,) = device.status()["servers"]
            assert entry["id"] == "gpu-a" and entry["endpoint"] == server.address and entry["source"] == "mqtt"
            assert entry["model"] == "tiny-a" and entry["online"] and "gpu-a" in device.reason
            tokens, _, lossless = await device.complete(Request(prompts[2], max_tokens=8, ignore_eos=True))
            assert tokens == greedy_reference(models["llama"], prompts[2], 8) and lossless
        # the announcer stopped cleanly: its retained announcement now says offline
        await eventually(lambda: not device.directory.servers[server.address].online, what="withdrawal")
        await eventually(lambda: device.state == "waiting", what="the device waiting again")

        async with Watcher(mosquitto.broker(), "sled/servers/#") as publisher:
            await publisher.publish("sled/servers/junk", b"not json", retain=True)
            await publisher.publish("sled/servers/noaddr", json.dumps({"id": "noaddr"}), retain=True)
            await publisher.publish("sled/servers/gpu-z", json.dumps(
                {"id": "gpu-z", "endpoint": "127.0.0.1:1", "load": 0.5, "online": True}), retain=True)
            await eventually(lambda: "127.0.0.1:1" in device.directory.servers, what="gpu-z announced")
            assert device.directory.servers["127.0.0.1:1"].online
            await publisher.publish("sled/servers/gpu-z", b"", retain=True)   # cleared: withdrawn
            await eventually(lambda: not device.directory.servers["127.0.0.1:1"].online, what="gpu-z cleared")
            for junk in ("junk", "noaddr"):
                await publisher.publish(f"sled/servers/{junk}", b"", retain=True)
        assert control.connected and len(device.directory.servers) == 2


async def test_refused_credentials_are_reported_and_the_device_keeps_serving(
        serve, models, drafter_models, tokenizer, prompts, mosquitto_with_passwords, caplog):
    broker = mosquitto_with_passwords
    server = await serve(models["llama"])
    device = mqtt_device(broker, [server.address], drafter_models["llama"], tokenizer,
                         username="device", password="wrong")
    caplog.set_level(logging.WARNING)
    async with running(device) as control:
        await eventually(lambda: "refused the credentials" in control.problem, what="the refusal")
        problem = device.status()["mqtt"]["problem"]
        assert f"127.0.0.1:{broker.port}" in problem and "user 'device'" in problem
        assert device.status()["mqtt"]["connected"] is False and device.state == "ready"
        tokens, _, lossless = await device.complete(Request(prompts[3], max_tokens=8, ignore_eos=True))
        assert tokens == greedy_reference(models["llama"], prompts[3], 8) and lossless
        assert any("refused the credentials" in r.getMessage() for r in caplog.records)

    good = mqtt_device(broker, [server.address], drafter_models["llama"], tokenizer, device_id="dev-2",
                       username="device", password="s3cret")
    async with running(good) as control:
        await eventually(lambda: control.connected, what="a connection with the right password")

    async with announcing(server, broker, "gpu-a", username="device", password="nope") as announcer:
        await eventually(lambda: "refused the credentials" in announcer.problem, what="the server's refusal")


async def test_tls_uses_the_configured_ca_and_says_when_the_certificate_is_not_trusted(
        serve, models, drafter_models, tokenizer, mosquitto_tls, tmp_path):
    broker = mosquitto_tls
    server = await serve(models["llama"])
    trusting = mqtt_device(broker, [server.address], drafter_models["llama"], tokenizer,
                           tls=True, ca_file=str(tmp_path / "ca.crt"))
    async with running(trusting) as control:
        await eventually(lambda: control.connected, what="a TLS connection")
        async with Watcher(broker.broker(ca_file=str(tmp_path / "ca.crt")), topic("status")) as watcher:
            assert (await watcher.wait_for(topic("status"), online)).retain

    doubting = mqtt_device(broker, [server.address], drafter_models["llama"], tokenizer, device_id="dev-2",
                           tls=True)                         # system CAs: the test CA is unknown
    async with running(doubting) as control:
        await eventually(lambda: "certificate verify failed" in control.problem, what="the TLS refusal")
        assert f"127.0.0.1:{broker.port}" in control.problem and doubting.state == "ready"


async def hold_session(address: str, prompt: list[int]):
    """An open session on a server (load for its announcements); cancel the call to end it."""
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.VerifierStub(channel)
    info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    call = stub.Generate()
    await call.write(open_message(SessionRequest(prompt, 64, Sampling(),
                                                 fingerprint=info.tokenizer_fingerprint,
                                                 drafter="holder")))
    await call.read()
    return channel, call


async def three_servers(models, tokenizer) -> dict:
    """a and b serve the same target (b allows 8 sessions); odd's target has another tokenizer."""
    from lab.tiny import make_model, make_tokenizer
    from verify_server.settings import ServerSettings
    from verify_server.server import start_server
    from verify_server.target import Target

    other_tokenizer = make_tokenizer(vocab_size=300)
    return {
        "a": await start_server(Target.from_model(models["llama"], tokenizer, "tiny"),
                                ServerSettings(kv_budget=64 << 20)),
        "b": await start_server(Target.from_model(models["llama"], tokenizer, "tiny"),
                                ServerSettings(kv_budget=64 << 20, max_sessions=8)),
        "odd": await start_server(Target.from_model(make_model("llama", len(other_tokenizer)),
                                                    other_tokenizer, "other"),
                                  ServerSettings(kv_budget=16 << 20)),
    }


async def test_failover_between_announced_servers_stays_lossless(drafter_models, models, tokenizer,
                                                                 prompts, mosquitto):
    """Two servers with the same target and one with another tokenizer announce themselves; the
    device picks the least loaded compatible one; when it vanishes mid-generation every request
    finishes on the other with the target's greedy output; the mismatched one is never used."""
    servers = await three_servers(models, tokenizer)
    channel, held = await hold_session(servers["b"].address, prompts[5])   # b: load 1/8
    device = mqtt_device(mosquitto, [], drafter_models["llama"], tokenizer,
                         settings={"reconnect_s": 20, "policy": {"draft_len": 2}})
    try:
        async with running(device), contextlib.AsyncExitStack() as stack:
            announcers = {name: await stack.enter_async_context(announcing(server, mosquitto, f"gpu-{name}"))
                          for name, server in servers.items()}
            directory = device.directory
            await eventually(lambda: len(directory.servers) == 3 and device.state == "ready"
                             and directory.servers[servers["b"].address].load > 0, what="three announced")
            assert "does not match" in directory.servers[servers["odd"].address].problem
            assert directory.pick().id == "gpu-a"   # least loaded compatible
            address_a = servers["a"].address

            started, done_early = asyncio.Event(), []
            streaming: set[int] = set()

            async def generate(i: int, prompt: list[int]) -> list[int]:
                tokens = []
                async for chunk in device.stream(Request(prompt, max_tokens=48, ignore_eos=True)):
                    tokens += chunk.token_ids
                    streaming.add(i)
                    if len(streaming) == 4:
                        started.set()
                    if chunk.finish_reason and not started.is_set():
                        done_early.append(i)
                return tokens

            requests = [asyncio.create_task(generate(i, p)) for i, p in enumerate(prompts[:4])]
            await asyncio.wait_for(started.wait(), 60)
            assert servers["a"].metrics.value("sled_sessions_total") == 4 and not done_early
            sever(announcers["a"].client)           # gpu-a's link dies: its last will fires ...
            await servers.pop("a").stop(grace=0)    # ... and so does the server
            outputs = await asyncio.wait_for(asyncio.gather(*requests), 120)

            for prompt, tokens in zip(prompts, outputs):
                assert tokens == greedy_reference(models["llama"], prompt, 48)
            assert device.metrics.value("sled_device_resumes_total") >= 1
            assert servers["b"].metrics.value("sled_sessions_total") >= 2   # the held one + resumed
            assert servers["odd"].metrics.value("sled_sessions_total") == 0
            assert not directory.servers[address_a].online
            assert "gpu-b" in device.reason
    finally:
        held.cancel()
        await channel.close()
        for server in servers.values():
            await server.stop(grace=0)


async def test_sled_serve_announces_itself_and_says_offline_when_stopped(pair, mosquitto):
    """`sled serve --mqtt-host ...` as a person runs it: a retained announcement, then offline."""
    import signal

    from lab.server_process import ServerProcess

    target_dir, _ = pair
    announcement = "sled/servers/gpu-cli"
    async with Watcher(mosquitto.broker(), "sled/servers/#") as watcher:
        async with ServerProcess(str(target_dir), "--dtype", "float64", "--mqtt-host", "127.0.0.1",
                                 "--mqtt-port", str(mosquitto.port), "--server-id", "gpu-cli",
                                 "--announce-interval", "0.3") as server:
            seen = await watcher.wait_for(announcement, online, timeout=60)
            assert seen.payload["endpoint"] == server.address and seen.payload["fingerprint"].startswith("sha256:")
            assert seen.payload["load"] == 0 and seen.payload["sessions"] == 0 and seen.payload["model"]
            mark = watcher.mark()
            server.proc.send_signal(signal.SIGINT)            # a clean stop says offline itself
            gone = await watcher.wait_for(announcement, offline, since=mark, timeout=30)
            assert gone.payload == {"id": "gpu-cli", "online": False}


@pytest.mark.parametrize("field, value, says", [
    ("temperature", 10**400, "temperature must be a finite number"),    # float() overflows
    ("top_p", 10**400, "top_p must be a finite number"),
    ("temperature", float("inf"), "temperature must be a finite number"),  # JSON 1e400
    ("top_p", float("nan"), "top_p must be a finite number"),            # JSON NaN
    ("temperature", "\x1b[2J" + "x" * 10_000, "temperature must be a number"),
    ("max_tokens", ["\n"] * 10_000, "max_tokens must be an integer"),
    ("ignore_eos", "y" * 10_000, "ignore_eos must be true or false"),
    ("\x1b[2J" + "z" * 10_000, 1, "unknown field"),
])
def test_a_request_s_bad_values_are_invalid_and_quoted_short(field, value, says):
    """Each is refused as invalid (not an internal error), and what the asker sent comes back
    escaped onto one short line, not echoed whole."""
    with pytest.raises(DeviceError) as refused:
        parse_request({"request_id": "r1", "prompt_ids": [5], field: value}, None)
    assert refused.value.kind == "invalid" and says in refused.value.message
    assert refused.value.message.isprintable() and len(refused.value.message) < 400, refused.value.message


def test_many_unknown_fields_are_named_in_a_bounded_message():
    message = {"request_id": "r1", "prompt_ids": [5], **{f"field{i:05}": 1 for i in range(10_000)}}
    with pytest.raises(DeviceError) as refused:
        parse_request(message, None)
    assert refused.value.kind == "invalid" and "field00000" in refused.value.message
    assert len(refused.value.message) < 1000
