"""lab.scrape: Prometheus pages of a real server and device read into numbers, and a Sampler whose
phase totals are the forward passes and drafts that really happened."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from edge_client.daemon import Device, Request
from edge_client.openai_api import start_api
from edge_client.settings import DeviceSettings
from lab.oracle import load_target
from lab.scrape import (Sampler, Totals, batch_buckets, forward_passes, kv_blocks, parse_metrics,
                        per_bucket, positions, read_metrics, value)
from lab.server_process import free_port
from tests.conftest import PROMPT_TEXTS
from verify_server.server import start_server
from verify_server.settings import ServerSettings

PAGE = """# TYPE sled_forward_passes counter
sled_forward_passes_total 7.0
# TYPE sled_batch_size histogram
sled_batch_size_bucket{le="1.0"} 3.0
sled_batch_size_bucket{le="2.0"} 5.0
sled_batch_size_bucket{le="+Inf"} 7.0
sled_batch_size_count 7.0
sled_batch_size_sum 12.0
# TYPE sled_device_position_drafted counter
sled_device_position_drafted_total{position="1"} 10.0
sled_device_position_drafted_total{position="2"} 8.0
# TYPE sled_errors counter
sled_errors_total{reason="a"} 1.0
sled_errors_total{reason="b"} 2.0
"""


def test_a_page_becomes_samples_by_name_and_labels():
    snapshot = parse_metrics(PAGE)
    assert forward_passes(snapshot) == 7
    assert batch_buckets(snapshot) == {"1": 3, "2": 5, "+Inf": 7}
    assert per_bucket(batch_buckets(snapshot)) == {"1": 3, "2": 2, "+Inf": 2}
    assert positions(snapshot, "sled_device_position_drafted_total") == {1: 10, 2: 8}
    assert value(snapshot, "sled_errors_total") == 3 and value(snapshot, "sled_errors_total", reason="b") == 2
    assert value(snapshot, "sled_missing") == 0


def test_totals_survive_a_restart_and_count_counters_that_appear_later():
    totals = Totals()
    totals.add({"passes": 10})               # the baseline
    totals.add({"passes": 15})
    totals.add({"passes": 4, "position:1": 3})    # restarted at zero; a new label
    totals.add({"passes": 6, "position:1": 5})
    assert totals.total == {"passes": 5 + 4 + 2, "position:1": 5}


def test_a_restart_is_told_by_the_counters_creation_time_even_when_values_go_up():
    totals = Totals()
    totals.add({"passes": 10}, created=100.0)     # the baseline
    totals.add({"passes": 15}, created=100.0)
    totals.add({"passes": 20}, created=200.0)     # restarted and already past the old value
    totals.add({"passes": 21}, created=200.0)
    assert totals.total == {"passes": 5 + 20 + 1}


def test_the_creation_time_is_read_from_the_page():
    from lab.scrape import SERVER_CREATED, created_at

    page = parse_metrics(PAGE.replace("sled_forward_passes_total 7.0",
                                      "sled_forward_passes_total 7.0\nsled_forward_passes_created 1.7e9"))
    assert created_at(page, SERVER_CREATED) == 1.7e9 and created_at(parse_metrics(PAGE), SERVER_CREATED) is None


@pytest.fixture
async def served(pair):
    """A tiny target served in-process with its /metrics on HTTP, and a device with its API."""
    server = await start_server(load_target(str(pair[0])), ServerSettings(kv_budget=64 << 20))
    port = free_port()
    http, _ = server.metrics.serve_http(port)
    device = Device(DeviceSettings(id="dev-00", servers=[server.address], drafter="ngram"))
    await device.start()
    runner, api_port = await start_api(device, "127.0.0.1", 0)
    try:
        yield SimpleNamespace(server=server, device=device, metrics_url=f"http://127.0.0.1:{port}/metrics",
                              api_url=f"http://127.0.0.1:{api_port}")
    finally:
        await runner.cleanup()
        await device.close()
        http.shutdown()
        await server.stop(grace=0)


async def test_a_real_servers_page_has_the_kv_and_batch_numbers(served):
    await served.device.complete(Request(served.device.tokenizer(PROMPT_TEXTS[0]).input_ids, max_tokens=6,
                                         ignore_eos=True))
    snapshot = await asyncio.to_thread(read_metrics, served.metrics_url)
    used, total = kv_blocks(snapshot)
    assert total > 0 and 0 <= used <= total
    assert forward_passes(snapshot) == served.server.metrics.value("sled_forward_passes_total") > 0
    assert batch_buckets(snapshot)["+Inf"] == forward_passes(snapshot)


async def test_the_sampler_counts_the_passes_and_drafts_of_its_phase(served, caplog):
    device = served.device
    await device.complete(Request(device.tokenizer(PROMPT_TEXTS[1]).input_ids, max_tokens=4))   # before
    metrics = served.server.metrics
    passes_before = metrics.value("sled_forward_passes_total")
    drafted_before = device.metrics.draft_tokens._value.get()
    slot = SimpleNamespace(id="dev-00", device="pi5", link="wifi", drafter="ngram")
    handles = [SimpleNamespace(slot=slot, api_url=served.api_url, metrics_url=served.api_url + "/metrics"),
               SimpleNamespace(slot=SimpleNamespace(**{**vars(slot), "id": "dev-gone"}), api_url="",
                               metrics_url=f"http://127.0.0.1:{free_port()}/metrics")]   # nobody there
    async with Sampler(served.metrics_url, handles, interval_s=0.2) as sampler:
        for text in PROMPT_TEXTS[2:5]:
            await device.complete(Request(device.tokenizer(text).input_ids, max_tokens=8, ignore_eos=True))
    server, devices = sampler.server(), sampler.devices()
    assert server["forward_passes"] == metrics.value("sled_forward_passes_total") - passes_before > 0
    assert sum(server["batch_sizes"].values()) == server["forward_passes"]
    assert server["forward_seconds"] > 0 and server["kv_blocks_total"] > 0
    assert server["kv_blocks_used"] and server["active_sessions"]
    assert devices["dev-00"]["drafted"] == device.metrics.draft_tokens._value.get() - drafted_before > 0
    assert devices["dev-00"]["profile"] == "pi5" and devices["dev-00"]["polls"]["ok"] >= 2
    assert devices["dev-gone"]["drafted"] is None and devices["dev-gone"]["accepted"] is None  # unknown
    assert devices["dev-gone"]["polls"]["ok"] == 0 and devices["dev-gone"]["polls"]["failed"] >= 2
    assert "dev-gone" in caplog.text and "dev-00" not in caplog.text


async def test_a_server_never_reached_reports_unknown_numbers():
    sampler = Sampler(f"http://127.0.0.1:{free_port()}/metrics", [], interval_s=0.1)
    async with sampler:
        await asyncio.sleep(0.3)
    server = sampler.server()
    assert server["forward_passes"] is None and server["forward_seconds"] is None
    assert server["polls"]["ok"] == 0 and server["polls"]["failed"] >= 2


async def test_a_large_fleet_is_read_less_often_than_its_server():
    """40 devices (none there): the server every interval, the devices every third one (16 a
    read), plus the first and the last read of the phase."""
    from lab.scrape import DEVICES_PER_POLL

    slots = [SimpleNamespace(id=f"dev-{i:02d}", device="pi5", link="wifi", drafter="ngram")
             for i in range(40)]
    nobody = f"http://127.0.0.1:{free_port()}/metrics"
    handles = [SimpleNamespace(slot=slot, api_url="", metrics_url=nobody) for slot in slots]
    sampler = Sampler(nobody, handles, interval_s=0.05)
    async with sampler:
        await asyncio.sleep(1.5)
    ticks = sampler.polls["server"]["failed"] - 2
    assert DEVICES_PER_POLL == 16 and ticks >= 3
    assert all(sampler.polls[slot.id]["failed"] == 2 + ticks // 3 for slot in slots)
