"""Bounds on what a client chooses: every free-text field has a length limit, every number a
range, and peer text reaches a log line or an error message only escaped and cut short.

The server side is pinned both as plain functions and over the wire; the device's OpenAI API
answers every out-of-range parameter with 400 naming it (never 500).
"""
from __future__ import annotations

import json
import logging
import math

import aiohttp
import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor

from edge_client.daemon import DeviceError, Request
from sled.printable import printable
from sled.wire.sampling import Sampling
from sled.v1 import verifier_pb2 as pb
from test_bad_input import (OTHER_FP, assert_refused, draft_msg, open_msg, raw,  # noqa: F401
                            run_steps, wait_clean)
from test_openai_api import api, post  # noqa: F401
from test_validation import SETTINGS, TARGET, refusal
from verify_server import validation

Reason = pb.ErrorDetail.Reason
INVALID = grpc.StatusCode.INVALID_ARGUMENT
TEXT_TYPES = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)


# --- the escape helper -------------------------------------------------------------------------

def test_printable_keeps_peer_text_on_one_short_line():
    assert printable("ngram") == "ngram"
    assert printable("日本 ok") == "日本 ok"
    assert printable("ngram\nINFO forged line") == "ngram\\nINFO forged line"
    assert printable("\x1b[31mred\r\t\x00\u2028") == "\\x1b[31mred\\r\\t\\x00\\u2028"
    assert printable(b"raw\n\xff") == "raw\\n\\xff"
    assert printable("x" * 1000, 8) == "xxxxxxxx... (1000 characters)"
    assert len(printable("\n" * 10**6)) < 200


# --- every free-text field of every client message ---------------------------------------------

def text_fields(descriptor, path: str, seen=()):
    """(path, field) of every string/bytes field reachable from `descriptor`, nested included."""
    for field in descriptor.fields:
        name = f"{path}.{field.name}"
        if field.type in TEXT_TYPES:
            yield name, field
        elif field.message_type is not None and field.message_type not in seen:
            yield from text_fields(field.message_type, name, (*seen, descriptor))


CLIENT_TEXT = dict(text_fields(pb.DeviceMessage.DESCRIPTOR, "message"))


def with_text(path: str, value) -> pb.DeviceMessage:
    """A DeviceMessage with the field at `path` (message.open.drafter, ...) set to `value`."""
    message = pb.DeviceMessage()
    node = message
    *parents, leaf = path.split(".")[1:]
    for part in parents:
        child = getattr(node, part)
        node = child.add() if hasattr(child, "add") else child
    field = node.DESCRIPTOR.fields_by_name[leaf]
    if field.is_repeated:
        getattr(node, leaf).append(value)
    else:
        setattr(node, leaf, value)
    return message


def limit_of(field) -> int:
    return validation.TEXT_LIMITS.get(field.full_name, validation.DEFAULT_TEXT_LIMIT)


def test_the_limits_name_real_fields():
    assert CLIENT_TEXT, "the client messages have no text field: this test tests nothing"
    assert {"sled.v1.Open.drafter", "sled.v1.Open.tokenizer_fingerprint"} <= set(validation.TEXT_LIMITS)
    known = {field.full_name for field in CLIENT_TEXT.values()}
    assert set(validation.TEXT_LIMITS) <= known
    assert validation.TEXT_LIMITS["sled.v1.Open.drafter"] == 128


@pytest.mark.parametrize("path", sorted(CLIENT_TEXT))
def test_every_text_field_a_client_sends_is_bounded(path):
    field = CLIENT_TEXT[path]
    limit = limit_of(field)
    unit = "x" if field.type == FieldDescriptor.TYPE_STRING else b"x"
    kind, _, inner = path.removeprefix("message.").partition(".")
    at_limit = getattr(with_text(path, unit * limit), kind)
    validation.check_text(at_limit, kind)                     # exactly at the limit: fine
    over = getattr(with_text(path, unit * (10 * limit + 7)), kind)
    error = refusal(validation.check_text, over, kind)
    assert (error.code, error.reason) == (INVALID, Reason.REASON_PROTOCOL)
    assert f"{kind}.{inner}" in error.message and f"at most {limit}" in error.message
    assert str(10 * limit + 7) in error.message
    assert "xxxxxxxxxx" not in error.message                  # the value itself is not echoed


