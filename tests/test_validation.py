"""The server's input checks as plain functions: no server, no model, just what they decide.

(tests/test_bad_input.py sends every refusal over the wire; these pin the functions themselves.)
"""
from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from sled.wire.sampling import Sampling
from sled.v1 import verifier_pb2 as pb
from verify_server import validation
from verify_server.errors import SessionError
from verify_server.session import Session
from verify_server.settings import ServerSettings

Reason = pb.ErrorDetail.Reason
TARGET = SimpleNamespace(model_id="tiny", fingerprint="sha256:" + "ab" * 32, vocab_size=100,
                         context_length=32, sat_slots=0)
SETTINGS = ServerSettings(max_sessions=2, max_draft_tokens=4, max_q_support=3)


def refusal(call, *args) -> SessionError:
    with pytest.raises(SessionError) as exc:
        call(*args)
    return exc.value


def session(**kw) -> Session:
    return Session(prompt_ids=[1, 2], sampling=Sampling(temperature=0.8, seed=1),
                   max_new_tokens=8, end_ids=frozenset(), stop_ids=frozenset(), **kw)


def test_an_open_request_is_checked_in_order():
    ok = pb.Open(prompt_ids=[1, 2, 3], max_new_tokens=5, tokenizer_fingerprint=TARGET.fingerprint)
    assert validation.check_open(ok, TARGET, SETTINGS, 0).greedy
    # several faults: the first in the fixed order wins
    both = pb.Open(prompt_ids=[1, 200], max_new_tokens=0)
    error = refusal(validation.check_open, both, TARGET, SETTINGS, 0)
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT,
                                          Reason.REASON_TOKEN_OUT_OF_RANGE)
    assert refusal(validation.check_open, ok, TARGET, SETTINGS, 0, False).reason == \
        Reason.REASON_SHUTTING_DOWN
    assert refusal(validation.check_open, ok, TARGET, SETTINGS, 2).reason == \
        Reason.REASON_TOO_MANY_SESSIONS
    long = pb.Open(prompt_ids=[1] * 30, max_new_tokens=3)
    assert "context length 32" in refusal(validation.check_open, long, TARGET, SETTINGS, 0).message
    sat = pb.Open(prompt_ids=[1], max_new_tokens=3, mode=pb.GENERATION_MODE_SERVER_SAT)
    assert refusal(validation.check_open, sat, TARGET, SETTINGS, 0).reason == Reason.REASON_NO_SAT
    assert validation.check_open(sat, SimpleNamespace(**{**vars(TARGET), "sat_slots": 2}),
                                 SETTINGS, 0).greedy


def test_a_draft_is_checked_against_its_session():
    s = session()
    draft = pb.Draft(round=0, token_ids=[5, 6])
    assert validation.check_draft(draft, s, TARGET, SETTINGS) == [5, 6]
    assert refusal(validation.check_draft, draft, None, TARGET, SETTINGS).reason == \
        Reason.REASON_NO_SESSION
    late = pb.Draft(round=1, token_ids=[5])
    error = refusal(validation.check_draft, late, s, TARGET, SETTINGS)
    assert (error.reason, error.round) == (Reason.REASON_WRONG_ROUND, 1)
    too_long = pb.Draft(round=0, token_ids=[5] * 5)
    assert "at most 4 per round" in refusal(validation.check_draft, too_long, s, TARGET, SETTINGS).message
    ahead = pb.Draft(round=0, token_ids=[5], lookahead=2)
    assert refusal(validation.check_draft, ahead, s, TARGET, SETTINGS).reason == Reason.REASON_NO_SAT
    s.evicted_after = 7.0
    assert refusal(validation.check_draft, draft, s, TARGET, SETTINGS).code == grpc.StatusCode.ABORTED
    s.finish = pb.FINISH_REASON_LENGTH      # a finished session reaped while idle: nothing to resume
    error = refusal(validation.check_draft, draft, s, TARGET, SETTINGS)
    assert error.reason == Reason.REASON_SESSION_FINISHED and "resume" not in error.message


