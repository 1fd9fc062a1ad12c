"""Behind a proxy every call's peer is the proxy: who a call is from comes from its token, else
the certificate name a trusted proxy verified, else the address a trusted proxy forwards. Those
headers are believed from --trusted-proxy addresses only, the certificate header only when
--proxy-cert-header names it; from anyone else they are ignored, so no device can claim another's
identity by sending them itself. Through a real server, two devices behind a trusted proxy hold
their own session quotas and prefix caches; behind an untrusted one they are one host."""
from __future__ import annotations

import logging

import grpc
import pytest

from sled.wire.auth import bearer_metadata
from sled.v1 import verifier_pb2 as pb
from sled.v1.verifier_pb2_grpc import VerifierStub
from tests.conftest import serve_settings_of as settings_of
from verify_server.auth import Gate, TokenFileError, access_of
from verify_server.errors import SessionError
from verify_server.origin import (CERT_HEADER, Origin, TrustedProxies, envoy_cert_name,
                                  forwarded_host, proxy_network)
from verify_server.settings import ServerSettings, SettingsError

PROXY = "ipv4:10.0.0.2:40000"              # a trusted proxy's connection
STRANGER = "ipv4:172.16.0.9:40000"         # anyone else
NETWORKS = ("10.0.0.0/8", "fd00::/8")
TOKEN = "tok-dev-1-aaaaaaaaaaaaaaaa"


def xff(*values: str) -> list[tuple[str, str]]:
    return [("x-forwarded-for", value) for value in values]


def cert(name: str, header: str = CERT_HEADER) -> list[tuple[str, str]]:
    return [(header, name)]


@pytest.fixture
def proxies() -> TrustedProxies:
    return TrustedProxies(NETWORKS, cert_header=CERT_HEADER)


# --- what a call's metadata and peer resolve to --------------------------------------------------

def test_a_trusted_proxy_forwards_its_clients_host(proxies):
    assert proxies.origin(xff("203.0.113.7"), PROXY) == Origin("203.0.113.7", (), "10.0.0.2")


def test_an_untrusted_peers_headers_are_ignored_and_its_own_certificate_kept(proxies):
    origin = proxies.origin(xff("203.0.113.7") + cert("dev-2"), STRANGER, ["dev-9"])
    assert origin == Origin("172.16.0.9", ("dev-9",), None)
    assert TrustedProxies().origin(xff("203.0.113.7"), PROXY) == Origin("10.0.0.2")   # none trusted


@pytest.mark.parametrize("peer, trusted", [
    ("ipv4:10.255.1.2:1", True),                  # inside 10.0.0.0/8
    ("ipv4:11.0.0.1:1", False),
    ("ipv6:[fd00::5]:443", True),                 # inside fd00::/8
    ("ipv6:%5Bfd12:3456::1%5D:443", True),        # percent-encoded brackets
    ("ipv6:[fe80::1]:443", False),
    ("ipv6:[::ffff:10.0.0.2]:1", True),           # IPv4 through a dual-stack socket
    ("unix:/run/sled.sock", False),
    ("", False),
])
def test_trust_is_by_address_and_network_v4_and_v6(proxies, peer, trusted):
    origin = proxies.origin(xff("203.0.113.7"), peer)
    assert (origin.host == "203.0.113.7") is trusted
    assert (origin.proxy is not None) is trusted


def test_a_single_address_trusts_that_host_only():
    proxies = TrustedProxies(["127.0.0.1", "::1"])
    assert proxies.trusts("127.0.0.1") and proxies.trusts("::1")
    assert not proxies.trusts("127.0.0.2") and not proxies.trusts("localhost")


@pytest.mark.parametrize("values, host", [
    (["198.51.100.1, 203.0.113.7"], "203.0.113.7"),        # the device's claim, then the proxy's
    (["198.51.100.1", "203.0.113.7"], "203.0.113.7"),      # the same as two header lines
    (["203.0.113.7, 10.0.0.3"], "203.0.113.7"),            # past a second trusted proxy
    (["garbage, 203.0.113.7"], "203.0.113.7"),             # what no trusted proxy added is not read
    (["[2001:db8::7]:443"], "2001:db8::7"),
    (["2001:db8::7"], "2001:db8::7"),
    (["203.0.113.7:5678"], "203.0.113.7"),
    (["::ffff:203.0.113.7"], "203.0.113.7"),
    (["10.0.0.4, 10.0.0.3"], "10.0.0.4"),                  # every hop a trusted proxy: the first
])
def test_x_forwarded_for_is_read_from_the_right_past_trusted_proxies(proxies, values, host):
    assert proxies.origin(xff(*values), PROXY).host == host


