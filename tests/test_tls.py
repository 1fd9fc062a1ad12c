"""TLS between devices and the server, with certificates from `sled certs`: plaintext and TLS
refused both ways with a message that says so, mutual TLS refusing a device without a client
certificate or with one from another CA, tokens pinned to a certificate name, an impostor server
announced over MQTT never used, and `sled serve` itself: TLS flags, a bad file, SIGHUP."""
from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from conftest import greedy_reference, run_sled
from drafters.ngram import NgramDrafter
from edge_client.connection import Connection
from edge_client.security import ChannelSecurity
from edge_client.servers import ServerDirectory
from edge_client.session import generate
from edge_client.wire import SessionRequest
from lab.server_process import ServerProcess
from lab.tiny import cached_pair
from sled.v1 import verifier_pb2 as pb
from sled.pki import make_certs

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"), ["dev-1", "dev-2"])


@pytest.fixture(scope="module")
def impostor(tmp_path_factory):
    """Another CA, with a server and a "dev-1" of its own."""
    return make_certs(tmp_path_factory.mktemp("impostor"), ["dev-1"])


def tls_settings(pki, mutual: bool = False, tokens: bool = False) -> dict:
    settings = {"tls_cert": str(pki.server_cert), "tls_key": str(pki.server_key)}
    if mutual:
        settings["tls_client_ca"] = str(pki.ca)
    if tokens:
        settings["auth_tokens"] = str(pki.tokens)
    return settings


def device(pki, device_id: str | None = None, ca=None, token: bool = False, **kwargs):
    """A device's ChannelSecurity: trusting `ca` (default pki's), with device_id's certificate."""
    files = pki.device_files(device_id) if device_id else None
    return ChannelSecurity.from_files(
        ca or pki.ca, files.cert if files else None, files.key if files else None,
        files.token.read_text().strip() if token and files else "", **kwargs)


async def why_refused(address: str, security: ChannelSecurity, tls_name: str = "") -> str:
    async with Connection(address, security, tls_name) as conn:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await conn.model_info(timeout=5, wait_for_ready=False)
        return await conn.explain(caught.value)


async def lossless(address, security, model, n: int = 6):
    async with Connection(address, security) as conn:
        result = await generate(conn.stub, NgramDrafter(), SessionRequest(PROMPT, max_new_tokens=n))
    assert result.token_ids == greedy_reference(model, PROMPT, n)


# --- TLS and plaintext, both ways ---------------------------------------------------------------

async def test_tls_serves_a_device_that_trusts_its_ca(serve, models, pki):
    server = await serve(models["llama"], **tls_settings(pki))
    await lossless(server.address, device(pki), models["llama"])


async def test_a_plaintext_device_is_told_the_server_speaks_tls(serve, models, pki):
    server = await serve(models["llama"], **tls_settings(pki))
    why = await why_refused(server.address, ChannelSecurity())
    assert "speaks TLS" in why and "--server-ca" in why, why


async def test_a_tls_device_is_told_the_server_does_not_speak_tls(serve, models, pki):
    server = await serve(models["llama"])
    why = await why_refused(server.address, device(pki))
    assert "does not speak TLS" in why, why


async def test_a_server_whose_certificate_another_ca_signed_is_refused(serve, models, pki,
                                                                       impostor):
    server = await serve(models["llama"], **tls_settings(impostor))
    why = await why_refused(server.address, device(pki))
    assert "did not sign" in why, why


async def test_a_certificate_not_for_the_name_dialed_is_refused(serve, models, pki):
    server = await serve(models["llama"], **tls_settings(pki))
    why = await why_refused(server.address, device(pki), tls_name="gpu-9.lan")
    assert "not for the name dialed" in why, why


# --- mutual TLS ---------------------------------------------------------------------------------

