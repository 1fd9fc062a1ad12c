"""Many addresses, one caller: a caller that neither a token nor a certificate names is told apart
by its host's address block, not the address alone. An IPv6 /64 is one caller (--caller-prefix-v6
64), every loopback address, 127.0.0.0/8 and ::1, one local machine's (--loopback-one-caller),
and IPv4 stays one caller per address unless --caller-prefix-v4 says otherwise. Its quotas and
its shares (Generate streams, calls, GetTokenizer replies, KV) follow the block; its prefix-cache
tenant stays its own address's, since a /64 is a whole LAN's and a cache hit tells what another
device sent."""
from __future__ import annotations

import grpc
import pytest

from sled.v1 import verifier_pb2 as pb
from sled.v1.verifier_pb2_grpc import VerifierStub
from verify_server.auth import Gate, access_of
from tests.conftest import serve_settings_of as settings_of
from verify_server.origin import CallerPrefixes, TrustedProxies
from verify_server.settings import ServerSettings, SettingsError

PROXY = "ipv4:10.0.0.2:40000"


@pytest.mark.parametrize("host, caller", [
    ("2001:db8:1:2::7", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
    ("2001:db8:1:3::7", "2001:db8:1:3::/64"),
    ("127.0.0.1", "loopback"),
    ("127.8.9.10", "loopback"),
    ("::ffff:127.0.0.9", "loopback"),             # loopback through a dual-stack socket
    ("::1", "loopback"),                          # the same machine over IPv6
    ("203.0.113.7", "203.0.113.7"),
    ("::ffff:203.0.113.7", "203.0.113.7"),
    ("unix:/run/sled.sock", "unix:/run/sled.sock"),
])
def test_the_defaults_make_a_v6_64_and_loopback_one_caller_each(host, caller):
    assert CallerPrefixes().caller(host) == caller


def test_the_prefixes_are_configurable():
    assert CallerPrefixes(v4=24).caller("203.0.113.7") == "203.0.113.0/24"
    assert CallerPrefixes(v6=48).caller("2001:db8:1:2::7") == "2001:db8:1::/48"
    assert CallerPrefixes(v6=128).caller("2001:db8:1:2::7") == "2001:db8:1:2::7"
    apart = CallerPrefixes(loopback=False)
    assert apart.caller("127.0.0.1") != apart.caller("127.0.0.2")
    assert apart.caller("::1") not in (apart.caller("127.0.0.1"), "loopback")
    assert CallerPrefixes(v4=16, loopback=False).caller("127.0.9.9") == "127.0.0.0/16"


def test_tokenless_callers_of_one_block_are_one_caller_each_its_own_tenant():
    gate = Gate(proxies=TrustedProxies(["10.0.0.0/8"]))
    identities = [gate.identify(metadata, {}, peer) for metadata, peer in (
        ((), "ipv6:[2001:db8:1:2::7]:5000"),
        ((), "ipv6:[2001:db8:1:2::8]:5001"),
        ([("x-forwarded-for", "2001:db8:1:2::9")], PROXY),       # the host a proxy forwards
    )]
    assert {identity.key for identity in identities} == {"host:2001:db8:1:2::/64"}
    assert [identity.tenant for identity in identities] == [
        "host:2001:db8:1:2::7", "host:2001:db8:1:2::8", "host:2001:db8:1:2::9"]
    assert gate.caller((), {}, "ipv6:[2001:db8:1:2::7]:1").key == "host:2001:db8:1:2::/64"
    assert gate.identify((), {}, "ipv6:[2001:db8:1:3::7]:1").key == "host:2001:db8:1:3::/64"
    local = [gate.identify((), {}, peer) for peer in ("ipv4:127.0.0.2:1", "ipv6:[::1]:1")]
    assert {identity.key for identity in local} == {"host:loopback"}
    assert local[0].tenant != local[1].tenant
    assert gate.identify((), {}, "ipv4:203.0.113.7:1").key != \
        gate.identify((), {}, "ipv4:203.0.113.8:1").key


def test_a_named_caller_is_its_name_from_any_address():
    gate = Gate(client_certs=True)
    names = {"x509_common_name": [b"dev-1"]}
    identity = gate.identify((), names, "ipv6:[2001:db8:1:2::7]:1")
    assert (identity.key, identity.tenant) == ("cert:dev-1", "cert:dev-1")


def test_the_server_settings_reach_the_gate(monkeypatch):
    defaults = ServerSettings()
    assert (defaults.caller_prefix_v4, defaults.caller_prefix_v6,
            defaults.loopback_one_caller) == (32, 64, True)
    monkeypatch.setenv("SLED_SERVE_CALLER_PREFIX_V4", "24")
    settings = settings_of("--caller-prefix-v6", "56", "--no-loopback-one-caller")
    gate, _ = access_of(settings)
    assert gate.prefixes == CallerPrefixes(v4=24, v6=56, loopback=False)


@pytest.mark.parametrize("argv, key", [(["--caller-prefix-v6", "129"], "caller_prefix_v6"),
                                       (["--caller-prefix-v6", "0"], "caller_prefix_v6"),
                                       (["--caller-prefix-v4", "33"], "caller_prefix_v4")])
def test_a_prefix_out_of_range_is_refused_naming_its_flag(argv, key):
    with pytest.raises(SettingsError) as caught:
        settings_of(*argv)
    assert key in str(caught.value) and argv[0] in str(caught.value)


# --- through a real server -----------------------------------------------------------------------

PROMPT = list(range(40, 120)) + [5]      # five 16-token blocks to find in the prefix cache


async def closed(call) -> None:
    """Close the session and wait until the server has (its quota slot is free then)."""
    await call.write(pb.DeviceMessage(close=pb.Close()))
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def opened(stub, server, forwarded: str):
    """A session opened as the host a trusted proxy (this test's client) forwards."""
    call = stub.Generate(metadata=(("x-forwarded-for", forwarded),))
    await call.write(pb.DeviceMessage(open=pb.Open(
        prompt_ids=PROMPT, max_new_tokens=4, ignore_eos=True,
        tokenizer_fingerprint=server.service.core.target.fingerprint)))
    return call, await call.read()


async def test_one_64_holds_one_quota_and_each_address_its_own_prefix_cache(serve, models):
    """Two addresses of one /64 share the session quota (1) but not their cached prompts: the
    second finds nothing of the first's, the first finds its own again; an address of the next
    /64 is another caller."""
    server = await serve(models["llama"], quota_sessions=1, trusted_proxies=["127.0.0.1"])
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        first, reply = await opened(stub, server, "2001:db8:1:2::7")
        assert reply.opened.cached_prompt_tokens == 0
        await closed(first)
        held, reply = await opened(stub, server, "2001:db8:1:2::8")
        assert reply.opened.cached_prompt_tokens == 0                         # its own tenant
        over, reply = await opened(stub, server, "2001:db8:1:2::9")
        assert reply.error.reason == pb.ErrorDetail.REASON_QUOTA              # one caller
        neighbour, reply = await opened(stub, server, "2001:db8:1:3::7")
        assert reply.WhichOneof("kind") == "opened"                           # another one
        await closed(held)
        again, reply = await opened(stub, server, "2001:db8:1:2::7")
        assert reply.opened.cached_prompt_tokens == len(PROMPT) // 16 * 16    # its own blocks
        for call in (over, neighbour, again):
            call.cancel()
