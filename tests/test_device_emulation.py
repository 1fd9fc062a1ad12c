"""The device daemon as the lab runs it: centralized mode, a board's drafting speed, a user-space
link that can be cut mid-request, per-position acceptance metrics, and the status saying so."""
from __future__ import annotations

import asyncio

import pytest

from drafters.hf import HFDrafter
from edge_client.daemon import Device, Request
from edge_client.emulation import PacedDrafter
from edge_client.settings import LIVE_KEYS, DeviceSettings, SettingsError, load_settings
from lab.profiles import DEVICES, device_profile
from sled.wire.sampling import Sampling
from tests.conftest import greedy_reference

SLOW_BOARD = "instant:draft_ms_per_token=25,round_overhead_ms=5"


def make_device(server, drafter_model, tokenizer, **settings) -> Device:
    settings = DeviceSettings(id="lab-device", servers=[server.address], **settings)
    return Device(settings, load_drafter=lambda spec: HFDrafter(drafter_model, tokenizer, name=spec),
                  tokenizer=tokenizer)


@pytest.fixture
async def device(serve, models, drafter_models, tokenizer):
    """device(**settings) -> a started device against a served tiny llama target."""
    server = await serve(models["llama"])
    started = []

    async def start(**settings) -> Device:
        made = make_device(server, drafter_models["llama"], tokenizer, **settings)
        await made.start()
        assert made.state == "ready", made.reason
        started.append(made)
        return made

    yield start
    for made in started:
        await made.close()


def test_settings_take_mode_and_emulation_from_flags_and_variables(monkeypatch):
    monkeypatch.setenv("SLED_DEVICE_EMULATION__DEVICE", "pi5")
    monkeypatch.setenv("SLED_DEVICE_EMULATION__LINK_DOWN", "true")
    settings = load_settings(args=["--mode", "server", "--emulation.link", "wifi:rtt_ms=20"])
    assert settings.mode == "server"
    assert (settings.emulation.device, settings.emulation.link) == ("pi5", "wifi:rtt_ms=20")
    assert settings.emulation.link_down is True
    assert {"mode", "emulation"} <= LIVE_KEYS
    assert load_settings().emulation.device == "pi5"      # the variables alone


def test_bad_profiles_and_modes_name_their_key(monkeypatch):
    with pytest.raises(SettingsError, match=r"emulation\.link: .*unknown link profile 'moon'"):
        load_settings(args=["--emulation.link", "moon"])
    with pytest.raises(SettingsError, match=r"emulation\.link: .*bad link profile"):
        load_settings(args=["--emulation.link", "wifi:speed=3"])
    with pytest.raises(SettingsError, match=r"\bmode\b"):
        DeviceSettings().updated({"mode": "central"})
    monkeypatch.setenv("SLED_DEVICE_EMULATION__DEVICE", "pi9")
    with pytest.raises(SettingsError, match=r"emulation\.device: .*unknown device profile 'pi9'"):
        load_settings()


def test_device_profiles_size_their_containers():
    for name in ("pi4", "pi5", "orin-nano"):
        profile = DEVICES[name]
        assert profile.cpus > 0 and profile.memory_mb >= 4096
    assert device_profile("pi4").memory_mb == 4096 and device_profile("pi5").memory_mb == 8192
    assert device_profile("pi5:memory_mb=2048").memory_mb == 2048
    assert device_profile("pi5").cpus_on(2) == 2.0 and device_profile("instant").cpus_on(2) == 0.0


async def test_server_mode_generates_the_targets_greedy_without_drafting(device, models, prompts):
    dev = await device(mode="server")
    tokens, finish, lossless = await dev.complete(Request(prompts[0], max_tokens=24, ignore_eos=True))
    assert tokens == greedy_reference(models["llama"], prompts[0], 24)
    assert finish == "length" and lossless
    assert dev.metrics.value("sled_device_rounds_total") == 0       # nothing was drafted
    # and back to drafting, live
    await dev.apply({"mode": "draft"})
    tokens, _, _ = await dev.complete(Request(prompts[1], max_tokens=12, ignore_eos=True))
    assert tokens == greedy_reference(models["llama"], prompts[1], 12)
    assert dev.metrics.value("sled_device_rounds_total") > 0