@pytest.mark.parametrize("values", [[], [""], ["unknown"], ["gpu-1.lan"], ["203.0.113.7, junk"],
                                    ["203.0.113.999"], ["[::1"]])
def test_a_missing_or_garbled_forwarded_address_leaves_the_proxys_host(proxies, values):
    origin = proxies.origin(xff(*values), PROXY)
    assert origin == Origin("10.0.0.2", (), "10.0.0.2") and origin.unnamed


def test_a_trusted_proxys_certificate_header_names_the_device_not_its_own_certificate(proxies):
    origin = proxies.origin(cert("dev-1") + xff("203.0.113.7"), PROXY, ["haproxy"])
    assert origin == Origin("203.0.113.7", ("dev-1",), "10.0.0.2") and not origin.unnamed
    # without the header, the connection's certificate is the proxy's: it names no device
    assert proxies.origin(xff("203.0.113.7"), PROXY, ["haproxy"]).names == ()


@pytest.mark.parametrize("metadata", [cert("dev-1") + cert("dev-2"), cert(""), cert("   ")])
def test_a_certificate_header_sent_twice_or_empty_is_ignored(proxies, metadata):
    assert proxies.origin(metadata, PROXY).names == ()


def test_the_certificate_header_is_the_configured_one():
    proxies = TrustedProxies(NETWORKS, cert_header="X-Client-CN")
    assert proxies.origin(cert("dev-1", "x-client-cn"), PROXY).names == ("dev-1",)
    assert proxies.origin(cert("dev-1"), PROXY).names == ()
    assert TrustedProxies(NETWORKS, cert_header="").origin(cert("dev-1"), PROXY).names == ()


def test_no_header_names_a_device_unless_the_operator_names_it():
    unnamed = TrustedProxies(NETWORKS)
    assert unnamed.cert_header == "" and not unnamed.name_devices
    for header in (CERT_HEADER, "x-forwarded-client-cert"):
        assert unnamed.origin(cert("dev-a", header) + xff("203.0.113.7"), PROXY).names == ()
    gate = Gate(proxies=unnamed, require_identity=True)
    with pytest.raises(SessionError) as refused:
        gate.identify(cert("dev-a"), {}, PROXY)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert ServerSettings().proxy_cert_header == ""


@pytest.mark.parametrize("value, name", [
    ('By=spiffe://sled/gpu;Hash=ab12;Subject="CN=dev-1,O=fleet";DNS=dev-1.lan', "dev-1"),
    ('Hash=ab12;Subject="O=fleet,CN=dev-1"', "dev-1"),                 # RFC 2253 order
    ('Hash=ab12;Subject="/C=US/O=fleet/CN=dev-1"', "dev-1"),           # OpenSSL's one-line form
    ('Hash=ab12;Subject="CN=a\\,b,O=x"', "a,b"),                       # an escaped comma
    ('Hash=ab12;DNS=dev-2;DNS=dev-2.lan', "dev-2"),                    # no subject: its DNS name
    ('Hash=1;Subject="CN=old";DNS=x,Hash=2;Subject="CN=dev-3"', "dev-3"),   # the nearest proxy's
    ('Hash=ab12;Subject=""', None),
    ("", None),
])
def test_envoys_forwarded_client_cert_yields_its_common_name(value, name):
    assert envoy_cert_name(value) == name


def test_envoys_header_is_read_in_its_format():
    proxies = TrustedProxies(NETWORKS, cert_header="x-forwarded-client-cert")
    value = 'Hash=ab12;Subject="CN=dev-1,O=fleet";DNS=dev-1'
    assert proxies.origin([("x-forwarded-client-cert", value)], PROXY).names == ("dev-1",)


