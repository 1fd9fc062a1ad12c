"""A third-party client of the sled wire protocol, written from docs/protocol.md alone.

Run as its own process (tests/test_conformance.py starts it with `python -I`), it imports
nothing of the project: the messages come from the server's reflection descriptors, the
tokenizer from the files GetTokenizer streams (loaded with `tokenizers`), the drafter is a few
lines of prompt lookup. What the protocol promises within one stream is asserted here (a failed
assertion exits non-zero); what it produced (greedy outputs, refusals, ...) is printed as one
JSON object on stdout for the test to compare with `sled generate --json`. Before printing, it
asserts that no module of the project was loaded.

    python -I tests/conformance_client.py ADDRESS CONFIG_JSON
    CONFIG_JSON: {"prompts": [...], "draft_lens": [1, 3, 6], "max_new_tokens": 12}
"""
from __future__ import annotations

import hashlib
import json
import queue
import sys

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tokenizers import Tokenizer

PROJECT = ("sled", "edge_client", "verify_server", "sdsat", "drafters", "lab", "sled_cli")
SERVICE = "sled.v1.Verifier"
CHUNK_LIMIT = 1 << 20          # TokenizerChunk.data, at most
CALL_S = 120.0                 # the deadline of each call: a hang fails the run
REFUSAL_S = 15.0               # ... and of a call that must be refused


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

    def enum_name(self, enum: str, number: int) -> str:
        return self.pool.FindEnumTypeByName(f"sled.v1.{enum}").values_by_number[number].name

    def reason(self, number: int) -> str:
        return self.enum_name("ErrorDetail.Reason", number)


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

    def ended(self) -> bool:
        """The server has ended the stream: the next read finds its end."""
        try:
            self.receive()
        except StopIteration:
            return True
        return False

    def refusal(self) -> list[str]:
        """Read to the end of a refused stream: [its status, the ErrorDetail's reason] ("OK"
        and "" for a stream that was not refused)."""
        reason = ""
        try:
            while True:
                message = self.receive()
                if message.WhichOneof("kind") == "error":
                    reason = self.api.reason(message.error.reason)
                    self.half_close()       # nothing more to send: the status follows at once
        except grpc.RpcError as error:
            code = error.code()
        except StopIteration:
            code = grpc.StatusCode.OK
        self.half_close()
        return [code.name, reason]


def open_message(api, prompt_ids, fingerprint: str, max_new_tokens: int, mode: int = 0):
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


def device_generation(api, prompt_ids: list[int], fingerprint: str, draft_len: int,
                      max_new_tokens: int) -> dict:
    """Open and the first draft sent together (a draft may go before Opened arrives), then one
    draft per verdict until a verdict carries a finish reason; then the device half-closes."""
    stream = Stream(api)
    context = list(prompt_ids)
    draft = prompt_lookup(context, draft_len)
    stream.send(open=open_message(api, prompt_ids, fingerprint, max_new_tokens))
    stream.send(draft=api.Draft(round=0, token_ids=draft))
    opened = stream.receive()
    assert opened.WhichOneof("kind") == "opened" and opened.opened.prompt_tokens == len(prompt_ids)
    generated: list[int] = []
    for round in range(max_new_tokens):
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
    assert stream.ended(), "the stream went on after the device half-closed"
    assert stream.call.code() == grpc.StatusCode.OK
    return {"token_ids": generated,
            "finish_reason": api.enum_name("FinishReason", verdict.finish_reason)}


def greedy_outputs(api, info, tokenizer, config: dict) -> list[dict]:
    """Every prompt at every draft length; prompt_ids as tokenizer.encode(prompt) gives them,
    special tokens (BOS) included."""
    outputs = []
    for prompt in config["prompts"]:
        prompt_ids = tokenizer.encode(prompt).ids
        for draft_len in config["draft_lens"]:
            output = device_generation(api, prompt_ids, info.tokenizer_fingerprint, draft_len,
                                       config["max_new_tokens"])
            outputs.append({"prompt": prompt, "prompt_ids": prompt_ids, "draft_len": draft_len,
                            **output})
    return outputs


def server_mode(api, prompt_ids: list[int], max_new_tokens: int) -> dict:
    """GENERATION_MODE_SERVER: no drafts and no fingerprint needed; a verdict per step; the
    server ends the stream after the finishing verdict (its status, its verdicts). The Open is
    all the device sends, so it half-closes at once."""
    stream = Stream(api)
    mode = api.enum("GenerationMode", "GENERATION_MODE_SERVER")
    stream.send(open=open_message(api, prompt_ids, "", max_new_tokens, mode=mode))
    stream.half_close()
    first = stream.receive().WhichOneof("kind")
    verdicts = [message.verdict for message in stream.call]   # to the end the server makes
    code = stream.call.code().name
    return {"first": first, "code": code, "rounds": [v.round for v in verdicts],
            "finish_reason": api.enum_name("FinishReason", verdicts[-1].finish_reason),
            "token_ids": [t for v in verdicts for t in v.emitted_ids]}