@pytest.mark.parametrize("mode", ["draft", "server"])
async def test_a_cut_link_mid_request_loses_and_repeats_no_token(device, models, prompts, mode):
    """The link goes down after the first tokens: the open stream fails as a lost connection,
    the session waits for the link and resumes where its committed tokens end."""
    dev = await device(mode=mode, emulation={"device": SLOW_BOARD}, reconnect_s=20.0,
                       policy={"draft_len": 2, "pipeline": False})
    want = greedy_reference(models["llama"], prompts[2], 40)
    got, chunks = [], 0
    async for chunk in dev.stream(Request(prompts[2], max_tokens=40, ignore_eos=True)):
        got.extend(chunk.token_ids)
        chunks += 1
        if chunks == 1:
            await dev.apply({"emulation": {"link_down": True}})
            assert dev.status()["emulation"]["kind"] == "user-space"     # a loopback link
            asyncio.get_running_loop().call_later(
                0.4, lambda: asyncio.ensure_future(dev.apply({"emulation": {"link_down": False}})))
    assert got == want
    assert dev.metrics.value("sled_device_resumes_total") >= 1
    assert dev.metrics.value("sled_device_requests_total", {"outcome": "ok"}) == 1


@pytest.mark.parametrize("mode", ["draft", "server"])
async def test_a_request_sent_while_the_link_is_down_waits_for_it(device, models, prompts, mode):
    dev = await device(mode=mode, emulation={"link": "wifi", "link_down": True}, reconnect_s=20.0)
    loop = asyncio.get_running_loop()
    restored_at = []        # when the link came back

    def restore() -> None:
        restored_at.append(loop.time())
        asyncio.ensure_future(dev.apply({"emulation": {"link_down": False}}))
    loop.call_later(0.3, restore)
    tokens, first_chunk_at = [], None
    async for chunk in dev.stream(Request(prompts[3], max_tokens=10, ignore_eos=True)):
        if first_chunk_at is None and chunk.token_ids:
            first_chunk_at = loop.time()
        tokens.extend(chunk.token_ids)
    assert tokens == greedy_reference(models["llama"], prompts[3], 10)
    # ordering, not speed: no token came while the link was down
    assert restored_at, "the request finished before the link came back"
    assert first_chunk_at is not None and first_chunk_at >= restored_at[0]
    assert dev.status()["emulation"] == {"device": "", "link": "wifi", "link_down": False,
                                         "kind": "user-space"}


async def test_a_board_profile_pads_drafting_and_changes_no_token(device, models, prompts):
    dev = await device(emulation={"device": SLOW_BOARD}, policy={"draft_len": 3, "pipeline": False})
    tokens, _, _ = await dev.complete(Request(prompts[4], max_tokens=16, ignore_eos=True))
    assert tokens == greedy_reference(models["llama"], prompts[4], 16)
    board = device_profile(SLOW_BOARD)
    stats = [stat for _, stat in dev.window.rounds]
    assert stats
    for stat in stats:      # each round's drafting took at least the board's time for its draft
        assert stat.draft_ms >= board.draft_seconds(stat.verified) * 1e3 - 1.0, stat
    # every paced draft is counted; on this board (25 ms a token) the host keeps the pace
    assert dev.metrics.value("sled_device_paced_drafts_total") >= len(stats)
    assert dev.metrics.value("sled_device_late_drafts_total") <= \
        dev.metrics.value("sled_device_paced_drafts_total") / 2


class SlowDrafter:
    """A drafter whose every proposal takes `seconds` of this host's time."""
    name, tokenizer_fingerprint = "slow", None

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def propose(self, context, k, sampling, generator=None, **options):
        import time

        from drafters.base import Proposal
        time.sleep(self.seconds)
        return Proposal([1] * k, None)

    def rollback(self, length: int) -> None:
        pass


async def test_a_draft_the_host_cannot_give_the_boards_pace_is_counted_late():
    from edge_client.emulation import late

    assert late(0.0885, 0.080) and not late(0.0875, 0.080)    # 10% past the board's time
    assert late(0.0151, 0.010) and not late(0.0149, 0.010)    # at least 5 ms past it
    board = device_profile(SLOW_BOARD)                         # 4 tokens: 105 ms
    said: list[bool] = []
    for seconds in (0.0, 0.2):
        paced = PacedDrafter(SlowDrafter(seconds), board, on_paced=said.append)
        await paced.apropose([1, 2], 4, Sampling())
    assert said == [False, True]