def test_open_and_draft_check_their_text_first():
    for field, limit in (("drafter", 128), ("tokenizer_fingerprint", 128), ("cache_salt", 256)):
        request = pb.Open(prompt_ids=[1, 2], max_new_tokens=3, **{field: "y" * (limit + 1)})
        error = refusal(validation.check_open, request, TARGET, SETTINGS, 0)
        assert error.code == INVALID and f"open.{field}" in error.message
    request = pb.Open(prompt_ids=[1, 2], max_new_tokens=3, drafter="d" * 128, cache_salt="s" * 256,
                      tokenizer_fingerprint=TARGET.fingerprint)
    assert validation.check_open(request, TARGET, SETTINGS, 0).greedy


async def test_a_huge_drafter_name_is_refused_before_it_is_echoed(raw, prompts):
    """A 1 MB drafter with a foreign tokenizer: once echoed into the mismatch error it made the
    status too large for gRPC's metadata (RESOURCE_EXHAUSTED); now the length is refused."""
    server, stub = await raw(max_message_bytes=4 << 20)
    message = open_msg(prompts[0], fingerprint=OTHER_FP, drafter="d" * (1 << 20))
    call, reply = await run_steps(stub, [message])
    details = await assert_refused(call, reply, INVALID, Reason.REASON_PROTOCOL,
                                   ("open.drafter", "1048576 characters", "at most 128"))
    assert len(details) < 300
    await wait_clean(server)


async def test_peer_text_is_escaped_in_errors_and_log_lines(raw, prompts, caplog):
    server, stub = await raw()
    caplog.set_level(logging.INFO, logger="sled.server")
    forged = "ngram\nINFO sled.server: session 1 finished\x1b[2J"
    call, reply = await run_steps(stub, [open_msg(prompts[0], fingerprint=OTHER_FP, drafter=forged)])
    details = await assert_refused(call, reply, grpc.StatusCode.FAILED_PRECONDITION,
                                   Reason.REASON_TOKENIZER_MISMATCH,
                                   ("ngram\\nINFO sled.server: session 1 finished\\x1b[2J",))
    assert "\n" not in details and "\x1b" not in details
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refusals and all("\n" not in line and "\x1b" not in line for line in refusals)
    await wait_clean(server)


# --- sampling numbers ----------------------------------------------------------------------------

BAD_SAMPLING = [
    ("top_p", -0.5), ("top_p", math.nan), ("top_p", math.inf), ("top_p", -math.inf), ("top_p", 1.5),
    ("temperature", math.inf), ("temperature", -math.inf), ("temperature", math.nan),
    ("temperature", -1.0),
]


@pytest.mark.parametrize("field, value", BAD_SAMPLING, ids=lambda v: str(v))
def test_sampling_numbers_must_be_finite_and_in_range(field, value):
    params = pb.SamplingParams(**{"temperature": 0.8, "top_p": 0.9, field: value})
    with pytest.raises(ValueError, match=field):
        Sampling.from_proto(params)
    request = pb.Open(prompt_ids=[1, 2], max_new_tokens=3, sampling=params)
    error = refusal(validation.check_open, request, TARGET, SETTINGS, 0)
    assert (error.code, error.reason) == (INVALID, Reason.REASON_BAD_SAMPLING)
    assert field in error.message


