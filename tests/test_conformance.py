"""A third-party client of the sled wire protocol, written from docs/protocol.md alone.

Nothing of the project is imported: the messages come from the server's own reflection
descriptors, the tokenizer from the files GetTokenizer streams (loaded with `tokenizers`), the
drafter is a few lines of prompt lookup. The server and `sled generate` (the reference) run as
child processes, as a person runs them. Greedy output must equal `sled generate`'s, token for
token, for every prompt and draft length; what the protocol refuses must be refused with the
documented status and reason.
"""
from __future__ import annotations

import hashlib
import json
import queue
import socket
import subprocess
import sys

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tokenizers import Tokenizer

pytestmark = pytest.mark.slow

SLED = [sys.executable, "-m", "sled_cli.main"]
MODEL = "gemma3-270m"
SERVICE = "sled.v1.Verifier"
CHUNK_LIMIT = 1 << 20          # TokenizerChunk.data, at most
CALL_S = 120.0                 # the deadline of each call: a hang fails the test
REFUSAL_S = 15.0               # ... and of a call that must be refused
PROMPTS = ["def fibonacci(n):", "The capital of France is", "1, 2, 3, 4, 5,"]
DRAFT_LENS = (1, 3, 6)
MAX_NEW = 12


# --- the server and the reference client, as child processes ------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def address():
    port = free_port()
    server = subprocess.Popen([*SLED, "serve", "--model", MODEL, "--port", str(port),
                               "--kv-budget", "256MiB", "--max-draft-len", "8"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as channel:   # ready once it answers
            grpc.channel_ready_future(channel).result(timeout=300)
        yield address
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()


def sled_generate(address: str, prompt: str, draft_len: int) -> subprocess.Popen:
    """`sled generate --json`, started: the reference output (see reference_of)."""
    return subprocess.Popen([*SLED, "generate", "--server", address, "--prompt", prompt,
                             "--max-new-tokens", str(MAX_NEW), "--draft-len", str(draft_len),
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def reference_of(generating: subprocess.Popen) -> dict:
    """The JSON object `sled generate --json` printed."""
    out, err = generating.communicate(timeout=180)
    assert generating.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


# --- the messages, from the server's reflection ----------------------------------------------------

def reflected_files(channel) -> list[descriptor_pb2.FileDescriptorProto]:
    """The file that defines the service and every file it depends on, dependencies first."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    def ask(**request) -> list[descriptor_pb2.FileDescriptorProto]:
        reply = next(stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=CALL_S))
        return [descriptor_pb2.FileDescriptorProto.FromString(raw)
                for raw in reply.file_descriptor_response.file_descriptor_proto]

    known = {f.name: f for f in ask(file_containing_symbol=SERVICE)}
    ordered: list[descriptor_pb2.FileDescriptorProto] = []

    def visit(name: str) -> None:
        if name not in known:
            known.update((f.name, f) for f in ask(file_by_filename=name))
        for dependency in known[name].dependency:
            visit(dependency)
        if known[name] not in ordered:
            ordered.append(known[name])

    for name in list(known):
        visit(name)
    return ordered


class Api:
    """The Verifier's message classes (api.Open, api.Draft, ...) and its three calls."""

    def __init__(self, channel) -> None:
        pool = descriptor_pool.DescriptorPool()
        for file in reflected_files(channel):
            pool.Add(file)
        self.service = pool.FindServiceByName(SERVICE)
        self.pool = pool
        self.get_model_info = self._method(channel, "GetModelInfo")
        self.get_tokenizer = self._method(channel, "GetTokenizer")
        self.generate = self._method(channel, "Generate")

    def __getattr__(self, name: str):
        try:
            return message_factory.GetMessageClass(self.pool.FindMessageTypeByName(f"sled.v1.{name}"))
        except KeyError:
            raise AttributeError(name) from None

    def _method(self, channel, name: str):
        method = self.service.methods_by_name[name]
        kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                (True, True): channel.stream_stream}[method.client_streaming, method.server_streaming]
        reply = message_factory.GetMessageClass(method.output_type)
        return kind(f"/{SERVICE}/{name}", request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=reply.FromString)

    def enum(self, enum: str, name: str) -> int:
        """An enum value's number, e.g. enum("FinishReason", "FINISH_REASON_EOS") -> 1."""
        return self.pool.FindEnumTypeByName(f"sled.v1.{enum}").values_by_name[name].number

    def reason(self, number: int) -> str:
        return self.pool.FindEnumTypeByName("sled.v1.ErrorDetail.Reason").values_by_number[number].name


@pytest.fixture(scope="module")
def api(address):
    # gRPC's default limits: no message of the protocol may need more
    with grpc.insecure_channel(address) as channel:
        yield Api(channel)


@pytest.fixture(scope="module")
def info(api):
    return api.get_model_info(api.GetModelInfoRequest(), timeout=CALL_S)


# --- the tokenizer ----------------------------------------------------------------------------------

def fetch_tokenizer_files(api, fingerprint: str) -> dict[str, bytes]:
    """GetTokenizer's chunks put together: files one after another, each in order from 0, each
    complete (offset + len(data) == size) and hashing to its sha256."""
    files: dict[str, bytearray] = {}
    digests: dict[str, tuple[int, str]] = {}
    current = None
    for chunk in api.get_tokenizer(api.GetTokenizerRequest(), timeout=CALL_S):
        assert chunk.tokenizer_fingerprint == fingerprint
        assert len(chunk.data) <= CHUNK_LIMIT
        if chunk.name != current:
            assert chunk.name not in files, f"{chunk.name} sent twice"
            assert current is None or len(files[current]) == digests[current][0], "file cut short"
            current = chunk.name
            files[current] = bytearray()
            digests[current] = (chunk.size, chunk.sha256)
        assert (chunk.size, chunk.sha256) == digests[current]
        assert chunk.offset == len(files[current])
        files[current] += chunk.data
        assert len(files[current]) <= chunk.size
    for name, (size, sha256) in digests.items():
        assert len(files[name]) == size, f"{name} incomplete"
        assert hashlib.sha256(files[name]).hexdigest() == sha256, f"{name} does not hash to sha256"
    return {name: bytes(data) for name, data in files.items()}


def fingerprint(tokenizer: Tokenizer) -> str:
    """As docs/protocol.md specifies: sha256 of "id\\ttoken\\n" lines over the full vocabulary."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    text = "".join(f"{id}\t{token}\n" for token, id in sorted(vocab.items(), key=lambda e: e[1]))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


@pytest.fixture(scope="module")
def tokenizer(api, info) -> Tokenizer:
    files = fetch_tokenizer_files(api, info.tokenizer_fingerprint)
    tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
    assert fingerprint(tokenizer) == info.tokenizer_fingerprint
    return tokenizer


def test_fingerprint_example():
    """The worked example of the fingerprint in docs/protocol.md."""
    text = "0\ta\n1\tb\n"
    assert "sha256:" + hashlib.sha256(text.encode()).hexdigest() == \
        "sha256:a2b804b1740ccd2fc6e05d726ef2753cc62bc024e643716f632d0d01a2736de6"


def test_model_info_and_tokenizer(info, tokenizer):
    assert info.model_id == MODEL
    assert info.tokenizer_fingerprint.startswith("sha256:") and len(info.tokenizer_fingerprint) == 71
    assert tokenizer.get_vocab_size(with_added_tokens=True) <= info.vocab_size
    assert info.limits.max_draft_tokens == 8 and info.eos_token_ids


# --- a session, spoken by hand ----------------------------------------------------------------------

class Stream:
    """One Generate call: send() DeviceMessages, receive() ServerMessages, half_close()."""

    def __init__(self, api, timeout: float = CALL_S) -> None:
        self.api = api
        self.outbox: queue.Queue = queue.Queue()
        self.call = api.generate(iter(self.outbox.get, None), timeout=timeout)

    def send(self, **kind) -> None:
        self.outbox.put(self.api.DeviceMessage(**kind))

    def receive(self):
        return next(self.call)

    def half_close(self) -> None:
        self.outbox.put(None)

    def refusal(self) -> tuple[grpc.StatusCode, str]:
        """Read to the end of a refused stream: its status and the ErrorDetail's reason."""
        reason = ""
        with pytest.raises(grpc.RpcError) as raised:
            while True:
                message = self.receive()
                if message.WhichOneof("kind") == "error":
                    reason = self.api.reason(message.error.reason)
        self.half_close()
        return raised.value.code(), reason


def open_message(api, prompt_ids, fingerprint: str, max_new_tokens: int = MAX_NEW, mode: int = 0):
    return api.Open(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                    tokenizer_fingerprint=fingerprint, drafter="conformance", mode=mode,
                    sampling=api.SamplingParams(temperature=0.0))


def prompt_lookup(context: list[int], draft_len: int) -> list[int]:
    """The drafter: the tokens that followed the latest earlier occurrence of the context's last
    two tokens (else its last one), padded with the last token to draft_len."""
    for n in (2, 1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                draft = context[start + n:start + n + draft_len]
                return draft + [draft[-1]] * (draft_len - len(draft))
    return [context[-1]] * draft_len


def device_generation(api, prompt_ids: list[int], fingerprint: str, draft_len: int):
    """Open and the first draft sent together (a draft may go before Opened arrives), then one
    draft per verdict until a verdict carries a finish reason; then the device half-closes."""
    stream = Stream(api)
    context = list(prompt_ids)
    draft = prompt_lookup(context, draft_len)
    stream.send(open=open_message(api, prompt_ids, fingerprint))
    stream.send(draft=api.Draft(round=0, token_ids=draft))
    opened = stream.receive()
    assert opened.WhichOneof("kind") == "opened" and opened.opened.prompt_tokens == len(prompt_ids)
    generated: list[int] = []
    for round in range(MAX_NEW):
        verdict = stream.receive().verdict
        assert verdict.round == round
        assert verdict.accepted <= verdict.verified <= len(draft)
        assert list(verdict.emitted_ids[:verdict.accepted]) == draft[:verdict.accepted]
        generated += verdict.emitted_ids
        if verdict.finish_reason:
            break
        assert len(verdict.emitted_ids) == verdict.accepted + 1     # accepted + correction/bonus
        context += verdict.emitted_ids
        draft = prompt_lookup(context, draft_len)
        stream.send(draft=api.Draft(round=round + 1, token_ids=draft))
    stream.half_close()   # the device ends the stream after the finishing verdict
    with pytest.raises(StopIteration):
        stream.receive()
    assert stream.call.code() == grpc.StatusCode.OK
    return generated, verdict.finish_reason


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_equals_sled_generate(address, api, info, tokenizer, prompt):
    """prompt_ids as tokenizer.encode(prompt) gives them, special tokens (BOS) included."""
    generating = sled_generate(address, prompt, DRAFT_LENS[PROMPTS.index(prompt)])
    prompt_ids = tokenizer.encode(prompt).ids
    assert prompt_ids[0] == tokenizer.token_to_id("<bos>")
    try:
        outputs = {draft_len: device_generation(api, prompt_ids, info.tokenizer_fingerprint,
                                                draft_len) for draft_len in DRAFT_LENS}
    except BaseException:
        generating.kill()
        raise
    reference = reference_of(generating)
    finish = api.enum("FinishReason", "FINISH_REASON_" + reference["finish_reason"].upper())
    for draft_len, output in outputs.items():
        assert output == (reference["token_ids"], finish), f"draft_len {draft_len}"


def test_server_mode_streams_to_its_end(api, tokenizer):
    """GENERATION_MODE_SERVER: no drafts and no fingerprint needed; a verdict per step, rounds
    counted from 0; the server ends the stream with OK after the finishing verdict."""
    stream = Stream(api)
    server_mode = api.enum("GenerationMode", "GENERATION_MODE_SERVER")
    prompt_ids = tokenizer.encode(PROMPTS[0]).ids
    stream.send(open=open_message(api, prompt_ids, "", max_new_tokens=6, mode=server_mode))
    assert stream.receive().WhichOneof("kind") == "opened"
    verdicts = [message.verdict for message in stream.call]   # to the end the server makes
    assert stream.call.code() == grpc.StatusCode.OK
    stream.half_close()
    assert [v.round for v in verdicts] == list(range(len(verdicts)))
    assert verdicts[-1].finish_reason == api.enum("FinishReason", "FINISH_REASON_LENGTH")
    assert [t for v in verdicts for t in v.emitted_ids] == written_ahead(api, prompt_ids, 6)


def written_ahead(api, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """A device that writes round 1's draft before verdict 0 arrives (drafted as if round 0's
    draft were accepted whole): the server verifies it against what round 0 committed."""
    fingerprint = api.get_model_info(api.GetModelInfoRequest(), timeout=CALL_S).tokenizer_fingerprint
    stream = Stream(api)
    stream.send(open=open_message(api, prompt_ids, fingerprint, max_new_tokens=max_new_tokens))
    drafts = [prompt_lookup(prompt_ids, 3)]
    drafts.append(prompt_lookup(prompt_ids + drafts[0], 3))
    for round, draft in enumerate(drafts):
        stream.send(draft=api.Draft(round=round, token_ids=draft))
    assert stream.receive().WhichOneof("kind") == "opened"
    generated: list[int] = []
    for round in range(max_new_tokens):
        verdict = stream.receive().verdict
        assert verdict.round == round
        generated += verdict.emitted_ids
        if verdict.finish_reason:
            break
        if round >= 1:
            stream.send(draft=api.Draft(round=round + 1,
                                        token_ids=prompt_lookup(prompt_ids + generated, 3)))
    stream.half_close()
    return generated


# --- what the protocol refuses ----------------------------------------------------------------------

def refused(api, *messages) -> tuple[grpc.StatusCode, str]:
    """The status and reason a stream of these (kind, message) pairs ends with; a refusal comes
    within a round or two, so a stream still open after REFUSAL_S fails the check."""
    stream = Stream(api, timeout=REFUSAL_S)
    for kind, message in messages:
        stream.send(**{kind: message})
    return stream.refusal()


def test_refusals(api, info, tokenizer):
    prompt_ids = tokenizer.encode(PROMPTS[1]).ids
    good = info.tokenizer_fingerprint
    wrong = "sha256:" + "0" * 64
    Code = grpc.StatusCode
    assert refused(api, ("open", open_message(api, prompt_ids, wrong))) == \
        (Code.FAILED_PRECONDITION, "REASON_TOKENIZER_MISMATCH")
    assert refused(api, ("open", open_message(api, prompt_ids, ""))) == \
        (Code.INVALID_ARGUMENT, "REASON_TOKENIZER_MISMATCH")
    assert refused(api, ("draft", api.Draft(round=0, token_ids=[5]))) == \
        (Code.FAILED_PRECONDITION, "REASON_NO_SESSION")
    assert refused(api, ("open", open_message(api, prompt_ids, good)),
                   ("draft", api.Draft(round=1, token_ids=[5]))) == \
        (Code.FAILED_PRECONDITION, "REASON_WRONG_ROUND")
    assert refused(api, ("open", open_message(api, prompt_ids, good)),
                   ("draft", api.Draft(round=0, token_ids=[5] * 9))) == \
        (Code.INVALID_ARGUMENT, "REASON_DRAFT_TOO_LONG")
    assert refused(api, ("open", open_message(api, prompt_ids, good)),
                   ("draft", api.Draft(round=0, token_ids=[info.vocab_size]))) == \
        (Code.INVALID_ARGUMENT, "REASON_TOKEN_OUT_OF_RANGE")
    assert refused(api, ("open", open_message(api, prompt_ids, good, max_new_tokens=1)),
                   ("draft", api.Draft(round=0, token_ids=[5])),
                   ("draft", api.Draft(round=1, token_ids=[5]))) == \
        (Code.FAILED_PRECONDITION, "REASON_SESSION_FINISHED")
    assert refused(api, ("open", open_message(api, [], good))) == \
        (Code.INVALID_ARGUMENT, "REASON_PROTOCOL")


def test_close_ends_the_stream(api, info, tokenizer):
    """Close (or a half-close) ends a session at any point; the call ends with OK."""
    stream = Stream(api)
    stream.send(open=open_message(api, tokenizer.encode(PROMPTS[2]).ids, info.tokenizer_fingerprint))
    assert stream.receive().WhichOneof("kind") == "opened"
    stream.send(close=api.Close())
    with pytest.raises(StopIteration):
        stream.receive()
    assert stream.call.code() == grpc.StatusCode.OK
    stream.half_close()