async def test_paced_drafter_proposes_the_inner_drafters_tokens(drafter_models, tokenizer, prompts):
    inner = HFDrafter(drafter_models["llama"], tokenizer, name="hf")
    board = device_profile(SLOW_BOARD)
    paced = PacedDrafter(inner, board)
    want = inner.propose(prompts[0], 4, Sampling())
    loop = asyncio.get_running_loop()
    started = loop.time()
    got = await paced.apropose(prompts[0], 4, Sampling())
    assert got.token_ids == want.token_ids
    assert loop.time() - started >= board.draft_seconds(4) - 1e-3
    # going on from where it ended: the round's overhead is not paid again
    assert paced.draft_seconds(1, warm=True) == pytest.approx(board.draft_ms_per_token / 1e3)
    assert (paced.name, paced.tokenizer_fingerprint) == (inner.name, inner.tokenizer_fingerprint)


async def test_acceptance_is_counted_per_draft_position(device, models, prompts):
    dev = await device(policy={"draft_len": 4, "pipeline": False})
    await dev.complete(Request(prompts[5], max_tokens=30, ignore_eos=True))
    stats = [stat for _, stat in dev.window.rounds]
    value = dev.metrics.value
    for position in range(1, 5):
        drafted = sum(stat.verified >= position for stat in stats)
        accepted = sum(stat.accepted >= position for stat in stats)
        assert value("sled_device_position_drafted_total", {"position": str(position)}) == drafted
        assert value("sled_device_position_accepted_total", {"position": str(position)}) == accepted
    assert value("sled_device_position_drafted_total", {"position": "1"}) == len(stats) > 0
    assert sum(value("sled_device_position_drafted_total", {"position": str(p)}) for p in range(1, 5)) \
        == value("sled_device_draft_tokens_total")
    assert value("sled_device_position_drafted_total", {"position": "5"}) == 0


async def test_status_reports_mode_and_emulation(device):
    dev = await device()
    status = dev.status()
    assert status["mode"] == "draft"
    assert status["emulation"] == {"device": "", "link": "", "link_down": False, "kind": "none"}
    await dev.apply({"mode": "server", "emulation": {"device": "pi5", "link": "lte"}})
    status = dev.status()
    assert status["mode"] == "server"
    assert status["emulation"] == {"device": "pi5", "link": "lte", "link_down": False,
                                   "kind": "user-space"}
    with pytest.raises(SettingsError, match=r"emulation\.link"):
        await dev.apply({"emulation": {"link": "moon"}})
    assert dev.status()["emulation"]["link"] == "lte"


async def test_health_and_metrics_over_http_show_the_lab_fields(device, prompts):
    import aiohttp

    from edge_client.openai_api import start_api

    dev = await device(mode="draft", emulation={"device": "orin-nano", "link": "ethernet"},
                       policy={"draft_len": 2, "pipeline": False})
    await dev.complete(Request(prompts[0], max_tokens=8, ignore_eos=True))
    runner, port = await start_api(dev, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/health") as response:
                health = await response.json()
            async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
                metrics = await response.text()
    finally:
        await runner.cleanup()
    assert health["mode"] == "draft"
    assert health["emulation"] == {"device": "orin-nano", "link": "ethernet", "link_down": False,
                                   "kind": "user-space"}
    # /metrics shows the per-position counts of the rounds run, position by position
    stats = [stat for _, stat in dev.window.rounds]
    assert stats
    served = position_counts(metrics)
    for kind, field in (("drafted", "verified"), ("accepted", "accepted")):
        want = {position: sum(getattr(stat, field) >= position for stat in stats)
                for position in range(1, 3)}
        assert served[kind] == {p: n for p, n in want.items() if n}, kind
    assert sum(served["accepted"].values()) == dev.metrics.value("sled_device_accepted_tokens_total")
    assert served["drafted"][1] == len(stats)


def position_counts(metrics: str) -> dict[str, dict[int, float]]:
    """{"drafted": {position: count}, "accepted": {...}} from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = {"drafted": {}, "accepted": {}}
    for family in text_string_to_metric_families(metrics):
        for kind in counts:
            if family.name == f"sled_device_position_{kind}":
                counts[kind] = {int(sample.labels["position"]): sample.value
                                for sample in family.samples if sample.name.endswith("_total")}
    return counts
