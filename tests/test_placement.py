"""The placement policy: where each movable session's tokens come from as the server's load
changes (verify_server.placement), the protocol that carries a move (Open.movable,
Verdict.placement), and outputs that stay the target's across every sequence of moves."""
from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from pydantic import ValidationError

from conftest import greedy_reference
from sled import clock
from sled.v1 import verifier_pb2 as pb
from verify_server.placement import (DEVICE, HIGH, LOW, SETTLE_S, StepLoad, PlacementPolicy,
                                     Standing)
from verify_server.settings import ServerSettings

SERVER, SAT = pb.GENERATION_MODE_SERVER, pb.GENERATION_MODE_SERVER_SAT
NEVER = math.inf


def standing(placement=DEVICE, acceptance=0.7, device_rate=None, since=NEVER) -> Standing:
    return Standing(placement, acceptance, device_rate, since)


def test_fixed_moves_nobody():
    policy = PlacementPolicy("fixed", 5.0, SAT)
    assert not policy.moves
    for busy in (0.0, 0.5, 1.0):
        assert policy.place(standing(), busy) == DEVICE
        assert policy.place(standing(SERVER), busy) == SERVER


def test_latency_serves_on_the_server_while_the_gpu_has_room_and_hands_back_as_it_fills():
    """A load trace in, placements out: idle GPU -> the server's SAT slots; between LOW and
    HIGH -> each keeps its placement; past HIGH -> back to the device, high acceptance first;
    a full GPU -> everyone drafts."""
    policy = PlacementPolicy("latency", 5.0, SAT)
    trace = [(0.1, DEVICE, 0.5, SAT), (0.3, SAT, 0.5, SAT), (0.6, SAT, 0.5, SAT),
             (0.6, DEVICE, 0.5, DEVICE), (0.85, SAT, 0.9, DEVICE), (0.85, SAT, 0.5, SAT),
             (0.95, SAT, 0.3, DEVICE), (1.0, SAT, 0.0, DEVICE)]
    for busy, now, acceptance, wanted in trace:
        assert policy.place(standing(now, acceptance), busy) == wanted, (busy, now, acceptance)
    assert PlacementPolicy("latency", 5.0, SERVER).place(standing(), 0.1) == SERVER   # no SATs


def test_gpu_keeps_drafting_on_devices_that_meet_their_slo():
    policy = PlacementPolicy("gpu", 5.0, SAT)
    assert policy.place(standing(device_rate=30.0), 0.1) == DEVICE
    assert policy.place(standing(device_rate=2.0), 0.1) == SAT        # under its SLO: served
    assert policy.place(standing(device_rate=2.0), HIGH + 0.1) == DEVICE   # no room: drafts
    assert policy.place(standing(SAT, device_rate=30.0), 0.3) == DEVICE


def test_a_move_settles_and_a_slow_drafter_is_never_moved_back_to_drafting():
    policy = PlacementPolicy("latency", 5.0, SAT)
    assert policy.place(standing(since=SETTLE_S / 2), 0.0) == DEVICE       # moved just now
    assert policy.place(standing(since=SETTLE_S * 2), 0.0) == SAT
    slow = standing(SAT, acceptance=1.0, device_rate=1.0)
    assert policy.place(slow, 1.0) == SAT
    assert PlacementPolicy("gpu", 5.0, SAT).place(slow, 1.0) == SAT
    with pytest.raises(ValueError, match="unknown placement"):
        PlacementPolicy("fastest", 5.0, SAT)


def test_the_operator_moves_the_band_where_the_server_serves_and_hands_back():
    """--placement-low/-high: a lower band hands sessions back at a load the default keeps."""
    default, lowered = PlacementPolicy("latency", 5.0, SAT), PlacementPolicy(
        "latency", 5.0, SAT, low=0.3, high=0.6)
    assert default.place(standing(SAT, 0.8), 0.7) == SAT
    assert lowered.place(standing(SAT, 0.8), 0.7) == DEVICE      # 0.8 >= (1 - 0.7) / (1 - 0.6)
    assert lowered.place(standing(SAT, 0.6), 0.7) == SAT         # its drafts pay less: it stays
    assert default.place(standing(DEVICE), 0.4) == SAT
    assert lowered.place(standing(DEVICE), 0.4) == DEVICE        # between its low and high
    with pytest.raises(ValueError, match="0 < low < high < 1"):
        PlacementPolicy("latency", 5.0, SAT, low=0.8, high=0.5)
    with pytest.raises(ValidationError, match="placement_low .* must be under placement_high"):
        ServerSettings(model="m", placement_low=0.9, placement_high=0.6)