def test_sampling_values_in_range_are_kept():
    assert Sampling.from_proto(pb.SamplingParams(temperature=0.7, top_p=0.0)).top_p == 1.0  # 0: off
    assert Sampling.from_proto(pb.SamplingParams(temperature=3e38, top_k=2**32 - 1, seed=2**64 - 1))
    for bad in (dict(top_k=-1), dict(seed=-1), dict(seed=2**64), dict(temperature=math.inf),
                dict(top_p=math.nan)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Sampling(**bad)


@pytest.mark.parametrize("probs", [[math.inf, 1.0], [math.nan, 1.0], [1.0, -math.inf]],
                         ids=["inf", "nan", "minus_inf"])
def test_q_probs_must_be_finite(probs):
    dist = pb.SparseDistribution(ids=[5, 9], probs=probs)
    error = refusal(validation.position_q, 0, 5, dist, 100, 3)
    assert error.reason == Reason.REASON_BAD_DRAFT_DISTRIBUTION
    assert "finite" in error.message and "q[0]" in error.message


# --- the device's OpenAI API ------------------------------------------------------------------------

BIG = 10**12
BAD_PARAMS = [
    ("max_tokens", BIG), ("max_tokens", 2**32), ("max_tokens", -5), ("max_tokens", 0),
    ("top_k", 2**32), ("top_k", -2), ("seed", -1), ("seed", 2**64),
    ("n", BIG), ("n", -1), ("n", 0), ("logprobs", BIG), ("top_logprobs", -1), ("best_of", BIG),
    ("temperature", 1e308 * 10), ("stop_token_ids", [2**64]), ("stop_token_ids", [-1]),
    ("user", "u" * 10_000), ("model", "m" * 10_000),
]


async def test_out_of_range_numbers_get_400_naming_the_parameter(api):
    _, url, _ = api
    for param, value in BAD_PARAMS:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2, param: value}
        status, _, answer = await post(url, "/v1/completions", json.dumps(body))
        assert status == 400, (param, value, answer)
        assert answer["error"]["param"] == param, (param, value, answer)
        assert param in answer["error"]["message"] and len(answer["error"]["message"]) < 300
    # in range for the wire, beyond the target's context: the server's refusal, still a 400
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2**32 - 1}
    status, _, answer = await post(url, "/v1/completions", json.dumps(body))
    assert status == 400 and "context length" in answer["error"]["message"], answer
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": BIG}
    status, _, answer = await post(url, "/v1/chat/completions", json.dumps(chat))
    assert (status, answer["error"]["param"]) == (400, "max_completion_tokens"), answer


async def test_the_device_refuses_a_max_tokens_the_wire_cannot_carry(api):
    """MQTT requests reach the device without the API's checks: 10^12 was a ValueError deep in
    the session (an internal error), now a DeviceError("invalid") naming max_tokens."""
    _, _, device = api
    for max_tokens in (10**12, 2**32, 0):
        with pytest.raises(DeviceError) as refused:
            await device.complete(Request([5, 6], max_tokens=max_tokens))
        assert refused.value.kind == "invalid" and "max_tokens" in refused.value.message


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
async def test_non_finite_floats_get_400_naming_the_parameter(api, literal):
    _, url, _ = api
    for param in ("temperature", "top_p"):
        raw_body = f'{{"model": "tiny", "prompt": "x", "max_tokens": 2, "{param}": {literal}}}'
        status, _, answer = await post(url, "/v1/completions", raw_body)
        assert (status, answer["error"]["param"]) == (400, param), answer


async def test_the_api_echoes_names_escaped_and_short(api):
    _, url, _ = api
    status, _, answer = await post(url, "/v1/completions",
                                   json.dumps({"model": "gpt\nx\x1b", "prompt": "x"}))
    assert status == 404
    assert "\n" not in answer["error"]["message"] and "\x1b" not in answer["error"]["message"]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/models/{'m' * 5000}%0Aforged") as response:
            answer = await response.json()
    assert response.status == 404
    message = answer["error"]["message"]
    assert len(message) < 300 and "\n" not in message


def test_a_device_names_its_drafter_without_its_paths_within_the_servers_limit(tmp_path):
    from edge_client.wire import DRAFTER_NAME_CHARS, SessionRequest, drafter_label, open_message
    from sled.wire.sampling import Sampling
    from verify_server.validation import TEXT_LIMITS

    deep = tmp_path.joinpath(*["folder"] * 40, "SmolLM2-135M.Q8_0.gguf")
    assert len(f"gguf:{deep}") > DRAFTER_NAME_CHARS        # would be refused as sent
    sent = open_message(SessionRequest([1], 4, Sampling(), drafter=f"gguf:{deep}")).open.drafter
    assert sent == "gguf:SmolLM2-135M.Q8_0.gguf"
    assert drafter_label("hf:HuggingFaceTB/SmolLM2-135M") == "hf:HuggingFaceTB/SmolLM2-135M"
    assert drafter_label("ngram:3") == "ngram:3"
    assert len(drafter_label("x" * 1000)) == DRAFTER_NAME_CHARS == TEXT_LIMITS["sled.v1.Open.drafter"]
