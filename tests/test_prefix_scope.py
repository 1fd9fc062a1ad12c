"""The prefix cache is scoped to a tenant: the caller's identity (without a token or certificate,
its host) and Open.cache_salt. A session finds only the prompt blocks its own tenant published, so
Opened.cached_prompt_tokens (and the prefill time) tell a client nothing about what other clients
sent. Sessions of one tenant still share, and every output is still generate(do_sample=False)'s."""
from __future__ import annotations

import argparse

import grpc
import pytest
import torch

from conftest import greedy_reference
from drafters.hf import HFDrafter
from edge_client.daemon import Device, Request
from edge_client.session import RoundSettings, generate
from edge_client.settings import DeviceSettings
from edge_client.wire import SessionRequest
from sled.v1 import verifier_pb2 as pb
from sled.v1.verifier_pb2_grpc import VerifierStub
from sled.wire.sampling import Sampling
from verify_server.engines.blocks import BlockPool, KVShape, prefix_hashes
from verify_server.engines.kv import SessionKV
from verify_server.server import start_server
from verify_server.settings import ServerSettings
from verify_server.target import Target
from verify_server.auth import Gate
from verify_server.origin import peer_host
from verify_server.tenant import tenant_key

SYSTEM = list(range(40, 120))    # an 80-token shared instruction: 5 blocks of 16
PROMPT = SYSTEM + [5, 9, 200]
MAX_NEW = 10


# --- the tenant key -------------------------------------------------------------------------------

@pytest.mark.parametrize("peer, host", [
    ("ipv4:1.2.3.4:5555", "1.2.3.4"),
    ("ipv6:[::1]:1234", "::1"),
    ("ipv6:%5B::1%5D:1234", "::1"),                     # percent-encoded brackets
    ("ipv6:[::ffff:1.2.3.4]:5555", "1.2.3.4"),          # IPv4 through a dual-stack socket
    ("ipv6:[2001:db8::7]:443", "2001:db8::7"),
    ("unix:/run/sled.sock", "unix:/run/sled.sock"),
    ("", ""),
    (None, ""),
])
def test_peer_host_drops_the_port(peer, host):
    assert peer_host(peer) == host


def tenant_of(peer: str, salt: str) -> bytes:
    """The tenant of a tokenless call from `peer` (what the server computes for it)."""
    return tenant_key(Gate().identify((), {}, peer).tenant, salt)


def test_tenant_key_is_the_host_and_the_salt_never_the_port():
    assert tenant_of("ipv4:1.2.3.4:5555", "") == tenant_of("ipv4:1.2.3.4:6666", "")
    assert tenant_of("ipv4:1.2.3.4:5555", "s") == tenant_of("ipv6:[::ffff:1.2.3.4]:1", "s")
    assert tenant_of("ipv4:1.2.3.4:5555", "") != tenant_of("ipv4:1.2.3.5:5555", "")
    assert tenant_of("ipv4:1.2.3.4:5555", "") != tenant_of("ipv6:[::1]:1234", "")
    assert tenant_of("ipv4:1.2.3.4:5555", "a") != tenant_of("ipv4:1.2.3.4:5555", "b")
    assert tenant_of("ipv4:1.2.3.4:5555", "") != tenant_of("ipv4:1.2.3.4:5555", " ")
    # the identity and the salt cannot trade characters
    assert tenant_of("unix:ab", "c") != tenant_of("unix:a", "bc")
    assert tenant_key("device:cam-3", "") != tenant_key("host:10.0.0.7", "")


def test_session_kv_finds_only_its_own_tenants_blocks():
    pool = BlockPool(KVShape(1, 1, 2, torch.float32), num_blocks=32, block_tokens=4)
    prompt = list(range(1, 13))                          # three full blocks
    mine, theirs = tenant_of("ipv4:10.0.0.1:1", "a"), tenant_of("ipv4:10.0.0.1:1", "b")
    first = SessionKV(pool)
    assert first.admit(prompt, 16, mine) == 0
    first.slots(0, 12)
    first.commit(12)
    first.publish(prompt)
    assert SessionKV(pool).admit(prompt, 16, theirs) == 0
    assert SessionKV(pool).admit(prompt, 16, b"") == 0    # the empty tenant is a tenant too
    assert SessionKV(pool).admit(prompt, 16, mine) == 12


def test_the_tenant_cannot_be_left_out():
    """No default tenant: a caller that forgets it fails, rather than sharing with everyone."""
    pool = BlockPool(KVShape(1, 1, 2, torch.float32), num_blocks=8, block_tokens=4)
    with pytest.raises(TypeError):
        SessionKV(pool).admit([1, 2, 3, 4, 5], 8)
    with pytest.raises(TypeError):
        prefix_hashes([1, 2, 3, 4], 4)