def test_the_load_counts_step_time_past_the_lightest_step():
    """One session decoded back to back (every step the lightest) loads the GPU nothing; steps
    three times the lightest, back to back, load it 2/3; idle time unloads it."""
    load, t = StepLoad(window=1.0), 0.0
    for _ in range(500):                 # 7 ms steps back to back, for three windows and more
        load.step(t, t + 0.007)
        t += 0.007
    assert load.share(t) < 0.01
    for _ in range(250):                 # 21 ms steps, the lightest still 7 ms
        load.step(t, t + 0.021)
        t += 0.021
    assert 0.6 < load.share(t) < 2 / 3 + 1e-9
    assert load.share(t + 3.0) < LOW / 10        # idle for three windows


class Scripted(PlacementPolicy):
    """A policy that moves a session at the round boundaries its script names: (boundary ->
    placement), every other boundary keeping it where it is."""

    def __init__(self, script: dict[int, int]) -> None:
        super().__init__("latency", 5.0, SERVER)
        self.script, self.boundary = script, 0

    def place(self, session: Standing, busy: float) -> int:
        wanted = self.script.get(self.boundary, session.placement)
        self.boundary += 1
        return wanted


async def test_moves_back_and_forth_keep_the_output_the_targets(serve, models, drafter_models,
                                                               tokenizer, prompts):
    """Device drafts, then the server decodes, then the device again, then the server to the
    end: generate()'s tokens, the tokens counted where they came from, and the moves metric."""
    from drafters.hf import HFDrafter
    from edge_client.session import RoundSettings, generate
    from edge_client.wire import SessionRequest
    from tests.test_lossless import server_stub

    model = models["llama"]
    server = await serve(model)
    core = server.service.core
    core.placement = Scripted({1: SERVER, 5: DEVICE, 8: SERVER})
    result = await generate(server_stub(server),
                            HFDrafter(drafter_models["llama"], tokenizer, name="hf:noisy"),
                            SessionRequest(prompts[0], max_new_tokens=40),
                            settings=RoundSettings(draft_len=3))
    assert result.token_ids == greedy_reference(model, prompts[0], 40)
    assert result.moves == 3 and set(result.placements) == {"device", "server"}
    assert sum(result.placements.values()) == 40
    moves = core.metrics
    assert moves.value("sled_placement_moves_total", {"to": "server"}) == 2
    assert moves.value("sled_placement_moves_total", {"to": "device"}) == 1


async def test_concurrent_sessions_moved_by_the_latency_policy_match_generate(
        serve, models, drafter_models, tokenizer, prompts):
    """Eight sessions through a server whose placement is latency: an idle GPU serves them
    itself after their first round; every output is generate()'s."""
    from drafters.hf import HFDrafter
    from edge_client.session import RoundSettings, generate
    from edge_client.wire import SessionRequest
    from tests.test_lossless import server_stub

    model = models["llama"]
    server = await serve(model, placement="latency")
    results = await asyncio.gather(*(
        generate(server_stub(server), HFDrafter(drafter_models["llama"], tokenizer, name="hf"),
                 SessionRequest(prompt, max_new_tokens=24), settings=RoundSettings(draft_len=4))
        for prompt in prompts))
    for result, prompt in zip(results, prompts):
        assert result.token_ids == greedy_reference(model, prompt, 24)
    assert any(r.moves for r in results)
    assert all(r.placements.get("server", 0) + r.placements.get("device", 0) == len(r.token_ids)
               for r in results)
    core = server.service.core          # the load the policy read is on /metrics as well
    assert core.metrics.value("sled_step_load") == pytest.approx(
        core.scheduler.load.share(clock.now()), abs=0.02)
    assert core.scheduler.load.value > 0


async def test_a_device_that_is_not_movable_keeps_its_mode(serve, models, drafter_models,
                                                           tokenizer, prompts):
    """An old device (Open.movable unset) and a device without a drafter (a server mode, movable
    asked for) are never moved, whatever the policy says; their outputs are generate()'s."""
    from drafters.hf import HFDrafter
    from edge_client.server_side import generate_server_side
    from edge_client.session import RoundSettings, generate
    from edge_client.wire import SessionRequest
    from tests.test_lossless import server_stub

    model = models["llama"]
    server = await serve(model, placement="latency")
    server.service.core.placement = Scripted({i: SERVER if i % 2 else DEVICE for i in range(99)})
    old = await generate(server_stub(server),
                         HFDrafter(drafter_models["llama"], tokenizer, name="hf"),
                         SessionRequest(prompts[1], max_new_tokens=20, movable=False),
                         settings=RoundSettings(draft_len=3))
    alone = await generate_server_side(server_stub(server),
                                       SessionRequest(prompts[2], max_new_tokens=20, movable=True))
    assert old.moves == alone.moves == 0
    assert old.placements == {"device": 20} and alone.placements == {"server": 20}
    assert old.token_ids == greedy_reference(model, prompts[1], 20)
    assert alone.token_ids == greedy_reference(model, prompts[2], 20)