async def test_mutual_tls_refuses_a_device_without_a_certificate_or_with_a_foreign_one(
        serve, models, pki, impostor):
    server = await serve(models["llama"], **tls_settings(pki, mutual=True))
    why = await why_refused(server.address, device(pki))
    assert "asks for a client certificate" in why, why
    foreign = ChannelSecurity.from_files(pki.ca, impostor.device_files("dev-1").cert,
                                         impostor.device_files("dev-1").key)
    why = await why_refused(server.address, foreign)
    assert "asks for a client certificate" in why, why
    await lossless(server.address, device(pki, "dev-1"), models["llama"])
    # without a token file the certificate names the device
    assert server.metrics.value("sled_device_sessions_total", {"device": "dev-1"}) == 1


async def test_a_pinned_token_needs_its_own_certificate(serve, models, pki):
    """sled certs pins each token to its device's certificate: dev-1's token over dev-2's
    certificate is PERMISSION_DENIED; over its own it generates."""
    server = await serve(models["llama"], **tls_settings(pki, mutual=True, tokens=True))
    token = pki.device_files("dev-1").token.read_text().strip()
    crossed = ChannelSecurity.from_files(pki.ca, pki.device_files("dev-2").cert,
                                         pki.device_files("dev-2").key, token)
    async with Connection(server.address, crossed) as conn:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await conn.model_info(timeout=5)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "refused this device" in await conn.explain(caught.value)
    await lossless(server.address, device(pki, "dev-1", token=True), models["llama"])
    assert server.metrics.value("sled_device_sessions_total", {"device": "dev-1"}) == 1


async def test_a_secured_device_daemon_generates_losslessly_under_concurrency(
        serve, models, drafter_models, tokenizer, prompts, pki):
    """The daemon's own settings (server_ca, client_cert, client_key, token) against mutual TLS
    with pinned tokens: concurrent requests, every output the target's own."""
    from edge_client.daemon import Request
    from test_device import make_device

    server = await serve(models["llama"], **tls_settings(pki, mutual=True, tokens=True))
    files = pki.device_files("dev-1")
    daemon = make_device([server.address], drafter_models["llama"], tokenizer,
                         server_ca=pki.ca, client_cert=files.cert, client_key=files.key,
                         token=files.token.read_text().strip())
    await daemon.start()
    try:
        assert daemon.state == "ready", daemon.reason
        outputs = await asyncio.gather(*(daemon.complete(Request(p, max_tokens=12, ignore_eos=True))
                                         for p in prompts[:4]))
    finally:
        await daemon.close()
    for prompt, (tokens, _, lossless) in zip(prompts, outputs):
        assert tokens == greedy_reference(models["llama"], prompt, 12) and lossless
    assert server.metrics.value("sled_device_sessions_total", {"device": "dev-1"}) == 4


# --- announced servers ----------------------------------------------------------------------------

async def test_a_fake_announcement_does_not_redirect_a_tls_device(serve, models, pki, impostor):
    """The impostor announces itself as idle (load 0) beside the real server (load 0.9): a TLS
    device probes it, the handshake fails, and it keeps using the real one."""
    real = await serve(models["llama"], **tls_settings(pki))
    fake = await serve(models["llama"], **tls_settings(impostor))
    directory = ServerDirectory([real.address], security=device(pki))
    directory.announce("real", real.address, load=0.9)
    directory.announce("gpu-2", fake.address, load=0.0)
    await directory.probe_all()
    assert directory.pick().endpoint == real.address
    entry = directory.servers[fake.address]
    assert entry.reachable is False and "did not sign" in entry.problem
    await directory.close()


async def test_an_announced_name_outside_server_names_is_never_dialed(pki):
    directory = ServerDirectory([], security=device(pki, server_names=["gpu-1.lan"]))
    directory.announce("gpu-x", "10.9.9.9:50051", tls_name="evil.lan")
    entry = directory.servers["10.9.9.9:50051"]
    assert "not one of this device's server_names" in entry.problem
    await directory.probe(entry)
    assert entry.connection is None and entry.reachable is None      # nothing was dialed
    with pytest.raises(Exception, match="no compatible verify server"):
        directory.pick()
    listed = ServerDirectory([], security=device(pki, server_names=["gpu-1.lan"]))
    listed.announce("gpu-1", "10.9.9.9:50051", tls_name="gpu-1.lan")
    assert not listed.servers["10.9.9.9:50051"].untrusted