@pytest.mark.parametrize("entry, host", [("1.2.3.4", "1.2.3.4"), (" 1.2.3.4 ", "1.2.3.4"),
                                         ("1.2.3.4:80", "1.2.3.4"), ("[::1]:80", "::1"),
                                         ("::1", "::1"), ("unknown", None), ("1.2.3", None),
                                         ("_hidden", None), ("1.2.3.4:80:90", None),
                                         ("1.2.3.4:http", None), ("[::1]x", None), ("[::1", None),
                                         ("[::1]5", None), ("1.2.3.4:", None)])
def test_forwarded_entries(entry, host):
    assert forwarded_host(entry) == host


# --- identities: the gate ------------------------------------------------------------------------

def token_file(path, line: str = f"dev-1 {TOKEN}"):
    path.write_text(line + "\n")
    return path


def test_tokenless_devices_behind_a_trusted_proxy_are_their_forwarded_hosts(proxies):
    gate = Gate(proxies=proxies)
    one = gate.identify(xff("203.0.113.7"), {}, PROXY)
    two = gate.identify(xff("203.0.113.8"), {}, PROXY)
    assert (one.key, two.key) == ("host:203.0.113.7", "host:203.0.113.8")
    assert not one.authenticated
    assert gate.caller(xff("203.0.113.7"), {}, PROXY) == one       # the bounds see the same


def test_a_device_cannot_claim_another_identity_by_sending_the_headers_itself(proxies):
    gate = Gate(proxies=proxies)
    claimed = xff("203.0.113.7") + cert("dev-1")
    for resolve in (gate.identify, gate.caller):
        assert resolve(claimed, {}, STRANGER).key == "host:172.16.0.9"
    assert gate.identify(claimed, {}, PROXY).key == "cert:dev-1"     # from the proxy it holds


def test_a_token_wins_over_any_header(tmp_path, proxies):
    gate = Gate(token_file(tmp_path / "tokens"), proxies=proxies)
    metadata = [*bearer_metadata(TOKEN), *cert("dev-2"), *xff("203.0.113.7")]
    assert gate.identify(metadata, {}, PROXY).key == "device:dev-1"
    assert gate.caller(metadata, {}, PROXY).key == "device:dev-1"
    with pytest.raises(SessionError) as refused:     # a header is no token
        gate.identify(cert("dev-1"), {}, PROXY)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_pinned_token_is_satisfied_by_the_trusted_proxys_verified_certificate(tmp_path, proxies):
    gate = Gate(token_file(tmp_path / "tokens", f"dev-1 {TOKEN} cert=dev-1"), proxies=proxies)
    token = list(bearer_metadata(TOKEN))
    assert gate.identify(token + cert("dev-1"), {}, PROXY).key == "device:dev-1"
    for metadata, peer in ((token + cert("dev-1"), STRANGER), (token + cert("dev-2"), PROXY),
                           (token, PROXY)):
        with pytest.raises(SessionError) as refused:
            gate.identify(metadata, {}, peer)
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert gate.caller(metadata, {}, peer).key != "device:dev-1"


def test_require_identity_refuses_a_device_no_certificate_names(proxies):
    gate = Gate(proxies=proxies, require_identity=True)
    assert gate.identify(cert("dev-1"), {}, PROXY).key == "cert:dev-1"
    for metadata, peer in ((xff("203.0.113.7"), PROXY), (cert("dev-1"), STRANGER)):
        with pytest.raises(SessionError) as refused:
            gate.identify(metadata, {}, peer)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "--require-identity" in refused.value.message
        assert "--client-cert" in refused.value.message
    assert gate.caller(xff("203.0.113.7"), {}, PROXY).key == "host:203.0.113.7"   # never refused


def test_an_unnamed_call_through_a_trusted_proxy_is_pooled_and_said_once(proxies, caplog):
    gate = Gate(proxies=proxies)
    with caplog.at_level(logging.WARNING, logger="sled.server.auth"):
        keys = {gate.identify((), {}, PROXY).key for _ in range(3)}
    assert keys == {"host:10.0.0.2"}
    warnings = [r.getMessage() for r in caplog.records if "carried neither" in r.getMessage()]
    assert len(warnings) == 1 and "10.0.0.2" in warnings[0] and "--require-identity" in warnings[0]