async def test_a_draft_written_ahead_of_a_move_is_dropped_unanswered(serve, models, prompts):
    """A device that wrote round 1's draft before it read round 0's verdict, which moved it to
    the server: the draft is dropped (no error), the server's verdicts follow, and the session
    finishes with generate()'s tokens."""
    from tests.test_lossless import server_stub

    model = models["llama"]
    server = await serve(model)
    server.service.core.placement = Scripted({1: SERVER})    # 0: its open
    prompt, want = prompts[3], greedy_reference(model, prompts[3], 12)
    call = server_stub(server).Generate()
    await call.write(pb.DeviceMessage(open=pb.Open(
        prompt_ids=prompt, max_new_tokens=12, movable=True,
        tokenizer_fingerprint=server.service.core.target.fingerprint)))
    assert (await call.read()).WhichOneof("kind") == "opened"
    await call.write(pb.DeviceMessage(draft=pb.Draft(round=0, token_ids=want[:2])))
    await call.write(pb.DeviceMessage(draft=pb.Draft(round=1, token_ids=want[3:5])))
    first = (await call.read()).verdict
    assert first.HasField("placement") and first.placement == SERVER
    tokens = list(first.emitted_ids)
    while True:
        message = await call.read()
        assert message.WhichOneof("kind") == "verdict"
        tokens.extend(message.verdict.emitted_ids)
        if message.verdict.finish_reason:
            break
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    assert tokens == want
    assert server.service.core.metrics.value("sled_stale_drafts_total") == 1


async def test_a_session_served_from_its_open_never_drafts(serve, models, drafter_models,
                                                          tokenizer, prompts):
    """Opened.placement: the server serves the session from the start; the device sends no
    draft, and the output is generate()'s."""
    from drafters.hf import HFDrafter
    from edge_client.session import RoundSettings, generate
    from edge_client.wire import SessionRequest
    from tests.test_lossless import server_stub

    model = models["llama"]
    server = await serve(model)
    server.service.core.placement = Scripted({0: SERVER})
    result = await generate(server_stub(server),
                            HFDrafter(drafter_models["llama"], tokenizer, name="hf"),
                            SessionRequest(prompts[4], max_new_tokens=16),
                            settings=RoundSettings(draft_len=4))
    assert result.token_ids == greedy_reference(model, prompts[4], 16)
    assert result.placements == {"server": 16} and result.moves == 1
    assert result.draft_tokens == 0


def test_the_simulator_runs_the_policy_as_the_server_does(tmp_path):
    """`adaptive` on the simulator: sled's server with --placement latency. At one device its
    sessions are served by the GPU, so a device gets several times sled's rate; every output is
    its script's."""
    from tests.test_simulator import rows_of, simulate, write_scenario

    rows = rows_of(simulate(tmp_path, write_scenario(tmp_path), "--modes", "sled,adaptive",
                            "--fleet-sizes", "1"))
    by_mode = {r["mode"]: r for r in rows}
    assert all(r["mismatches"] == 0 for r in rows)
    assert by_mode["adaptive"]["device_tps_p5"] > 2 * by_mode["sled"]["device_tps_p5"]
    assert by_mode["sled"]["served_share"] == 0 and by_mode["adaptive"]["served_share"] > 0.8


async def test_sampled_sessions_moved_mid_stream_keep_the_targets_distribution(
        serve, models, drafter_models, tokenizer, prompts):
    """Seeded sampling sessions of two tokens, moved between their device's drafts and the
    server's passes at every other round boundary: each position's tokens converge to the
    target's exact distribution."""
    from drafters.hf import HFDrafter
    from edge_client.session import RoundSettings, generate
    from edge_client.wire import SessionRequest
    from sled.wire.sampling import Sampling
    from test_sampling_e2e import COUNTS, SAMPLING, exact_distributions, total_variation
    from tests.test_lossless import server_stub

    model = models["llama"]
    prompt = prompts[0]
    p1, p2 = exact_distributions(model, prompt, SAMPLING)
    server = await serve(model, max_batch_sessions=64)
    policy = server.service.core.placement = Scripted(
        {i: SERVER if i % 3 == 1 else DEVICE for i in range(20 * COUNTS[-1])})
    gate = asyncio.Semaphore(64)

    async def one(seed: int):
        async with gate:
            result = await generate(
                server_stub(server), HFDrafter(drafter_models["llama"], tokenizer),
                SessionRequest(prompt, max_new_tokens=2, ignore_eos=True,
                               sampling=Sampling(SAMPLING.temperature, SAMPLING.top_k, seed=seed)),
                settings=RoundSettings(draft_len=1))
            return result

    results = await asyncio.gather(*(one(seed) for seed in range(COUNTS[-1])))
    assert policy.boundary > COUNTS[-1] and sum(r.moves for r in results) > COUNTS[-1] // 4
    pairs = [r.token_ids for r in results]
    for position, p in ((0, p1), (1, p2)):
        distances = [total_variation([pair[position] for pair in pairs[:n]], p) for n in COUNTS]
        bound = 0.8 * math.sqrt(int((p > 1e-4).sum()) / COUNTS[-1])
        assert distances[-1] < bound and distances[-1] < distances[0], (position, distances, bound)
