"""What the server accepts from a device: pure checks of what arrives on a Generate stream.

Each check raises the SessionError the device sees (a gRPC code, a reason, a message saying what
to change, the round it concerns) or returns what the message means once checked. Nothing here
holds state: the service passes in what it knows (the target, the settings, how many sessions
are open). The checks run in a fixed order, so a message with several faults always gets the
same refusal.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from sled.wire.fingerprint import short
from sled.printable import printable
from sled.wire.loose import Loose
from sled.wire.sampling import Sampling
from sled.wire.tree import tree_problem
from sled.v1 import verifier_pb2 as pb
from verify_server import errors
from verify_server.acceptance import DraftQ
from verify_server.errors import Reason, SessionError

if TYPE_CHECKING:
    from verify_server.session import Session
    from verify_server.settings import ServerSettings
    from verify_server.target import Target

PROB_SUM_TOLERANCE = 1e-3

# The longest value of each free-text (string or bytes) field a client sends, by the field's full
# name; every other string or bytes field of a client message, at any depth and including fields
# added later, gets DEFAULT_TEXT_LIMIT. Strings count characters, bytes count bytes.
TEXT_LIMITS = {
    "sled.v1.Open.drafter": 128,                 # a name for logs and metrics, e.g. "hf:smollm2"
    "sled.v1.Open.tokenizer_fingerprint": 128,   # "sha256:" + 64 hex digits
    "sled.v1.Open.cache_salt": 256,
}
DEFAULT_TEXT_LIMIT = 256
# Open.stop_ids: enough for any stop list; the receive limit's margin holds them (5 bytes each).
MAX_STOP_IDS = 1024
TEXT_TYPES = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
# The most characters of a client's text quoted in one error message.
QUOTED_CHARS = 64


# --- opening a session ----------------------------------------------------------------------------

def check_open(request: pb.Open, target: Target, settings: ServerSettings, open_sessions: int,
               accepting: bool = True) -> Sampling:
    """A checked Open: returns its sampling parameters."""
    if not accepting:
        raise errors.unavailable(Reason.REASON_SHUTTING_DOWN,
                                 "server is shutting down; retry on another server")
    check_text(request, "open")
    check_tokenizer(request, target)
    check_prompt(request, target)
    try:
        sampling = Sampling.from_proto(request.sampling)
    except ValueError as exc:
        raise errors.invalid(Reason.REASON_BAD_SAMPLING, f"bad sampling params: {exc}") from None
    if open_sessions >= settings.max_sessions:
        raise errors.exhausted(Reason.REASON_TOO_MANY_SESSIONS,
                               f"server is at its limit of {settings.max_sessions} sessions; "
                               "retry later or use another server")
    check_mode(request.mode, target)
    check_fingerprint_sent(request, target)
    return sampling


def check_loose(request: pb.Open, sampling: Sampling) -> Loose | None:
    """Opt-in loose verification (not lossless): greedy device-drafts sessions only, in range."""
    if not request.HasField("loose"):
        return None
    loose = Loose.from_proto(request.loose)
    problem = loose.problem(sampling.greedy)
    if problem is None and request.mode != pb.GENERATION_MODE_DEVICE_DRAFTS:
        problem = "loose verification checks a device's drafts: use GENERATION_MODE_DEVICE_DRAFTS"
    if problem is not None:
        raise errors.invalid(Reason.REASON_BAD_LOOSE, f"bad loose verification: {problem}")
    return loose


def check_no_session(session: Session | None) -> None:
    """One session per stream."""
    if session is not None:
        raise errors.precondition(Reason.REASON_PROTOCOL,
                                  "this stream already has an open session; "
                                  "open a new stream for a new generation")


def check_tokenizer(request: pb.Open, target: Target) -> None:
    if request.tokenizer_fingerprint and request.tokenizer_fingerprint != target.fingerprint:
        raise errors.precondition(
            Reason.REASON_TOKENIZER_MISMATCH,
            f"drafter tokenizer {printable(short(request.tokenizer_fingerprint))} "
            f"({printable(request.drafter, QUOTED_CHARS) or 'unnamed drafter'}) does not match target "
            f"{target.model_id} tokenizer {short(target.fingerprint)}: "
            "draft with a model that shares the target's tokenizer")


def check_fingerprint_sent(request: pb.Open, target: Target) -> None:
    """A session whose device drafts must say which tokenizer it drafts in (the server modes
    use no drafter of the device's)."""
    if request.mode == pb.GENERATION_MODE_DEVICE_DRAFTS and not request.tokenizer_fingerprint:
        raise errors.invalid(
            Reason.REASON_TOKENIZER_MISMATCH,
            "Open.tokenizer_fingerprint is empty: a session that sends drafts must send its "
            "drafter's tokenizer fingerprint (a drafter drafting in the target's token ids sends "
            f"ModelInfo.tokenizer_fingerprint, {short(target.fingerprint)}...; how it is computed: "
            "sled/v1/verifier.proto, ModelInfo.tokenizer_fingerprint)")


def check_prompt(request: pb.Open, target: Target) -> None:
    """Prompt and stop ids in the vocabulary; prompt + max_new_tokens within the context."""
    prompt = request.prompt_ids
    if not prompt:
        raise errors.invalid(Reason.REASON_PROTOCOL, "prompt_ids is empty: send at least one token")
    if len(prompt) + request.max_new_tokens > target.context_length:    # the cheap check first
        raise errors.invalid(
            Reason.REASON_CONTEXT_OVERFLOW,
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) "
            f"exceeds the context length {target.context_length}: shorten one of them")
    check_ids(prompt, "prompt_ids", target.vocab_size)
    if len(request.stop_ids) > MAX_STOP_IDS:
        raise errors.invalid(Reason.REASON_PROTOCOL, f"{len(request.stop_ids)} stop_ids, at most "
                                                     f"{MAX_STOP_IDS} allowed")
    check_ids(request.stop_ids, "stop_ids", target.vocab_size)
    if request.max_new_tokens < 1:
        raise errors.invalid(Reason.REASON_PROTOCOL, "max_new_tokens must be >= 1")