def test_an_announced_host_that_no_configured_server_has_is_never_dialed(pki):
    """With a CA that signs for other names too (a public one), a certificate valid for the
    announced host proves nothing: without server_names, an announced server must be on a
    configured server's host."""
    directory = ServerDirectory(["gpu-1.lan:50051"], security=device(pki))
    directory.announce("evil", "evil.example:50051")
    directory.announce("gpu-1b", "gpu-1.lan:50052")
    assert "no configured server's host" in directory.servers["evil.example:50051"].problem
    assert not directory.servers["gpu-1.lan:50052"].untrusted
    directory.configure(["gpu-1.lan:50051", "evil.example:50051"])   # configured: trusted now
    assert not directory.servers["evil.example:50051"].untrusted


async def test_an_expired_or_not_yet_valid_server_certificate_is_named_as_such(
        serve, models, pki, tmp_path, monkeypatch):
    """Not the impostor wording: a board without a clock sees 'not yet valid' until NTP."""
    import datetime

    import sled.pki as certs

    now = certs._now()
    for shift, says in ((-30, "has expired"), (30, "not yet valid: check this device's clock")):
        folder = tmp_path / f"shift{shift}"
        folder.mkdir()
        monkeypatch.setattr(certs, "_now", lambda: now + datetime.timedelta(days=shift))
        made = certs.Pki(folder, {})
        certs._issue_server(certs._load_authority(pki), made, [], 1)
        server = await serve(models["llama"], tls_cert=str(made.server_cert),
                             tls_key=str(made.server_key))
        why = await why_refused(server.address, device(pki))
        assert says in why, why


def test_a_device_with_a_token_and_no_tls_uses_no_announced_server():
    directory = ServerDirectory(["10.0.0.2:50051"], security=ChannelSecurity(token="t" * 20))
    directory.announce("gpu-x", "10.9.9.9:50051")
    assert "sends its token only over TLS" in directory.servers["10.9.9.9:50051"].problem
    assert not directory.servers["10.0.0.2:50051"].untrusted     # configured: trusted


@pytest.mark.parametrize("name", ["gpu-1.lan", "", "*.fleet.lan"])
def test_an_announced_certificate_name_is_taken_when_it_is_a_host_name(name):
    from edge_client.mqtt import _tls_name

    assert _tls_name(name) == name


@pytest.mark.parametrize("name", ["evil lan", "a/b", "x\nforged", "n" * 254])
def test_an_announced_certificate_name_that_is_no_host_name_is_refused(name):
    from edge_client.mqtt import _tls_name

    with pytest.raises(ValueError, match="is not a host name"):
        _tls_name(name)


def test_device_tls_files_are_checked_at_start(tmp_path):
    with pytest.raises(ValueError, match="cannot read server_ca"):
        ChannelSecurity.from_files(tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="go together"):
        ChannelSecurity.from_files(tmp_path / "ca.pem", client_cert=tmp_path / "c.pem")


# --- sled serve and sled generate -----------------------------------------------------------------

