"""Several `sled serve` replicas behind HAProxy (lab.proxy, the rules of deploy/haproxy.cfg), on
loopback: the health check is a real gRPC Health/Check that a replica saying NOT_SERVING fails;
16 devices dial one address and their sessions spread over both replicas; one replica
SIGKILLed mid-generation loses nothing (each of its sessions is resumed on the other through
the proxy, every output the target's greedy one, no token lost or duplicated); two devices
behind the one proxy keep their own session quotas and prefix-cache tenants (their tokens name
them, not the proxy's address they all come from); refusals reach their devices whole.

Skipped only where HAProxy is not installed (make haproxy installs it)."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import secrets
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from drafters.ngram import NgramDrafter
from edge_client.security import ChannelSecurity
from edge_client.session import RoundSettings, SessionHooks, generate, target_fingerprint
from edge_client.transport import Stream, VerifyError, lost_server
from edge_client.wire import SessionRequest
from lab.oracle import target_references
from lab.proxy import ProxyProcess, haproxy_binary
from lab.scrape import parse_metrics, value
from lab.server_process import ServerProcess, free_port
from lab.tiny import cached_pair
from sled.v1 import verifier_pb2 as pb
from test_prefix_scope import server_session
from test_stream_end import wrong_tokenizer_open

pytestmark = pytest.mark.skipif(haproxy_binary() is None,
                                reason="HAProxy is not installed (make haproxy, or "
                                       "apt-get install haproxy)")

DEVICES = 16
MAX_NEW = 96
# two devices of their own behind the proxy: one allowed a single session per replica
QUOTA_DEVICE, OTHER_DEVICE, QUOTA = "cam-a", "cam-b", 1
SHARED = list(range(40, 120))          # an 80-token prompt: 5 blocks of 16 to cache
SESSION_TOKENS = 4                     # what each server-generated session emits
REFUSALS = 200                         # refused Opens sent through the proxy


def metrics(server: ServerProcess) -> dict:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    return parse_metrics(urllib.request.urlopen(url, timeout=5).read().decode())


class Replicas:
    """Two `sled serve` replicas of the tiny target, with device tokens, behind one HAProxy."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.tokens = {f"dev-{i:02d}": secrets.token_urlsafe(18) for i in range(DEVICES)}
        self.tokens |= {QUOTA_DEVICE: secrets.token_urlsafe(18),
                        OTHER_DEVICE: secrets.token_urlsafe(18)}
        lines = [f"{device} {token}" + (f" sessions={QUOTA}" if device == QUOTA_DEVICE else "")
                 for device, token in self.tokens.items()]
        (folder / "tokens").write_text("\n".join(lines) + "\n")
        self.target = cached_pair()[0]
        flags = ("--auth-tokens", str(folder / "tokens"), "--kv-budget", "64MiB")
        self.servers = [ServerProcess(self.target, *flags, security=self.security(QUOTA_DEVICE))
                        for _ in range(2)]
        self.proxy: ProxyProcess | None = None

    def security(self, device: str) -> ChannelSecurity:
        return ChannelSecurity(token=self.tokens[device])

    @contextlib.asynccontextmanager
    async def channel(self, device: str):
        """A device's own channel to the proxy, and its stub (its token on every call)."""
        security = self.security(device)
        async with security.channel(self.proxy.address) as channel:
            yield security.stub(channel)

    async def __aenter__(self) -> "Replicas":
        await asyncio.gather(*(server.__aenter__() for server in self.servers))
        self.proxy = ProxyProcess([s.address for s in self.servers], self.folder / "proxy")
        await self.proxy.start()
        return self

    async def __aexit__(self, *exc) -> None:
        if self.proxy is not None:
            await self.proxy.stop()
        await asyncio.gather(*(server.__aexit__() for server in self.servers))


@pytest.fixture(scope="module")
async def replicas(tmp_path_factory):
    async with Replicas(tmp_path_factory.mktemp("replicas")) as running:
        yield running