def check_mode(mode: int, target: Target) -> None:
    if mode not in pb.GenerationMode.values():
        raise errors.invalid(Reason.REASON_PROTOCOL,
                             f"unknown generation mode {mode}: use "
                             + " or ".join(pb.GenerationMode.keys()))
    if mode == pb.GENERATION_MODE_SERVER_SAT and not target.sat_slots:
        raise errors.precondition(
            Reason.REASON_NO_SAT,
            f"target {target.model_id} has no semantic adaptive tokens, so it cannot draft "
            "for itself: use GENERATION_MODE_SERVER, or serve a SAT-tuned target "
            "(sled serve --sat-adapter, or a model whose config has sled_sat)")


# --- a device's draft -------------------------------------------------------------------------------

def check_draft(draft: pb.Draft, session: Session | None, target: Target,
                settings: ServerSettings) -> list[int]:
    """A draft the session can take this round: returns its token ids."""
    check_text(draft, "draft", draft.round)
    check_session_takes(draft.round, session, settings.idle_timeout)
    tokens = list(draft.token_ids)
    if not tokens:
        raise errors.invalid(Reason.REASON_EMPTY_DRAFT, "draft has no tokens: send k >= 1",
                             draft.round)
    if len(tokens) > settings.max_draft_tokens:
        raise errors.invalid(Reason.REASON_DRAFT_TOO_LONG,
                             f"draft has {len(tokens)} tokens, the server verifies at most "
                             f"{settings.max_draft_tokens} per round", draft.round)
    check_ids(tokens, "draft.token_ids", target.vocab_size, draft.round)
    check_lookahead(draft.lookahead, target, draft.round)
    return tokens