def written_ahead(api, prompt_ids: list[int], fingerprint: str, max_new_tokens: int) -> list[int]:
    """A device that writes round 1's draft before verdict 0 arrives (drafted as if round 0's
    draft were accepted whole): the server verifies it against what round 0 committed."""
    stream = Stream(api)
    stream.send(open=open_message(api, prompt_ids, fingerprint, max_new_tokens))
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

def refused(api, *messages) -> list[str]:
    """The status and reason a stream of these (kind, message) pairs ends with; a refusal comes
    within a round or two, so a stream still open after REFUSAL_S ends DEADLINE_EXCEEDED."""
    stream = Stream(api, timeout=REFUSAL_S)
    for kind, message in messages:
        stream.send(**{kind: message})
    return stream.refusal()


def refusals(api, info, prompt_ids: list[int], max_new_tokens: int) -> dict[str, list[str]]:
    good, wrong = info.tokenizer_fingerprint, "sha256:" + "0" * 64

    def opened(fingerprint: str = good, ids=prompt_ids, new: int = max_new_tokens):
        return ("open", open_message(api, ids, fingerprint, new))

    def draft(round: int, token_ids: list[int]):
        return ("draft", api.Draft(round=round, token_ids=token_ids))

    return {
        "wrong_fingerprint": refused(api, opened(wrong)),
        "empty_fingerprint": refused(api, opened("")),
        "draft_before_open": refused(api, draft(0, [5])),
        "wrong_round": refused(api, opened(), draft(1, [5])),
        "draft_too_long": refused(api, opened(), draft(0, [5] * (info.limits.max_draft_tokens + 1))),
        "token_out_of_range": refused(api, opened(), draft(0, [info.vocab_size])),
        "draft_after_finish": refused(api, opened(new=1), draft(0, [5]), draft(1, [5])),
        "empty_prompt": refused(api, opened(ids=[])),
    }


def close_ends_the_stream(api, info, prompt_ids: list[int], max_new_tokens: int) -> dict:
    """Close (or a half-close) ends a session at any point: the first reply, the call's end."""
    stream = Stream(api)
    stream.send(open=open_message(api, prompt_ids, info.tokenizer_fingerprint, max_new_tokens))
    first = stream.receive().WhichOneof("kind")
    stream.send(close=api.Close())
    ended = stream.ended()
    code = stream.call.code().name
    stream.half_close()
    return {"first": first, "ended": ended, "code": code}


# --- the run ----------------------------------------------------------------------------------------

def project_modules() -> list[str]:
    """The project's modules loaded into this process (none may be)."""
    return sorted(name for name in sys.modules if name.split(".")[0] in PROJECT)


def run(address: str, config: dict) -> dict:
    # gRPC's default limits: no message of the protocol may need more
    with grpc.insecure_channel(address) as channel:
        api = Api(channel)
        info = api.get_model_info(api.GetModelInfoRequest(), timeout=CALL_S)
        files = fetch_tokenizer_files(api, info.tokenizer_fingerprint)
        tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        prompts = [tokenizer.encode(prompt).ids for prompt in config["prompts"]]
        new = config["max_new_tokens"]
        return {
            "model_info": {"model_id": info.model_id, "fingerprint": info.tokenizer_fingerprint,
                           "vocab_size": info.vocab_size, "eos_token_ids": list(info.eos_token_ids),
                           "max_draft_tokens": info.limits.max_draft_tokens},
            "tokenizer": {"files": sorted(files), "fingerprint": fingerprint(tokenizer),
                          "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
                          "bos_id": tokenizer.token_to_id("<bos>")},
            "greedy": greedy_outputs(api, info, tokenizer, config),
            "server_mode": server_mode(api, prompts[0], 6),
            "written_ahead": written_ahead(api, prompts[0], info.tokenizer_fingerprint, 6),
            "refusals": refusals(api, info, prompts[1], new),
            "close": close_ends_the_stream(api, info, prompts[2], new),
        }


def main(argv: list[str]) -> int:
    address, config = argv[0], json.loads(argv[1])
    results = run(address, config)
    loaded = project_modules()
    assert not loaded, f"the conformance client loaded project modules: {loaded}"
    print(json.dumps({**results, "project_modules": loaded}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
