"""The load balancer configurations users copy from deploy/: HAProxy's is valid and sends the
same gRPC health check the replicas tests run (lab.proxy); Envoy's (not run here: no Envoy in
the Debian packages) speaks HTTP/2 to the replicas, routes each gRPC stream on its own and
checks them through grpc.health.v1. Neither lets a device name itself: through the shipped
HAProxy config (run here, its mutual-TLS lines too) a device that forges the certificate header
and x-forwarded-for takes neither another device's identity nor another host's quota; Envoy's
file appends the device's address and sanitizes the certificate headers."""
from __future__ import annotations

import contextlib
import re
import signal
import subprocess
from pathlib import Path

import grpc
import pytest
import yaml

from edge_client.security import ChannelSecurity
from lab.proxy import HEALTH_CHECK_SEND, HEALTH_CHECK_SERVING, haproxy_binary, haproxy_config
from lab.server_process import HOST, Child, free_port, wait_listening
from sled.pki import make_certs
from sled.v1 import verifier_pb2 as pb
from sled.wire.auth import bearer_metadata
from verify_server.origin import CERT_HEADER

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
needs_haproxy = pytest.mark.skipif(haproxy_binary() is None, reason="HAProxy is not installed "
                                   "(make haproxy, or apt-get install haproxy)")


def haproxy_check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([haproxy_binary(), "-c", "-f", str(path)], capture_output=True,
                          text=True, timeout=30)


@needs_haproxy
def test_the_haproxy_configs_are_valid(tmp_path):
    assert haproxy_check(DEPLOY / "haproxy.cfg").returncode == 0
    rendered = tmp_path / "haproxy.cfg"
    rendered.write_text(haproxy_config("127.0.0.1:50051", ["127.0.0.1:50052", "127.0.0.1:50053"]))
    done = haproxy_check(rendered)
    assert done.returncode == 0, done.stdout + done.stderr


def rules(text: str) -> dict[str, str]:
    """The lines of an haproxy.cfg that decide balancing, health and the forwarded address, by their first words."""
    keys = ("balance", "option tcp-check", "tcp-check send-binary", "tcp-check expect binary",
            "option redispatch", "option forwardfor", "bind", "default-server",
            "http-request del-header")
    found = {}
    for line in text.splitlines():
        line = line.strip()
        for key in keys:
            if line.startswith(key + " ") or line == key:
                found[key] = line[len(key):].strip()
    return found


def test_the_deployed_haproxy_config_follows_the_tested_rules():
    deployed = rules((DEPLOY / "haproxy.cfg").read_text())
    tested = rules(haproxy_config("0.0.0.0:50051", ["10.0.0.11:50051"]))
    assert deployed["tcp-check send-binary"] == HEALTH_CHECK_SEND.hex()
    assert deployed["tcp-check expect binary"] == HEALTH_CHECK_SERVING.hex()
    for key in ("balance", "option tcp-check", "tcp-check send-binary", "tcp-check expect binary",
                "option redispatch", "option forwardfor", "http-request del-header"):
        assert deployed[key] == tested[key], key
    assert deployed["http-request del-header"] == CERT_HEADER
    assert deployed["bind"].endswith("proto h2") and tested["bind"].endswith("proto h2")
    assert re.search(r"\bproto h2\b", deployed["default-server"])
    assert re.search(r"\bcheck\b", deployed["default-server"])


