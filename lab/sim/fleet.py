"""The simulated fleet's devices: sled's own device sessions, drafting from calibrated traces at
their board's speed over their own link, against a simulated server.

Each device has its own address (the server tells anonymous devices apart by host, and shares
prefix-cache blocks only within one) and takes its requests one after another: each as soon as
the one before is over (closed arrivals) or at its own time, waiting behind a busy device
(Poisson arrivals). A session past the GPU's memory wall waits in the server's admission queue
for KV; when the server refuses one for want of KV (RESOURCE_EXHAUSTED: its queue full, the wait
past its bound, or --admission-queue 0) it asks again after a backoff. Every wait counts in the
request's time to first token, as a user's would.

    done = await device_requests(server, device, [(None, trace), (3.5, trace)], "sled",
                                 settings, 64)
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import grpc

from edge_client.result import GenerationResult
from edge_client.server_side import generate_server_side
from edge_client.session import RoundSettings, SessionHooks, Target, generate
from edge_client.transport import VerifyError
from edge_client.wire import SessionRequest
from lab.link import link_transport
from lab.profiles import DeviceProfile, Link, LinkProfile
from lab.sim.server import SimulatedServer
from lab.traces.format import Trace
from lab.traces.replay import TraceDivergence, TraceDrafter
from sled import clock
from sled.backoff import Backoff
from sled.v1 import verifier_pb2 as pb

# What a request's result says when a verdict took the session off its script (an output that
# is not the target's: counted as a mismatch)
DIVERGED = "diverged"
# The modes in which the server generates alone, and the session mode each opens with: plain
# decoding, or the target drafting for itself (SAT slots)
SERVER_MODES = {"centralized": pb.GENERATION_MODE_SERVER,
                "centralized-spec": pb.GENERATION_MODE_SERVER_SAT}
# A refused session is asked again after these pauses (no jitter: a run repeats under its seed).
RETRY_FIRST_S, RETRY_MOST_S = 0.25, 2.0


@dataclass(frozen=True)
class SimDevice:
    """`host`: the address the server sees it at (default: a host of its own, as a fleet's
    boards are; `sled bench serve` runs every device on one host)."""
    index: int
    board: DeviceProfile | None
    link: LinkProfile
    host: str | None = None

    @property
    def peer(self) -> str:
        j = self.index
        return f"ipv4:{self.host or f'10.{j >> 16 & 255}.{j >> 8 & 255}.{j & 255}'}:{40000 + j}"


@dataclass
class SimRequest:
    """One request of a device: the session's result, with the time it waited for admission
    folded into its elapsed time and token stamps, and what its output should have been."""
    result: GenerationResult
    expected: list[int]
    refusals: int = 0
    waited_s: float = 0.0


async def device_requests(server: SimulatedServer, device: SimDevice,
                          requests: Sequence[tuple[float | None, Trace]], mode: str,
                          settings: RoundSettings, max_new_tokens: int, seed: int = 0,
                          on_tokens: Callable[[list[int]], None] | None = None) -> list[SimRequest]:
    """The device's requests, one after another: (when it comes, in seconds from the start, or
    None: as soon as the one before is over; the trace it replays). A request that comes while
    the one before still runs waits for it, and the wait counts in its time to first token."""
    stub = server.stub(device.peer)
    wire = link_transport(Link(device.link, seed=seed + device.index))
    hooks = SessionHooks(on_tokens=on_tokens)
    started, done = clock.now(), []
    for at, trace in requests:
        if at is not None:
            await asyncio.sleep(max(0.0, started + at - clock.now()))
        expected = trace.target_ids[:max_new_tokens]
        request = SessionRequest(trace.prompt_ids, max_new_tokens=len(expected))
        issued = clock.now() if at is None else started + at
        pauses, refusals = Backoff(RETRY_FIRST_S, most=RETRY_MOST_S), 0
        while True:
            try:
                if mode in SERVER_MODES:
                    result = await generate_server_side(
                        stub, replace(request, mode=SERVER_MODES[mode]), transport=wire,
                        hooks=hooks)
                else:
                    result = await generate(stub, TraceDrafter(trace, device.board), request,
                                            settings=settings, transport=wire,
                                            target=Target(fingerprint=server.fingerprint), hooks=hooks)
                break
            except VerifyError as error:
                if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                refusals += 1
                await pauses.wait()
            except TraceDivergence:       # a verdict left the script: the server decided wrong
                result = GenerationResult(finish_reason=DIVERGED, elapsed_s=clock.now() - issued)
                break
        waited = clock.now() - issued - result.elapsed_s
        result.token_times = [t + waited for t in result.token_times]
        result.elapsed_s += waited
        done.append(SimRequest(result, expected, refusals, waited))
    return done


async def run_fleet(server: SimulatedServer, devices: Sequence[SimDevice],
                    requests_of: Callable[[int], Sequence[tuple[float | None, Trace]]], mode: str,
                    settings: RoundSettings, max_new_tokens: int, seed: int = 0,
                    on_tokens: Callable[[list[int]], None] | None = None) -> list[SimRequest]:
    """Every device at once; device j makes the requests requests_of(j)."""
    per_device = await asyncio.gather(*(
        device_requests(server, device, requests_of(device.index), mode, settings,
                        max_new_tokens, seed, on_tokens) for device in devices))
    return [request for requests in per_device for request in requests]