async def until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_the_health_check_is_a_grpc_health_call(tmp_path):
    """A replica answering Health/Check with NOT_SERVING is taken out; back to SERVING, in."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    address = f"127.0.0.1:{server.add_insecure_port(f'127.0.0.1:{free_port()}')}"
    await server.start()
    try:
        async with ProxyProcess([address], tmp_path) as proxy:
            log = proxy.child.log
            await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await until(lambda: "replica-0 is DOWN" in log.read_text(), 15, log.read_text())
            await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            await until(lambda: "replica-0 is UP" in log.read_text(), 15, log.read_text())
    finally:
        await server.stop(0)


async def test_devices_behind_the_proxy_keep_their_own_quotas(replicas):
    """cam-a (sessions=1) holds one session on each replica and is refused a third; cam-b,
    through the same proxy from the same address, still opens sessions."""
    held, refused = [], None
    async with replicas.channel(QUOTA_DEVICE) as stub_a, replicas.channel(OTHER_DEVICE) as stub_b:
        fingerprint = await target_fingerprint(stub_a)
        try:
            for _ in range(len(replicas.servers) * QUOTA + 1):
                stream = Stream.open(stub_a)
                await stream.send(pb.DeviceMessage(open=pb.Open(
                    prompt_ids=[5, 6, 7], max_new_tokens=64, ignore_eos=True,
                    tokenizer_fingerprint=fingerprint, mode=pb.GENERATION_MODE_DEVICE_DRAFTS)))
                try:
                    assert (await stream.receive()).WhichOneof("kind") == "opened"
                except VerifyError as error:
                    refused = error
                    break
                held.append(stream)
            _, tokens = await server_session(stub_b, [5, 6, 7], "", SESSION_TOKENS)
        finally:
            for call in held:
                call.cancel()
    assert refused is not None, "cam-a was never refused"
    # the device reads a refusal, not a lost server (edge_client.transport.refusal_code)
    assert (refused.code, refused.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                              "REASON_QUOTA"), refused
    assert "quota" in refused.message and not lost_server(refused)
    assert len(held) == len(replicas.servers) * QUOTA            # the quota holds per replica
    assert len(tokens) == SESSION_TOKENS                         # cam-b: served all the same
    opened = [value(metrics(s), "sled_device_sessions_total", device=QUOTA_DEVICE)
              for s in replicas.servers]
    assert opened == [QUOTA, QUOTA], opened                     # one on each replica


async def test_refusals_reach_their_devices_through_the_proxy(replicas):
    """Refused Opens, ten at a time, each answered with its status and reason rather than a
    bare CANCELLED (a lost server, to the device). The server ends a refused call only once the
    device has half-closed, so HAProxy has no reset to pass on; before that, 812 of 2000 such
    refusals reached sled's devices as bare CANCELLED here with both cores busy, and a few in
    a hundred with them idle."""
    async with replicas.channel(OTHER_DEVICE) as stub:
        async def refused() -> tuple:
            stream = Stream.open(stub)
            await stream.send(wrong_tokenizer_open())
            with pytest.raises(VerifyError) as refusal:
                await stream.receive()
            return refusal.value.code, refusal.value.reason
        seen = []
        for _ in range(REFUSALS // 10):
            seen += await asyncio.gather(*(refused() for _ in range(10)))
    assert set(seen) == {(grpc.StatusCode.FAILED_PRECONDITION, "REASON_TOKENIZER_MISMATCH")}, \
        collections.Counter(seen)


async def test_devices_behind_the_proxy_keep_their_own_prefix_cache(replicas):
    """cam-a's sessions of one prompt land on both replicas and share its cached blocks there;
    cam-b, sending the same prompt through the same proxy, finds none of them."""
    async with replicas.channel(QUOTA_DEVICE) as stub_a, replicas.channel(OTHER_DEVICE) as stub_b:
        before = [value(metrics(s), "sled_device_sessions_total", device=QUOTA_DEVICE)
                  for s in replicas.servers]
        first = [await server_session(stub_a, SHARED, "", SESSION_TOKENS) for _ in range(2)]
        after = [value(metrics(s), "sled_device_sessions_total", device=QUOTA_DEVICE)
                 for s in replicas.servers]
        assert [a - b for a, b in zip(after, before)] == [1, 1], (before, after)
        other, _ = await server_session(stub_b, SHARED, "", SESSION_TOKENS)
        again, _ = await server_session(stub_a, SHARED, "", SESSION_TOKENS)
    assert [cached for cached, _ in first] == [0, 0]            # the first on each replica
    assert other == 0                                           # another tenant: nothing
    assert again >= 64                                          # its own tenant: 4+ blocks
    assert first[0][1] == first[1][1]


async def test_a_replica_killed_mid_generation_loses_nothing(replicas):
    """16 devices through one address, sessions on both replicas; one replica SIGKILLed while
    they generate: each of its sessions resumes on the other, every output the target's."""
    texts = [f"device {i} asks: def f{i}(x):" for i in range(DEVICES)]
    references = await asyncio.to_thread(target_references, replicas.target, texts, MAX_NEW)
    before = [value(metrics(s), "sled_sessions_total") for s in replicas.servers]
    streamed: list[list[int]] = [[] for _ in range(DEVICES)]

    async def device(i: int):
        async with replicas.channel(f"dev-{i:02d}") as stub:
            return await generate(stub, NgramDrafter(), SessionRequest(
                references.prompt_ids[i], MAX_NEW, ignore_eos=True),
                RoundSettings(draft_len=4, reconnect_s=60),
                hooks=SessionHooks(on_tokens=streamed[i].extend))

    runs = asyncio.gather(*(device(i) for i in range(DEVICES)))
    victim, survivor = replicas.servers

    def spread() -> bool:
        """Every device's session is open, some on each replica."""
        pages = [metrics(s) for s in replicas.servers]
        opened = sum(value(page, "sled_sessions_total") for page in pages) - sum(before)
        return opened == DEVICES and all(value(p, "sled_active_sessions") > 0 for p in pages)
    try:
        await until(lambda: runs.done() or spread(), 60, "the sessions did not reach both replicas")
        assert not runs.done(), "the fleet finished before both replicas had sessions"
        metrics_before_kill = metrics(victim)
        await victim.child.kill()                                # SIGKILL: no goodbye
        on_victim = value(metrics_before_kill, "sled_sessions_total") - before[0]
        results = await asyncio.wait_for(runs, 120)
    finally:
        runs.cancel()
    opened = value(metrics(survivor), "sled_sessions_total") - before[1]
    for i, result in enumerate(results):
        assert result.token_ids == references.outputs[i], f"dev-{i:02d}"
        assert streamed[i] == result.token_ids, f"dev-{i:02d}"  # none lost or sent twice
    resumed = sum(result.resumes for result in results)
    assert 0 < resumed <= on_victim < DEVICES, (resumed, on_victim)
    # the survivor opened its own sessions, and each of the victim's it took over once
    assert opened == DEVICES - on_victim + resumed, (opened, on_victim, resumed)