def test_the_envoy_config_balances_streams_over_http2_with_grpc_health_checks():
    config = yaml.safe_load((DEPLOY / "envoy.yaml").read_text())["static_resources"]
    cluster, = config["clusters"]
    assert cluster["lb_policy"] == "LEAST_REQUEST"       # per stream, not by a hash of the caller
    options = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in options["explicit_http_config"]
    check, = cluster["health_checks"]
    assert "grpc_health_check" in check
    assert len(cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]) >= 2
    manager = config["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert manager["codec_type"] == "HTTP2"
    route, = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["cluster"] == cluster["name"] and route["route"]["timeout"] == "0s"
    assert "hash_policy" not in route["route"]


def test_the_envoy_config_lets_no_device_name_itself():
    """Envoy appends the device's own address to x-forwarded-for and believes none a device
    sent; x-forwarded-client-cert comes only from a certificate Envoy verified, and the name a
    device sent as x-sled-client-cert is removed."""
    config = yaml.safe_load((DEPLOY / "envoy.yaml").read_text())["static_resources"]
    manager = config["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert manager["use_remote_address"] is True
    assert manager["xff_num_trusted_hops"] == 0
    assert manager["forward_client_cert_details"] in ("SANITIZE", "SANITIZE_SET")
    assert manager["set_current_client_cert_details"]["subject"] is True
    assert CERT_HEADER in manager["route_config"]["request_headers_to_remove"]


async def test_a_proxy_announced_by_two_replicas_stays_up_while_one_does():
    """Replicas behind one proxy each announce its address (`--announce-endpoint PROXY`) under
    their own server ids: one replica's last will leaves the proxy online, both leave it off."""
    from edge_client.servers import ServerDirectory

    directory = ServerDirectory()
    for server_id in ("gpu-0", "gpu-1"):
        directory.announce(server_id, "proxy.lan:50051")
    proxy = directory.servers["proxy.lan:50051"]
    directory.withdraw("gpu-0")
    assert proxy.online
    directory.announce("gpu-0", "proxy.lan:50051")
    directory.announce("gpu-1", "proxy.lan:50051", online=False)
    assert proxy.online
    directory.withdraw("gpu-0")
    assert not proxy.online
    directory.announce("gpu-1", "proxy.lan:50051")
    assert proxy.online


# --- through the shipped HAProxy config: no device names itself --------------------------------

PROXY_HOST = "127.0.0.2"      # the proxy's address toward the server, the one it trusts; devices
OTHER_HOST = "203.0.113.9"    # dial from 127.0.0.1 (one caller: loopback)
FORGED_NAME = [(CERT_HEADER, "dev-a")]
FORGED_HOST = [("x-forwarded-for", OTHER_HOST)]
DEL_HEADER, FORWARDFOR = f"    http-request del-header {CERT_HEADER}", "    option forwardfor"


def one_line(pattern: str, replacement: str, text: str) -> str:
    """TEXT with the one line PATTERN matches replaced (a regular expression, multiline)."""
    text, found = re.subn(pattern, replacement, text, flags=re.MULTILINE)
    assert found == 1, pattern
    return text


def shipped_haproxy(folder: Path, port: int, backend: str, pki=None, drop=()) -> Path:
    """deploy/haproxy.cfg on loopback: devices dial PORT, one server line for BACKEND reached from
    PROXY_HOST; with pki (sled.pki.Pki) its commented mutual-TLS lines in force, the proxy's
    certificate the server's of PKI; DROP: lines left out, to show what each one stops."""
    text = (DEPLOY / "haproxy.cfg").read_text()
    text = one_line(r"^    server replica-1 .*\n", "", text)
    text = one_line(r"^    server replica-0 .*$", f"    server replica-0 {backend} source "
                    f"{PROXY_HOST}", text)
    if pki is None:
        text = one_line(r"^    bind 0\.0\.0\.0:50051 proto h2$", f"    bind {HOST}:{port} proto h2",
                        text)
    else:
        crt = folder / "proxy.pem"
        crt.write_text(pki.server_cert.read_text() + pki.server_key.read_text())
        text = one_line(r"^    bind 0\.0\.0\.0:50051 proto h2\n", "", text)
        text = one_line(r"^    #bind 0\.0\.0\.0:50051 ssl crt certs/proxy\.pem "
                        r"ca-file certs/ca\.pem", f"    bind {HOST}:{port} ssl crt {crt} "
                        f"ca-file {pki.ca}", text)
        text = one_line(r"^    #http-request set-header ", "    http-request set-header ", text)
    for line in drop:
        text = one_line("^" + re.escape(line) + "\n", "", text)
    config = folder / "haproxy.cfg"
    config.write_text(text)
    return config


@contextlib.asynccontextmanager
async def through_haproxy(folder: Path, server, pki=None, drop=()):
    """HAProxy running the shipped config in front of SERVER (in-process): the address devices
    dial."""
    port = free_port()
    config = shipped_haproxy(folder, port, server.address, pki, drop)
    child = Child("haproxy", [haproxy_binary(), "-db", "-f", str(config)], folder / "haproxy.log")
    child.start()
    try:
        await wait_listening(child, port, 15)
        yield f"{HOST}:{port}"
    finally:
        await child.kill(signal.SIGTERM)


async def opened_or_refused(stub, server, metadata=()) -> tuple[object, object]:
    """A device-drafts session's call and what its Open got: "opened", or the refusal's status."""
    call = stub.Generate(metadata=tuple(metadata))
    await call.write(pb.DeviceMessage(open=pb.Open(
        prompt_ids=[5, 6, 7, 8], max_new_tokens=4, ignore_eos=True,
        tokenizer_fingerprint=server.service.core.target.fingerprint)))
    reply = await call.read()
    if reply.WhichOneof("kind") == "opened":
        return call, "opened"
    await call.done_writing()              # the server ends a refused call at the half-close
    return call, await call.code()


def sessions_of(server, device: str) -> float:
    return server.metrics.value("sled_device_sessions_total", {"device": device})


def trusting(**settings) -> dict:
    """Settings of a server behind the proxy, which names devices in CERT_HEADER."""
    return {"trusted_proxies": [PROXY_HOST], "proxy_cert_header": CERT_HEADER, **settings}


@needs_haproxy
@pytest.mark.parametrize("drop, believed", [((), ()), ((DEL_HEADER,), ("name",)),
                                            ((FORWARDFOR,), ("host",))],
                         ids=["shipped", "without-del-header", "without-forwardfor"])
async def test_a_device_forging_both_headers_stays_its_own_caller(serve, models, tmp_path, drop,
                                                                  believed):
    """--quota-sessions 1 for a caller no token names: the device holds its one session, and a
    second one, claiming to be dev-a or another host, is refused as the same caller. Each line
    of the config left out lets its header through, and the same claim opens a session."""
    server = await serve(models["llama"], **trusting(quota_sessions=1))
    async with through_haproxy(tmp_path, server, drop=drop) as address, \
            grpc.aio.insecure_channel(address) as channel:
        stub = ChannelSecurity().stub(channel)
        held, own = await opened_or_refused(stub, server)
        named, as_dev_a = await opened_or_refused(stub, server, FORGED_NAME)
        moved, as_other = await opened_or_refused(stub, server, FORGED_HOST)
        for call in (held, named, moved):
            call.cancel()
    assert own == "opened"
    over = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (as_dev_a, as_other) == ("opened" if "name" in believed else over,
                                    "opened" if "host" in believed else over)
    assert sessions_of(server, "dev-a") == (1 if "name" in believed else 0)


@needs_haproxy
async def test_a_forged_name_passes_neither_require_identity_nor_a_pin(serve, models, tmp_path):
    """Through the shipped config: a device with no certificate that says it is dev-a is refused
    by a server that serves only named devices; with dev-a's token (pinned cert=dev-a), it is
    still not dev-a."""
    pki = make_certs(tmp_path / "certs", ["dev-a"])
    token = pki.device_files("dev-a").token.read_text().strip()
    for settings, metadata, refusal in (
            (trusting(require_identity=True), FORGED_NAME, grpc.StatusCode.UNAUTHENTICATED),
            (trusting(auth_tokens=str(pki.tokens)), FORGED_NAME + list(bearer_metadata(token)),
             grpc.StatusCode.PERMISSION_DENIED)):
        server = await serve(models["llama"], **settings)
        folder = tmp_path / refusal.name
        folder.mkdir()
        async with through_haproxy(folder, server) as address, \
                grpc.aio.insecure_channel(address) as channel:
            _, outcome = await opened_or_refused(ChannelSecurity().stub(channel), server, metadata)
        assert outcome == refusal
        assert sessions_of(server, "dev-a") == 0


@needs_haproxy
async def test_its_mutual_tls_lines_name_only_a_verified_certificate(serve, models, tmp_path):
    """The commented lines in force (TLS ends at the proxy, client certificates optional): dev-a's
    certificate names dev-a; no certificate and a forged dev-a is refused (--require-identity);
    dev-b's certificate and a forged dev-a is dev-b."""
    pki = make_certs(tmp_path / "certs", ["dev-a", "dev-b"])
    server = await serve(models["llama"], **trusting(require_identity=True))
    outcomes = []
    async with through_haproxy(tmp_path, server, pki) as address:
        for device, metadata in (("dev-a", ()), (None, FORGED_NAME), ("dev-b", FORGED_NAME)):
            files = pki.device_files(device) if device else None
            security = ChannelSecurity.from_files(pki.ca, files and files.cert,
                                                  files and files.key)
            async with security.channel(address) as channel:
                call, outcome = await opened_or_refused(security.stub(channel), server, metadata)
                call.cancel()
            outcomes.append(outcome)
    assert outcomes == ["opened", grpc.StatusCode.UNAUTHENTICATED, "opened"]
    assert (sessions_of(server, "dev-a"), sessions_of(server, "dev-b")) == (1, 1)