def test_an_oversized_prompt_is_refused_before_its_ids_are_read():
    huge = pb.Open(prompt_ids=[10_000] * 100, max_new_tokens=1)    # ids out of range, and too long
    assert refusal(validation.check_open, huge, TARGET, SETTINGS, 0).reason == \
        Reason.REASON_CONTEXT_OVERFLOW
    bad = pb.Open(prompt_ids=[1, 2, 150, 3], max_new_tokens=1)
    assert "prompt_ids has id 150" in refusal(validation.check_open, bad, TARGET, SETTINGS, 0).message


def test_sparse_q_becomes_a_normalized_draft_q():
    dist = pb.SparseDistribution(ids=[5, 9], probs=[0.7, 0.3004])   # within the tolerance
    q = validation.position_q(0, 5, dist, 100, 3)
    assert q.ids.tolist() == [5, 9] and abs(float(q.probs.sum()) - 1.0) < 1e-12
    assert q.probs.dtype == torch.float64
    draft = pb.Draft(round=0, token_ids=[5], q=[dist])
    assert validation.draft_q(draft, [5], Sampling(), 100, 3) is None        # greedy ignores q
    assert len(validation.draft_q(draft, [5], Sampling(temperature=1.0), 100, 3)) == 1
    wide = pb.SparseDistribution(ids=[5, 6, 7, 8], probs=[0.25] * 4)
    assert "at most 3 allowed" in refusal(validation.position_q, 0, 5, wide, 100, 3).message
    outside = pb.SparseDistribution(ids=[6], probs=[1.0])
    error = refusal(validation.position_q, 2, 5, outside, 100, 3, 4)
    assert "position 2" in error.message and error.round == 4


def test_ids_must_be_inside_the_vocabulary():
    validation.check_ids([0, 99], "prompt_ids", 100)
    error = refusal(validation.check_ids, [3, 100, 200], "stop_ids", 100, 2)
    assert error.message == "stop_ids has id 100 outside the target vocabulary [0, 100)"
    assert error.round == 2


# --- free text, in any shape a message may take later ----------------------------------------------

def later_message():
    """A message class with every shape of text field: repeated strings, bytes, a nested message
    (repeated) and a map, as fields added to the protocol later might have."""
    T = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="later.proto", package="later", syntax="proto3")
    inner = proto.message_type.add(name="Inner")
    inner.field.add(name="note", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    outer = proto.message_type.add(name="Outer")
    entry = outer.nested_type.add(name="LabelsEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    outer.field.add(name="tags", number=1, type=T.TYPE_STRING, label=T.LABEL_REPEATED)
    outer.field.add(name="blob", number=2, type=T.TYPE_BYTES, label=T.LABEL_OPTIONAL)
    outer.field.add(name="inner", number=3, type=T.TYPE_MESSAGE, label=T.LABEL_REPEATED,
                    type_name=".later.Inner")
    outer.field.add(name="labels", number=4, type=T.TYPE_MESSAGE, label=T.LABEL_REPEATED,
                    type_name=".later.Outer.LabelsEntry")
    outer.field.add(name="count", number=5, type=T.TYPE_UINT32, label=T.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("later.Outer"))


def test_text_is_bounded_in_every_shape_of_field():
    Outer = later_message()
    limit = validation.DEFAULT_TEXT_LIMIT
    fine = Outer(tags=["a" * limit], blob=b"b" * limit, inner=[{"note": "n" * limit}],
                 labels={"k" * limit: "v" * limit}, count=2**32 - 1)
    validation.check_text(fine, "outer")
    too_long = {
        "outer.tags[1] is 257 characters long": Outer(tags=["a", "a" * (limit + 1)]),
        "outer.blob is 257 bytes long": Outer(blob=b"b" * (limit + 1)),
        "outer.inner[1].note is 257 characters long": Outer(inner=[{}, {"note": "n" * (limit + 1)}]),
        "outer.labels key is 257 characters long": Outer(labels={"k" * (limit + 1): "v"}),
        "outer.labels[k\\n] is 257 characters long": Outer(labels={"k\n": "v" * (limit + 1)}),
    }
    for said, message in too_long.items():
        error = refusal(validation.check_text, message, "outer", 3)
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT and error.round == 3
        assert error.message.startswith(said) and f"at most {limit} allowed" in error.message
