"""HOST:PORT and MQTT topic levels: one parser and one check, the same rules on both sides (the
device's settings and announcements it hears, the server's announcer)."""
from __future__ import annotations

import pytest

from edge_client.mqtt import parse_request
from edge_client.daemon import DeviceError
from edge_client.settings import DeviceSettings
from sled.wire.endpoint import Endpoint, parse_endpoint
from sled.mqtt import Broker
from sled.wire.topics import check_topic_level, check_topic_prefix, is_topic_level
from verify_server.announce import AnnounceConfig


@pytest.mark.parametrize("text, host, port", [
    ("10.0.0.2:50051", "10.0.0.2", 50051),
    ("gpu-1.lan:1", "gpu-1.lan", 1),
    ("[::1]:65535", "[::1]", 65535),
])
def test_endpoints_parse_to_host_and_port(text, host, port):
    assert parse_endpoint(text) == Endpoint(host, port)
    assert str(parse_endpoint(text)) == text


@pytest.mark.parametrize("text, says", [
    ("gpu-1", "is not HOST:PORT"),
    (":50051", "is not HOST:PORT"),
    ("gpu-1:", "is not HOST:PORT"),
    ("gpu-1:http", "is not HOST:PORT"),
    ("gpu 1:50051", "is not HOST:PORT"),
    ("gpu-1:\u0665\u0660", "is not HOST:PORT"),      # digits, but not ASCII ones
    ("gpu-1:0", "outside 1..65535"),
    ("gpu-1:70000", "outside 1..65535"),
    (None, "is not HOST:PORT"),
    (50051, "is not HOST:PORT"),
])
def test_bad_endpoints_are_refused_naming_what_was_asked_for(text, says):
    with pytest.raises(ValueError, match=says) as err:
        parse_endpoint(text, what="server")
    assert str(err.value).startswith("server ")


@pytest.mark.parametrize("name", ["dev-1", "gpu_a.lan", "r1", "é"])
def test_topic_levels(name):
    assert is_topic_level(name) and check_topic_level(name, "id") == name


@pytest.mark.parametrize("name", ["", "a/b", "a+", "#", "a b", "a\tb", "a\0b", "a\nb", None, 7])
def test_not_topic_levels(name):
    assert not is_topic_level(name)
    with pytest.raises(ValueError, match="request_id must be"):
        check_topic_level(name, "request_id")


def test_topic_prefixes_are_levels_joined_by_slashes():
    assert check_topic_prefix("sled") == "sled" and check_topic_prefix("site-3/sled") == "site-3/sled"
    for bad in ("", "/sled", "sled/", "a//b", "sled/#", "sl+ed", "my sled"):
        with pytest.raises(ValueError, match="topic prefix"):
            check_topic_prefix(bad)


def test_device_settings_use_the_same_rules():
    settings = DeviceSettings(id="pi-1", servers=["a:1", "[::1]:2"], mqtt={"topic_prefix": "x/sled"})
    assert settings.servers == ["a:1", "[::1]:2"] and settings.mqtt.topic_prefix == "x/sled"
    for bad, key in (({"servers": ["a:0"]}, "servers"), ({"id": "pi 1"}, "id"), ({"id": "pi/1"}, "id"),
                     ({"mqtt": {"topic_prefix": "sled/+"}}, "topic_prefix")):
        with pytest.raises(ValueError, match=key):
            DeviceSettings(**bad)


def test_the_announcer_uses_the_same_rules():
    broker = Broker("127.0.0.1")
    assert AnnounceConfig(broker, "gpu-1", "[::1]:50051").endpoint == "[::1]:50051"
    for server_id, endpoint, prefix, says in (("gpu 1", "h:1", "sled", "server id"),
                                              ("gpu/1", "h:1", "sled", "server id"),
                                              ("gpu-1", "h", "sled", "announce endpoint 'h'"),
                                              ("gpu-1", "h:99999", "sled", "outside"),
                                              ("gpu-1", "h:1", "sled/#", "topic prefix")):
        with pytest.raises(ValueError, match=says):
            AnnounceConfig(broker, server_id, endpoint, topic_prefix=prefix)


def test_mqtt_request_ids_use_the_same_check():
    request = parse_request({"request_id": "r-1", "prompt_ids": [5]}, tokenizer=None)
    assert request.request_id == "r-1"
    for bad in ("r 1", "r/1", "", 3):
        with pytest.raises(DeviceError, match="request_id"):
            parse_request({"request_id": bad, "prompt_ids": [5]}, tokenizer=None)