# --- through the server -------------------------------------------------------------------------

def open_msg(prompt, salt: str, mode=pb.GENERATION_MODE_SERVER,
             max_new: int = MAX_NEW) -> pb.DeviceMessage:
    return pb.DeviceMessage(open=pb.Open(prompt_ids=list(prompt), max_new_tokens=max_new,
                                         ignore_eos=True, mode=mode, cache_salt=salt))


async def server_session(stub, prompt, salt: str,
                         max_new: int = MAX_NEW) -> tuple[int, list[int]]:
    """A server-generated session to its end: (its cached prompt tokens, its output). The Open
    is all it sends: it half-closes at once (docs/protocol.md, "The end of a session")."""
    call = stub.Generate()
    await call.write(open_msg(prompt, salt, max_new=max_new))
    await call.done_writing()
    opened = (await call.read()).opened
    tokens = []
    while True:
        verdict = (await call.read()).verdict
        tokens.extend(verdict.emitted_ids)
        if verdict.finish_reason:
            break
    return opened.cached_prompt_tokens, tokens


async def test_another_salt_finds_nothing_and_the_same_salt_shares(serve, models, drafter_models):
    model = models["gemma3"]
    want = greedy_reference(model, PROMPT, MAX_NEW)
    server = await serve(model)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        first = await generate(stub, HFDrafter(drafter_models["gemma3"]),
                               SessionRequest(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True,
                                              cache_salt="alice"),
                               settings=RoundSettings(draft_len=3))
        others = [await server_session(stub, PROMPT, salt) for salt in ("mallory", "", "alice ")]
        same = await server_session(stub, PROMPT, "alice")
    assert first.token_ids == want
    for cached, tokens in others:
        assert (cached, tokens) == (0, want)
    assert same == (len(SYSTEM), want)


async def test_another_host_with_the_same_salt_finds_nothing(tokenizer, models):
    """Over IPv4 and IPv6 loopback a dual-stack server sees two hosts (127.0.0.1 and ::1)."""
    model = models["gemma3"]
    want = greedy_reference(model, PROMPT, MAX_NEW)
    target = Target.from_model(model, tokenizer, "tiny")
    try:
        server = await start_server(target, ServerSettings(kv_budget=64 << 20), host="[::]")
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"no dual-stack loopback here: {exc}")
    try:
        results = []
        for address in (f"127.0.0.1:{server.port}", f"[::1]:{server.port}",
                        f"[::1]:{server.port}", f"127.0.0.1:{server.port}"):
            async with grpc.aio.insecure_channel(address) as channel:
                results.append(await server_session(VerifierStub(channel), PROMPT, ""))
    finally:
        await server.stop(grace=0)
    assert [cached for cached, _ in results] == [0, 0, len(SYSTEM), len(SYSTEM)]
    assert all(tokens == want for _, tokens in results)


async def test_the_daemon_salts_with_its_own_secret(serve, models, drafter_models, tokenizer):
    model = models["llama"]
    want = greedy_reference(model, PROMPT, MAX_NEW)
    server = await serve(model)
    device = Device(DeviceSettings(id="cam-3", servers=[server.address]),
                    load_drafter=lambda spec: HFDrafter(drafter_models["llama"], tokenizer, name=spec),
                    tokenizer=tokenizer)
    await device.start()
    try:
        tokens, _, lossless = await device.complete(Request(PROMPT, max_tokens=MAX_NEW,
                                                            ignore_eos=True))
    finally:
        await device.close()
    assert tokens == want and lossless
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        assert await server_session(stub, PROMPT, "") == (0, want)
        assert await server_session(stub, PROMPT, "cam-3") == (0, want)   # the id is no salt
        assert await server_session(stub, PROMPT, device.cache_salt) == (len(SYSTEM), want)


# --- the device side ------------------------------------------------------------------------------

def test_a_reopened_session_keeps_its_salt():
    request = SessionRequest([1, 2, 3], 8, Sampling(), cache_salt="cam-3")
    assert request.open_message([]).open.cache_salt == "cam-3"
    assert request.open_message([4, 5]).open.cache_salt == "cam-3"
    assert SessionRequest([1], 2).open_message([]).open.cache_salt == ""


def test_sled_generate_takes_a_cache_salt():
    from sled_cli.generate import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--server", "h:1", "--prompt", "x"]
    assert parser.parse_args(base).cache_salt == ""
    assert parser.parse_args(base + ["--cache-salt", "team-a"]).cache_salt == "team-a"
