"""One session's key/value cache: per layer, keys and values of the tokens the target has seen."""
from __future__ import annotations

import torch


class SessionKV:
    """Keys/values per layer, each [1, kv_heads, length, head_dim]; length excludes the last
    committed token, which is fed again with the next draft."""

    __slots__ = ("layers",)

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[2] if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` tokens (rejected draft tokens fall away)."""
        if length < self.length:
            self.layers = [(k[:, :, :length], v[:, :, :length]) for k, v in self.layers]

    def free(self) -> None:
        self.layers = []
