"""The wire contract: committed stubs are what protoc emits from the .proto files, and a running
server exposes health, reflection, model info and its tokenizer as documented."""
from __future__ import annotations

import asyncio
import hashlib
import shutil
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import AutoTokenizer

from conftest import PROMPT_TEXTS
from sled.wire.fingerprint import fingerprint_tokenizer
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc
from sled_cli.protos import PROTO_ROOT, STUB_ROOT, generate

STUBS = ("verifier_pb2.py", "verifier_pb2.pyi", "verifier_pb2_grpc.py")
SERVICE = "sled.v1.Verifier"


# --- stubs are current -----------------------------------------------------------------------

def test_committed_stubs_match_protoc_output(tmp_path):
    """CI's check that nobody changed a .proto without `python -m sled_cli.protos`."""
    written = generate(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == \
        sorted(f"sled/v1/{name}" for name in STUBS)
    for name in STUBS:
        fresh = (tmp_path / "sled" / "v1" / name).read_bytes()
        committed = (STUB_ROOT / "sled" / "v1" / name).read_bytes()
        assert fresh == committed, f"sled/v1/{name} is stale: run python -m sled_cli.protos"


def test_stub_check_would_catch_an_edited_proto(tmp_path):
    """The check above has teeth: one added field changes the generated stubs."""
    root = tmp_path / "protos"
    for proto in PROTO_ROOT.rglob("*.proto"):
        target = root / proto.relative_to(PROTO_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(proto, target)
    proto = root / "sled" / "v1" / "verifier.proto"
    text = proto.read_text()
    anchor = "message GetModelInfoRequest {}"
    assert anchor in text
    proto.write_text(text.replace(anchor, "message GetModelInfoRequest { bool verbose = 1; }"))
    out = tmp_path / "out"
    out.mkdir()
    generate(out, proto_root=root)
    changed = [name for name in STUBS
               if (out / "sled" / "v1" / name).read_bytes()
               != (STUB_ROOT / "sled" / "v1" / name).read_bytes()]
    assert "verifier_pb2.py" in changed and "verifier_pb2.pyi" in changed


# --- a running server ------------------------------------------------------------------------

@pytest.fixture
async def running(serve, models):
    server = await serve(models["llama"], "tiny-llama", max_draft_tokens=7, max_sessions=5,
                         max_q_support=9)
    channel = grpc.aio.insecure_channel(server.address)
    yield server, channel
    await channel.close()


async def test_a_generate_call_is_taken_with_headers_before_any_message(running):
    """The server sends its initial metadata as soon as a handler takes a Generate call, before
    the Open is even read: the device's sign that a server, not only grpc, has its call."""
    _, channel = running
    call = pb_grpc.VerifierStub(channel).Generate(timeout=30)
    try:
        await asyncio.wait_for(call.initial_metadata(), 10)    # nothing written yet
        assert not call.done()
    finally:
        call.cancel()


@pytest.mark.parametrize("service", ["", SERVICE])
async def test_health_check_serving(running, service):
    _, channel = running
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_health_check_unknown_service_is_not_found(running):
    _, channel = running
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="sled.v1.Nope"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_the_verifier(running):
    _, channel = running
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    replies = [reply async for reply in call]
    assert len(replies) == 1
    names = {s.name for s in replies[0].list_services_response.service}
    assert SERVICE in names
    assert "grpc.health.v1.Health" in names


async def test_reflection_serves_the_verifier_descriptor(running):
    """A client with no stubs (grpcurl) can learn the methods from the server alone."""
    from google.protobuf import descriptor_pb2

    _, channel = running
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)]), timeout=10)
    replies = [reply async for reply in call]
    protos = [descriptor_pb2.FileDescriptorProto.FromString(raw)
              for raw in replies[0].file_descriptor_response.file_descriptor_proto]
    services = {s.name: {m.name for m in s.method} for f in protos for s in f.service}
    assert services.get("Verifier") == {"GetModelInfo", "GetTokenizer", "Generate"}


async def test_get_model_info(running, models, tokenizer):
    server, channel = running
    info = await pb_grpc.VerifierStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    model = models["llama"]
    assert info.model_id == "tiny-llama"
    assert info.vocab_size == model.config.vocab_size == len(tokenizer)
    assert info.tokenizer_fingerprint == fingerprint_tokenizer(tokenizer)
    assert list(info.eos_token_ids) == [tokenizer.eos_token_id] == [2]
    assert info.context_length == model.config.max_position_embeddings
    assert (info.limits.max_draft_tokens, info.limits.max_sessions, info.limits.max_q_support) \
        == (7, 5, 9)
    assert info.dtype == "float64"
    assert info.device == "cpu"
    assert not info.sat_available


async def test_get_model_info_reports_a_capped_context_length(serve, models):
    server = await serve(models["llama"], context_length=100)
    async with grpc.aio.insecure_channel(server.address) as channel:
        info = await pb_grpc.VerifierStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.context_length == 100


async def test_get_tokenizer_files_load_as_the_same_tokenizer(running, tokenizer, tmp_path):
    _, channel = running
    chunks = [c async for c in pb_grpc.VerifierStub(channel).GetTokenizer(pb.GetTokenizerRequest(),
                                                                           timeout=10)]
    assert {c.tokenizer_fingerprint for c in chunks} == {fingerprint_tokenizer(tokenizer)}
    files: dict[str, bytes] = {}
    for c in chunks:     # files one after another, each chunk where the file stands
        assert c.offset == len(files.setdefault(c.name, b"")) and len(c.data) <= 1 << 20
        files[c.name] += c.data
    names = list(files)
    assert "tokenizer.json" in names
    assert [c.name for c in chunks] == sorted([c.name for c in chunks], key=names.index)
    for name, content in files.items():
        assert Path(name).name == name  # plain file names, nothing to escape a folder with
        sent = next(c for c in chunks if c.name == name)
        assert (sent.size, sent.sha256) == (len(content), hashlib.sha256(content).hexdigest())
        (tmp_path / name).write_bytes(content)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert fingerprint_tokenizer(loaded) == fingerprint_tokenizer(tokenizer)
    for text in [*PROMPT_TEXTS, "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n", "héllo ✓"]:
        assert loaded(text).input_ids == tokenizer(text).input_ids
        ids = tokenizer(text).input_ids
        assert loaded.decode(ids) == tokenizer.decode(ids)
    assert loaded.eos_token_id == tokenizer.eos_token_id
    assert loaded.pad_token_id == tokenizer.pad_token_id
    assert loaded.bos_token_id == tokenizer.bos_token_id
