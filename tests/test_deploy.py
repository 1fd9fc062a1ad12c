"""The load balancer configurations users copy from deploy/: HAProxy's is valid and sends the
same gRPC health check the replicas tests run (lab.proxy); Envoy's (not run here: no Envoy in
the Debian packages) speaks HTTP/2 to the replicas, routes each gRPC stream on its own and
checks them through grpc.health.v1."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from lab.proxy import HEALTH_CHECK_SEND, HEALTH_CHECK_SERVING, haproxy_binary, haproxy_config

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
            "option redispatch", "option forwardfor", "bind", "default-server")
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
                "option redispatch", "option forwardfor"):
        assert deployed[key] == tested[key], key
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
