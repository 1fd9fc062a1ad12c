from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GENERATION_MODE_DEVICE_DRAFTS: _ClassVar[GenerationMode]
    GENERATION_MODE_SERVER: _ClassVar[GenerationMode]
    GENERATION_MODE_SERVER_SAT: _ClassVar[GenerationMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
GENERATION_MODE_DEVICE_DRAFTS: GenerationMode
GENERATION_MODE_SERVER: GenerationMode
GENERATION_MODE_SERVER_SAT: GenerationMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerLimits(_message.Message):
    __slots__ = ("max_draft_tokens", "max_sessions", "max_q_support", "kv_budget_tokens", "kv_block_tokens", "max_step_tokens", "idle_timeout_s", "tree_drafts")
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_Q_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TREE_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    max_draft_tokens: int
    max_sessions: int
    max_q_support: int
    kv_budget_tokens: int
    kv_block_tokens: int
    max_step_tokens: int
    idle_timeout_s: float
    tree_drafts: bool
    def __init__(self, max_draft_tokens: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_q_support: _Optional[int] = ..., kv_budget_tokens: _Optional[int] = ..., kv_block_tokens: _Optional[int] = ..., max_step_tokens: _Optional[int] = ..., idle_timeout_s: _Optional[float] = ..., tree_drafts: _Optional[bool] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "tokenizer_fingerprint", "eos_token_ids", "context_length", "limits", "sat_available", "dtype", "device", "sat_slots", "tokenizer_files_sha256")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SAT_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SAT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FILES_SHA256_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    context_length: int
    limits: ServerLimits
    sat_available: bool
    dtype: str
    device: str
    sat_slots: int
    tokenizer_files_sha256: str
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., context_length: _Optional[int] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ..., sat_available: _Optional[bool] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., sat_slots: _Optional[int] = ..., tokenizer_files_sha256: _Optional[str] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerChunk(_message.Message):
    __slots__ = ("tokenizer_fingerprint", "name", "offset", "data", "size", "sha256")
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    tokenizer_fingerprint: str
    name: str
    offset: int
    data: bytes
    size: int
    sha256: str
    def __init__(self, tokenizer_fingerprint: _Optional[str] = ..., name: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("prompt_ids", "sampling", "max_new_tokens", "stop_ids", "tokenizer_fingerprint", "drafter", "ignore_eos", "mode", "cache_salt", "loose", "movable")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LOOSE_FIELD_NUMBER: _ClassVar[int]
    MOVABLE_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_fingerprint: str
    drafter: str
    ignore_eos: bool
    mode: GenerationMode
    cache_salt: str
    loose: LooseVerification
    movable: bool
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., tokenizer_fingerprint: _Optional[str] = ..., drafter: _Optional[str] = ..., ignore_eos: _Optional[bool] = ..., mode: _Optional[_Union[GenerationMode, str]] = ..., cache_salt: _Optional[str] = ..., loose: _Optional[_Union[LooseVerification, _Mapping]] = ..., movable: _Optional[bool] = ...) -> None: ...

class LooseVerification(_message.Message):
    __slots__ = ("window", "entropy")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    window: int
    entropy: float
    def __init__(self, window: _Optional[int] = ..., entropy: _Optional[float] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class Draft(_message.Message):
    __slots__ = ("round", "token_ids", "q", "deadline_ms", "lookahead", "parents")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    round: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    deadline_ms: int
    lookahead: int
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., deadline_ms: _Optional[int] = ..., lookahead: _Optional[int] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class Close(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeviceMessage(_message.Message):
    __slots__ = ("open", "draft", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: Open
    draft: Draft
    close: Close
    def __init__(self, open: _Optional[_Union[Open, _Mapping]] = ..., draft: _Optional[_Union[Draft, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ...) -> None: ...

class ServerTimings(_message.Message):
    __slots__ = ("queue_ms", "forward_ms", "batch_size")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    forward_ms: float
    batch_size: int
    def __init__(self, queue_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ..., batch_size: _Optional[int] = ...) -> None: ...

class Opened(_message.Message):
    __slots__ = ("session_id", "prompt_tokens", "max_new_tokens", "timings", "cached_prompt_tokens", "loose", "placement")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOSE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_tokens: int
    max_new_tokens: int
    timings: ServerTimings
    cached_prompt_tokens: int
    loose: bool
    placement: GenerationMode
    def __init__(self, session_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., timings: _Optional[_Union[ServerTimings, _Mapping]] = ..., cached_prompt_tokens: _Optional[int] = ..., loose: _Optional[bool] = ..., placement: _Optional[_Union[GenerationMode, str]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("round", "accepted", "emitted_ids", "finish_reason", "timings", "verified", "suggested_draft_len", "hint_ids", "loose_accepted", "placement")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EMITTED_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    SUGGESTED_DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    HINT_IDS_FIELD_NUMBER: _ClassVar[int]
    LOOSE_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    round: int
    accepted: int
    emitted_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    timings: ServerTimings
    verified: int
    suggested_draft_len: int
    hint_ids: _containers.RepeatedScalarFieldContainer[int]
    loose_accepted: int
    placement: GenerationMode
    def __init__(self, round: _Optional[int] = ..., accepted: _Optional[int] = ..., emitted_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., timings: _Optional[_Union[ServerTimings, _Mapping]] = ..., verified: _Optional[int] = ..., suggested_draft_len: _Optional[int] = ..., hint_ids: _Optional[_Iterable[int]] = ..., loose_accepted: _Optional[int] = ..., placement: _Optional[_Union[GenerationMode, str]] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("reason", "message", "round")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[ErrorDetail.Reason]
        REASON_TOKEN_OUT_OF_RANGE: _ClassVar[ErrorDetail.Reason]
        REASON_EMPTY_DRAFT: _ClassVar[ErrorDetail.Reason]
        REASON_DRAFT_TOO_LONG: _ClassVar[ErrorDetail.Reason]
        REASON_WRONG_ROUND: _ClassVar[ErrorDetail.Reason]
        REASON_NO_SESSION: _ClassVar[ErrorDetail.Reason]
        REASON_SESSION_FINISHED: _ClassVar[ErrorDetail.Reason]
        REASON_CONTEXT_OVERFLOW: _ClassVar[ErrorDetail.Reason]
        REASON_TOKENIZER_MISMATCH: _ClassVar[ErrorDetail.Reason]
        REASON_BAD_SAMPLING: _ClassVar[ErrorDetail.Reason]
        REASON_BAD_DRAFT_DISTRIBUTION: _ClassVar[ErrorDetail.Reason]
        REASON_TOO_MANY_SESSIONS: _ClassVar[ErrorDetail.Reason]
        REASON_PROTOCOL: _ClassVar[ErrorDetail.Reason]
        REASON_SHUTTING_DOWN: _ClassVar[ErrorDetail.Reason]
        REASON_KV_BUDGET: _ClassVar[ErrorDetail.Reason]
        REASON_EVICTED: _ClassVar[ErrorDetail.Reason]
        REASON_DEADLINE_EXCEEDED: _ClassVar[ErrorDetail.Reason]
        REASON_NO_SAT: _ClassVar[ErrorDetail.Reason]
        REASON_UNAUTHENTICATED: _ClassVar[ErrorDetail.Reason]
        REASON_PERMISSION_DENIED: _ClassVar[ErrorDetail.Reason]
        REASON_QUOTA: _ClassVar[ErrorDetail.Reason]
        REASON_BAD_TREE: _ClassVar[ErrorDetail.Reason]
        REASON_BAD_LOOSE: _ClassVar[ErrorDetail.Reason]
        REASON_INTERNAL: _ClassVar[ErrorDetail.Reason]
    REASON_UNSPECIFIED: ErrorDetail.Reason
    REASON_TOKEN_OUT_OF_RANGE: ErrorDetail.Reason
    REASON_EMPTY_DRAFT: ErrorDetail.Reason
    REASON_DRAFT_TOO_LONG: ErrorDetail.Reason
    REASON_WRONG_ROUND: ErrorDetail.Reason
    REASON_NO_SESSION: ErrorDetail.Reason
    REASON_SESSION_FINISHED: ErrorDetail.Reason
    REASON_CONTEXT_OVERFLOW: ErrorDetail.Reason
    REASON_TOKENIZER_MISMATCH: ErrorDetail.Reason
    REASON_BAD_SAMPLING: ErrorDetail.Reason
    REASON_BAD_DRAFT_DISTRIBUTION: ErrorDetail.Reason
    REASON_TOO_MANY_SESSIONS: ErrorDetail.Reason
    REASON_PROTOCOL: ErrorDetail.Reason
    REASON_SHUTTING_DOWN: ErrorDetail.Reason
    REASON_KV_BUDGET: ErrorDetail.Reason
    REASON_EVICTED: ErrorDetail.Reason
    REASON_DEADLINE_EXCEEDED: ErrorDetail.Reason
    REASON_NO_SAT: ErrorDetail.Reason
    REASON_UNAUTHENTICATED: ErrorDetail.Reason
    REASON_PERMISSION_DENIED: ErrorDetail.Reason
    REASON_QUOTA: ErrorDetail.Reason
    REASON_BAD_TREE: ErrorDetail.Reason
    REASON_BAD_LOOSE: ErrorDetail.Reason
    REASON_INTERNAL: ErrorDetail.Reason
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    reason: ErrorDetail.Reason
    message: str
    round: int
    def __init__(self, reason: _Optional[_Union[ErrorDetail.Reason, str]] = ..., message: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("opened", "verdict", "error")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    opened: Opened
    verdict: Verdict
    error: ErrorDetail
    def __init__(self, opened: _Optional[_Union[Opened, _Mapping]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ...) -> None: ...