def test_pins_need_mutual_tls_or_a_proxy_that_verifies_certificates(tmp_path):
    tokens = str(token_file(tmp_path / "tokens", f"dev-1 {TOKEN} cert=dev-1"))
    gate, _ = access_of(ServerSettings(auth_tokens=tokens, trusted_proxies=["10.0.0.0/8"],
                                       proxy_cert_header=CERT_HEADER))
    assert gate.certificates and gate.proxies.trusts("10.9.8.7")
    for settings in (ServerSettings(auth_tokens=tokens),
                     ServerSettings(auth_tokens=tokens, trusted_proxies=["10.0.0.0/8"])):
        with pytest.raises(TokenFileError, match=f"--trusted-proxy and --proxy-cert-header "
                                                 f"{CERT_HEADER}"):
            access_of(settings)


# --- settings and flags --------------------------------------------------------------------------

def test_trusted_proxies_repeat_and_take_comma_lists(monkeypatch):
    assert ServerSettings().trusted_proxies == () and not ServerSettings().require_identity
    settings = settings_of("--trusted-proxy", "10.0.0.5", "--trusted-proxies",
                           "fd00::/8, 192.168.0.0/16")
    assert settings.trusted_proxies == ("10.0.0.5/32", "fd00::/8", "192.168.0.0/16")
    monkeypatch.setenv("SLED_SERVE_TRUSTED_PROXIES", "10.0.0.0/8,::1")
    assert settings_of().trusted_proxies == ("10.0.0.0/8", "::1/128")
    assert settings_of("--proxy-cert-header", "X-Client-CN").proxy_cert_header == "x-client-cn"


@pytest.mark.parametrize("argv, says", [
    (["--trusted-proxy", "10.0.0.300"], "'10.0.0.300' is not an IP address or network"),
    (["--trusted-proxy", "10.0.0.5/8"], "write 10.0.0.0/8"),
    (["--trusted-proxy", "proxy.lan"], "not an IP address"),
    (["--proxy-cert-header", "x cert"], "cannot carry a certificate name"),
    (["--proxy-cert-header", "grpc-cert"], "not grpc-*"),
    (["--proxy-cert-header", "x-cert-bin"], "*-bin"),
    (["--require-identity"], "require_identity refuses every call"),
    (["--require-identity", "--trusted-proxy", "10.0.0.1", "--proxy-cert-header", ""],
     "require_identity refuses every call"),
    (["--require-identity", "--trusted-proxy", "10.0.0.1"], "with --proxy-cert-header"),
    (["--proxy-cert-header", CERT_HEADER], "believed only from a --trusted-proxy"),
])
def test_bad_proxy_settings_name_the_key_and_the_flag(argv, says):
    with pytest.raises(SettingsError) as caught:
        settings_of(*argv)
    assert says in str(caught.value)
    key = argv[0].lstrip("-").replace("-", "_")
    assert key in str(caught.value) or key.rstrip("y") + "ies" in str(caught.value)


def test_a_proxy_network_is_one_address_or_a_cidr_network():
    assert str(proxy_network("10.0.0.5")) == "10.0.0.5/32"
    assert str(proxy_network(" fd00::/8 ")) == "fd00::/8"
    with pytest.raises(ValueError, match="write fe80::/10"):
        proxy_network("fe80::1/10")


@pytest.mark.parametrize("entry, network", [("::ffff:10.0.0.5", "10.0.0.5/32"),
                                            ("::ffff:10.0.0.0/104", "10.0.0.0/8"),
                                            ("::ffff:0:0/96", "0.0.0.0/0")])
def test_an_ipv4_mapped_proxy_network_is_its_ipv4_network(entry, network):
    """A peer's mapped address is read as IPv4 (peer_host): a mapped entry is too, or it would
    never match."""
    assert str(proxy_network(entry)) == network
    assert settings_of("--trusted-proxy", entry).trusted_proxies == (network,)
    proxies = TrustedProxies([entry])
    assert proxies.trusts("10.0.0.5")
    assert proxies.origin(xff("203.0.113.7"), "ipv6:[::ffff:10.0.0.5]:1").host == "203.0.113.7"