def test_sled_serve_refuses_unusable_tls_files_with_one_line(tmp_path, pki, impostor):
    model, _ = cached_pair()
    cases = [
        (["--tls-cert", str(pki.server_cert)], "tls_cert and tls_key go together"),
        (["--tls-cert", str(pki.server_cert), "--tls-key", str(impostor.server_key)],
         "do not make a usable pair"),
        (["--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(pki.server_key)],
         "cannot read --tls-cert"),
        (["--auth-tokens", str(tmp_path / "none")], "cannot read the token file"),
        (["--tls-client-ca", str(pki.ca)], "tls_client_ca (mutual TLS) needs TLS"),
    ]
    for flags, says in cases:
        done = run_sled("serve", "--model", model, "--port", "0", *flags, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.slow
async def test_sled_serve_with_tls_and_tokens_revokes_on_sighup(tmp_path, pki):
    """A real `sled serve` with mutual TLS and the token file: sled generate with the access
    flags works, without --server-ca it is told why, and after the token file loses dev-2 and
    the server gets SIGHUP, dev-2 is refused while dev-1 still generates."""
    model, _ = cached_pair()
    tokens = tmp_path / "tokens"
    tokens.write_text(pki.tokens.read_text())
    flags = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
             "--tls-client-ca", str(pki.ca), "--auth-tokens", str(tokens)]
    async with ServerProcess(model, *flags, security=device(pki, "dev-1", token=True)) as server:
        def sled_generate(device_id: str, *more: str):
            files = pki.device_files(device_id)
            return run_sled("generate", "--server", server.address, "--prompt", "def f(x):",
                            "--max-new-tokens", "4", "--client-cert", str(files.cert),
                            "--client-key", str(files.key),
                            f"--token={files.token.read_text().strip()}", *more, timeout=120)

        ok = await asyncio.to_thread(sled_generate, "dev-2", "--server-ca", str(pki.ca))
        assert ok.returncode == 0, ok.stderr
        plain = await asyncio.to_thread(run_sled, "generate", "--server", server.address,
                                        "--prompt", "x", timeout=120)
        assert plain.returncode == 3 and "speaks TLS" in plain.stderr, plain.stderr
        half = await asyncio.to_thread(sled_generate, "dev-2")    # a certificate, no CA
        assert half.returncode == 2 and "set server_ca" in half.stderr, half.stderr
        tokens.write_text("\n".join(line for line in pki.tokens.read_text().splitlines()
                                    if not line.startswith("dev-2 ")) + "\n")
        server.proc.send_signal(signal.SIGHUP)
        await asyncio.sleep(1.0)
        revoked = await asyncio.to_thread(sled_generate, "dev-2", "--server-ca", str(pki.ca))
        assert revoked.returncode == 3 and "UNAUTHENTICATED" in revoked.stderr, revoked.stderr
        kept = await asyncio.to_thread(sled_generate, "dev-1", "--server-ca", str(pki.ca))
        assert kept.returncode == 0, kept.stderr
        assert server.proc.poll() is None          # SIGHUP reloaded, it did not end the server


async def test_certificates_without_a_token_file_name_devices_for_shares_and_quotas(
        serve, models, pki):
    """Mutual TLS, no token file: each certificate is a device, with a part of the KV cache (a
    quarter) and of the sessions (a quarter of max_sessions), never the whole server."""
    server = await serve(models["llama"], max_sessions=4, kv_budget=3 << 20,
                         **tls_settings(pki, mutual=True))
    core = server.service.core
    share, capacity = core.ledger.kv_share_tokens(), core.pool.capacity_tokens
    assert share == capacity // 4 // 16 * 16
    fingerprint = core.target.fingerprint
    hold = pb.Open(prompt_ids=PROMPT, max_new_tokens=8, tokenizer_fingerprint=fingerprint)
    async with Connection(server.address, device(pki, "dev-1")) as conn:
        big = conn.stub.Generate()
        await big.write(pb.DeviceMessage(open=pb.Open(
            prompt_ids=PROMPT, max_new_tokens=share - len(PROMPT) + 1,
            tokenizer_fingerprint=fingerprint)))
        refusal = (await big.read()).error
        assert refusal.reason == pb.ErrorDetail.REASON_KV_BUDGET
        assert f"device dev-1's share of the KV cache is {share} tokens" in refusal.message
        first = conn.stub.Generate()
        await first.write(pb.DeviceMessage(open=hold))
        assert (await first.read()).WhichOneof("kind") == "opened"
        second = conn.stub.Generate()
        await second.write(pb.DeviceMessage(open=hold))
        refusal = (await second.read()).error
        assert refusal.reason == pb.ErrorDetail.REASON_QUOTA
        assert "device dev-1 has 1 sessions open, its quota" in refusal.message
        await lossless(server.address, device(pki, "dev-2"), models["llama"])   # its own
        first.cancel()
