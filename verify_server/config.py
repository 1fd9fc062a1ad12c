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

    def __post_init__(self) -> None:
        for name in ("max_draft_tokens", "max_sessions", "max_q_support", "max_batch_sessions",
                     "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
