"""Server limits, validated once at start-up."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ServerConfig:
    max_draft_tokens: int = 32        # longest draft verified in one round
    max_sessions: int = 256           # open sessions before RESOURCE_EXHAUSTED
    max_q_support: int = 64           # (id, prob) pairs per draft position in sampling mode
    max_batch_sessions: int = 64      # sessions in one forward pass
    max_message_bytes: int = 4 << 20  # larger gRPC messages get RESOURCE_EXHAUSTED
    context_length: int | None = None # cap below the model's own limit
    max_step_tokens: int = 2048       # tokens in one forward; longer prefills are chunked
    kv_budget_bytes: int | None = None  # KV pool size; None: kv_fraction of free memory
    kv_fraction: float = 0.25
    kv_block_tokens: int = 16
    idle_timeout_s: float = 300.0     # idle sessions lose their KV after this long (0 = never)
    engine: str = "auto"              # auto | paged | padded

    def __post_init__(self) -> None:
        for name in ("max_draft_tokens", "max_sessions", "max_q_support", "max_batch_sessions",
                     "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_step_tokens < self.max_draft_tokens + 1:
            raise ValueError(f"max_step_tokens ({self.max_step_tokens}) must hold a full draft + 1 "
                             f"({self.max_draft_tokens + 1})")
        if not 0.0 < self.kv_fraction <= 0.95:
            raise ValueError(f"kv_fraction must be in (0, 0.95], got {self.kv_fraction}")
        if self.kv_block_tokens < 1 or self.idle_timeout_s < 0:
            raise ValueError("kv_block_tokens must be >= 1 and idle_timeout_s >= 0")
        if self.engine not in ("auto", "paged", "padded"):
            raise ValueError(f"engine must be auto, paged or padded, got {self.engine!r}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