def test_a_wide_trusted_network_is_warned_of_as_the_server_starts(caplog):
    proxies = TrustedProxies(["0.0.0.0/0", "::/0", "10.0.0.0/8", "fd00::/32", "10.0.0.5"],
                             cert_header=CERT_HEADER)
    with caplog.at_level(logging.WARNING, logger="sled.server.origin"):
        proxies.warn_wide()
        TrustedProxies(["10.0.0.0/8", "fd00::/32"]).warn_wide()
    warned = [record.getMessage() for record in caplog.records]
    assert len(warned) == 2
    assert warned[0].startswith("--trusted-proxy 0.0.0.0/0 is wider than an IPv4 /8")
    assert warned[1].startswith("--trusted-proxy ::/0 is wider than an IPv6 /32")
    assert all(f"x-forwarded-for and {CERT_HEADER}" in line for line in warned)


async def test_the_server_warns_of_a_wide_trusted_network(serve, models, caplog):
    with caplog.at_level(logging.WARNING, logger="sled.server.origin"):
        await serve(models["llama"], trusted_proxies=["0.0.0.0/0"])
    assert any("--trusted-proxy 0.0.0.0/0 is wider" in r.getMessage() for r in caplog.records)


# --- through a real server -----------------------------------------------------------------------

PROMPT = list(range(40, 120)) + [5]      # five 16-token blocks to find in the prefix cache
DEVICE_A, DEVICE_B = xff("203.0.113.7"), xff("203.0.113.8")


async def opened(stub, fingerprint: str, metadata):
    """A device-drafts session's call and its first reply (Opened or the refusal)."""
    call = stub.Generate(metadata=tuple(metadata))
    await call.write(pb.DeviceMessage(open=pb.Open(prompt_ids=PROMPT, max_new_tokens=4,
                                                   ignore_eos=True,
                                                   tokenizer_fingerprint=fingerprint)))
    return call, await call.read()


async def closed(call) -> None:
    """Close the session and wait until the server has (its status comes after)."""
    await call.write(pb.DeviceMessage(close=pb.Close()))
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def cached_tokens(stub, fingerprint: str, metadata) -> int:
    call, reply = await opened(stub, fingerprint, metadata)
    assert reply.WhichOneof("kind") == "opened", reply
    await closed(call)
    return reply.opened.cached_prompt_tokens


@pytest.mark.parametrize("trusted", [True, False], ids=["trusted-proxy", "untrusted-proxy"])
async def test_devices_behind_a_trusted_proxy_hold_their_own_quotas_and_caches(serve, models,
                                                                               trusted):
    """The test's client is the proxy (127.0.0.1) and sends what a proxy would. Trusted: two
    forwarded hosts are two devices, each with its one session (--quota-sessions 1) and its own
    prefix cache, and the certificate header names a third. Untrusted (another network listed):
    the headers are ignored and all of them are the one host 127.0.0.1."""
    server = await serve(models["llama"], quota_sessions=1, proxy_cert_header=CERT_HEADER,
                         trusted_proxies=["127.0.0.1"] if trusted else ["10.255.0.0/16"])
    fingerprint = server.service.core.target.fingerprint
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        first = await cached_tokens(stub, fingerprint, DEVICE_A)
        other = await cached_tokens(stub, fingerprint, DEVICE_B)
        again = await cached_tokens(stub, fingerprint, DEVICE_A)
        assert (first, again) == (0, len(PROMPT) // 16 * 16)
        assert other == (0 if trusted else again)

        held, reply = await opened(stub, fingerprint, DEVICE_A)
        assert reply.WhichOneof("kind") == "opened"
        over, reply = await opened(stub, fingerprint, DEVICE_A)
        assert reply.error.reason == pb.ErrorDetail.REASON_QUOTA
        assert await over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        neighbour, reply = await opened(stub, fingerprint, DEVICE_B)
        assert reply.WhichOneof("kind") == ("opened" if trusted else "error")
        named, reply = await opened(stub, fingerprint, DEVICE_A + cert("dev-c"))
        assert reply.WhichOneof("kind") == ("opened" if trusted else "error")
        for call in (held, neighbour, named):
            call.cancel()
    devices = server.metrics.value("sled_device_sessions_total", {"device": "dev-c"})
    assert devices == (1 if trusted else 0)
