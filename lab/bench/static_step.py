"""The centralized baseline of `sled bench engine`: transformers' own forward over its static KV
cache, every session one row of a dense batch, as a user with one GPU and no sled would serve
them. Where there is CUDA the whole step (forward and argmax) is captured in one CUDA graph, and
a step is: upload the draft, replay, copy the argmax back. On a CPU the same call runs eagerly.
Each row holds the very same context and draft as the sled engines' sessions, so its argmax is
compared with theirs."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import StaticCache

# Tokens one prefill forward carries at most (sessions x chunk), so a long fill fits in memory.
PREFILL_TOKENS = 8192


class StaticCacheStep:
    """n sessions of `context` tokens in a transformers StaticCache, verifying `width` tokens
    each step at the positions after their context."""

    def __init__(self, model: torch.nn.Module, sessions: int, context: int, width: int,
                 tokens_of: Callable[[int, int], list[int]], bytes_per_token: int,
                 graphs: bool) -> None:
        self.model, self.device = model, model.device
        self.step_bytes = sessions * width * bytes_per_token     # KV written per step
        self.bytes_copied = 0
        self.cache = StaticCache(config=model.config, max_cache_len=context + width)
        self.activate()
        self._prefill([tokens_of(s, context) for s in range(sessions)])
        self.saved = self._save()
        self.ids = torch.zeros(sessions, width, dtype=torch.long, device=self.device)
        self.host_ids = torch.zeros(sessions, width, dtype=torch.long,
                                    pin_memory=self.device.type == "cuda")
        self.cache_position = torch.arange(context, context + width, device=self.device)
        self.positions = self.cache_position.expand(sessions, width).contiguous()
        self.graph = self._capture() if graphs else None
        self.rewind()

    def activate(self) -> None:
        self.model.set_attn_implementation("sdpa")

    @torch.inference_mode()
    def _prefill(self, tokens: list[list[int]]) -> None:
        sessions, context = len(tokens), len(tokens[0])
        chunk = max(1, PREFILL_TOKENS // sessions)
        for start in range(0, context, chunk):
            ids = torch.tensor([row[start:start + chunk] for row in tokens], device=self.device)
            at = torch.arange(start, start + ids.shape[1], device=self.device)
            self.model(input_ids=ids, position_ids=at.expand_as(ids), cache_position=at,
                       past_key_values=self.cache, use_cache=True, logits_to_keep=1)

    def _save(self) -> list[tuple]:
        """What a step changes in each cache layer: its length counters, and a sliding layer's
        window (a full window shifts as the step's tokens enter it)."""
        return [(layer.cumulative_length.clone(), getattr(layer, "cumulative_length_int", None),
                 (layer.keys.clone(), layer.values.clone()) if layer.is_sliding else None)
                for layer in self.cache.layers]

    @torch.inference_mode()
    def rewind(self) -> None:
        """Back to the contexts alone, so every step verifies the same draft after them (the
        bench calls this after the clock stops)."""
        for layer, (length, length_int, window) in zip(self.cache.layers, self.saved):
            layer.cumulative_length.copy_(length)
            if length_int is not None:
                layer.cumulative_length_int = length_int
            if window is not None:
                layer.keys.copy_(window[0])
                layer.values.copy_(window[1])

    def _forward(self) -> torch.Tensor:
        """The step on the device: each row's argmax at every position [sessions, width]."""
        out = self.model(input_ids=self.ids, position_ids=self.positions,
                         cache_position=self.cache_position, past_key_values=self.cache,
                         use_cache=True)
        return out.logits.argmax(-1)

    @torch.inference_mode()
    def _capture(self, warmups: int = 2) -> torch.cuda.CUDAGraph:
        """Every warm-up and the capture start from the contexts alone: a step writes at the
        cache's length counters, and a sliding layer's Python-side length picks its branch and
        mask offsets, which the graph keeps."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                self.rewind()
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.rewind()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.argmax = self._forward()
        return graph

    @torch.inference_mode()
    def greedy(self, rows: Sequence) -> list[list[int]]:
        """One step over the rows' drafts (one row per session in order, `width` tokens each;
        their KV is this cache's, not theirs): each row's argmax."""
        self.host_ids.copy_(torch.tensor([row.tokens for row in rows], dtype=torch.long))
        self.ids.copy_(self.host_ids, non_blocking=True)
        if self.graph is None:
            self.argmax = self._forward()
        else:
            self.graph.replay()
        self.bytes_copied += self.step_bytes
        return self.argmax.tolist()