def check_tree(draft: pb.Draft, session: Session, trees: bool) -> list[int] | None:
    """The parents of a tree draft (sled.wire.tree), or None for a chain. `trees`: whether this
    server's engine verifies trees (ServerLimits.tree_drafts)."""
    if not draft.parents:
        return None
    parents = list(draft.parents)
    if not trees:
        raise errors.precondition(Reason.REASON_BAD_TREE,
                                  "this server's engine verifies chains only "
                                  "(ServerLimits.tree_drafts is false): send drafts without parents",
                                  draft.round)
    problem = tree_problem(parents, len(draft.token_ids))
    if problem is None and draft.q and not session.sampling.greedy:
        problem = ("a sampled tree draft with q: a tree's candidates are verified as deterministic "
                   "ones (q one-hot, recursive rejection sampling); send the tree without q, or "
                   "a chain with its q")
    if problem is None and draft.lookahead:
        problem = "a tree draft with lookahead: SAT hints follow chains only; send lookahead 0"
    if problem is not None:
        raise errors.invalid(Reason.REASON_BAD_TREE, f"bad tree draft: {problem}", draft.round)
    return parents


def check_session_takes(round: int, session: Session | None, idle_timeout: float) -> None:
    """The stream has a live session, and `round` is the one it waits for."""
    if session is None:
        raise errors.precondition(Reason.REASON_NO_SESSION,
                                  "draft before open: send an open message first", round)
    if session.finished:        # finished first: an idle finished session has nothing to resume
        raise errors.precondition(
            Reason.REASON_SESSION_FINISHED,
            f"session {session.id} already finished ({pb.FinishReason.Name(session.finish)}) "
            f"after {len(session.generated)} tokens", round)
    if session.evicted_after is not None:
        raise evicted(session, idle_timeout)
    if round != session.round:
        raise errors.precondition(Reason.REASON_WRONG_ROUND,
                                  f"draft is for round {round}, session {session.id} "
                                  f"expects round {session.round}", round)


def evicted(session: Session, idle_timeout: float) -> SessionError:
    """The refusal that ends a live session's stream once it idled out."""
    return errors.aborted(
        Reason.REASON_EVICTED,
        f"session {session.id} was idle {session.evicted_after:.1f} s (limit "
        f"{idle_timeout:g} s) and its KV was freed: reopen a stream with the "
        f"prompt + the {len(session.generated)} committed tokens to resume")


def check_lookahead(lookahead: int, target: Target, round: int) -> None:
    """SAT hints asked for: only from a target with SATs, at most its slots."""
    if lookahead and not target.sat_slots:
        raise errors.precondition(Reason.REASON_NO_SAT,
                                  f"lookahead {lookahead} asked for, but target "
                                  f"{target.model_id} has no semantic adaptive tokens: "
                                  "send lookahead 0", round)
    if lookahead > target.sat_slots:
        raise errors.invalid(Reason.REASON_PROTOCOL,
                             f"lookahead {lookahead} exceeds the target's {target.sat_slots} "
                             "SAT slots (ModelInfo.sat_slots)", round)


# --- q of a sampling draft --------------------------------------------------------------------------

def draft_q(draft: pb.Draft, tokens: Sequence[int], sampling: Sampling, vocab_size: int,
            max_q_support: int) -> list[DraftQ] | None:
    """The checked q of a sampling draft; None means a deterministic drafter (one-hot q).
    A greedy session ignores q."""
    if sampling.greedy or not draft.q:
        return None
    if len(draft.q) != len(tokens):
        raise errors.invalid(Reason.REASON_BAD_DRAFT_DISTRIBUTION,
                             f"draft has {len(tokens)} tokens but {len(draft.q)} q entries: "
                             "send one per token or none", draft.round)
    return [position_q(j, token, dist, vocab_size, max_q_support, draft.round)
            for j, (token, dist) in enumerate(zip(tokens, draft.q))]


def position_q(j: int, token: int, dist: pb.SparseDistribution, vocab_size: int,
               max_q_support: int, round: int = 0) -> DraftQ:
    """q at draft position j, which `token` was drawn from: distinct in-vocabulary ids with
    positive probs summing to 1 (within PROB_SUM_TOLERANCE; renormalized), `token` among them."""
    where = f"q[{j}]"
    if not dist.ids or len(dist.ids) != len(dist.probs):
        raise errors.invalid(Reason.REASON_BAD_DRAFT_DISTRIBUTION,
                             f"{where} needs ids and probs of equal, non-zero length", round)
    if len(dist.ids) > max_q_support:
        raise errors.invalid(Reason.REASON_BAD_DRAFT_DISTRIBUTION,
                             f"{where} has {len(dist.ids)} entries, at most "
                             f"{max_q_support} allowed", round)
    check_ids(dist.ids, f"{where}.ids", vocab_size, round)
    ids = torch.tensor(list(dist.ids), dtype=torch.long)
    probs = torch.tensor(list(dist.probs), dtype=torch.float64)
    # NaN compares false and inf passes `> 0`: each prob must be finite and positive
    if len(set(dist.ids)) != len(dist.ids) or not all(math.isfinite(p) and p > 0 for p in dist.probs):
        raise errors.invalid(Reason.REASON_BAD_DRAFT_DISTRIBUTION,
                             f"{where} must list distinct ids with finite probs > 0", round)
    if abs(float(probs.sum()) - 1.0) > PROB_SUM_TOLERANCE:
        raise errors.invalid(Reason.REASON_BAD_DRAFT_DISTRIBUTION,
                             f"{where} probs sum to {float(probs.sum()):.4f}, not 1", round)
    if token not in dist.ids:
        raise errors.invalid(Reason.REASON_BAD_DRAFT_DISTRIBUTION,
                             f"draft token {token} at position {j} is outside its q support "
                             "(q must be the distribution it was drawn from)", round)
    return DraftQ(ids, probs / probs.sum())


# --- free text -------------------------------------------------------------------------------------

def check_text(message: Message, path: str, round: int = 0) -> None:
    """Every string and bytes value in `message`, at any depth, within its field's limit
    (TEXT_LIMITS), checked before anything stores or quotes it. `path` names the message in
    the refusal, e.g. "open" -> "open.drafter is 3900000 characters long, at most 128 allowed"."""
    carriers = _text_carriers(message.DESCRIPTOR)
    if not carriers:
        return
    for field, value in message.ListFields():
        if field.name in carriers:
            _check_field(field, value, f"{path}.{field.name}", round)


def _check_field(field: FieldDescriptor, value, name: str, round: int) -> None:
    """One set field: a map's keys and values, a repeated field's items, or the single value."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key_field, value_field = (field.message_type.fields_by_name[n] for n in ("key", "value"))
        for key, item in value.items():
            _check_value(key_field, key, f"{name} key", round)
            _check_value(value_field, item, f"{name}[{printable(str(key), QUOTED_CHARS)}]", round)
    elif field.is_repeated:
        for i, item in enumerate(value):
            _check_value(field, item, f"{name}[{i}]", round)
    else:
        _check_value(field, value, name, round)


def _check_value(field: FieldDescriptor, value, name: str, round: int) -> None:
    if field.message_type is not None:
        check_text(value, name, round)
    elif field.type in TEXT_TYPES:
        limit = TEXT_LIMITS.get(field.full_name, DEFAULT_TEXT_LIMIT)
        if len(value) > limit:
            unit = "characters" if field.type == FieldDescriptor.TYPE_STRING else "bytes"
            raise errors.invalid(Reason.REASON_PROTOCOL,
                                 f"{name} is {len(value)} {unit} long, at most {limit} allowed: "
                                 "shorten it", round)


@functools.cache
def _text_carriers(descriptor: Descriptor) -> frozenset[str]:
    """Names of the fields of `descriptor` that hold text, directly or in a nested message."""
    return frozenset(field.name for field in descriptor.fields if _holds_text(field, ()))


def _holds_text(field: FieldDescriptor, outer: tuple[Descriptor, ...]) -> bool:
    if field.type in TEXT_TYPES:
        return True
    nested = field.message_type
    if nested is None or nested in outer:   # a recursive message: its text is seen higher up
        return False
    return any(_holds_text(inner, (*outer, nested)) for inner in nested.fields)


# --- ids ------------------------------------------------------------------------------------------

def check_ids(ids: Iterable[int], field: str, vocab_size: int, round: int = 0) -> None:
    """Every id in [0, vocab_size) (ids are unsigned on the wire)."""
    if max(ids, default=0) < vocab_size:       # one pass in C: the common case
        return
    bad = next(t for t in ids if t >= vocab_size)
    raise errors.invalid(Reason.REASON_TOKEN_OUT_OF_RANGE,
                         f"{field} has id {bad} outside the target vocabulary "
                         f"[0, {vocab_size})", round)
