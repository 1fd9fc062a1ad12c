"""The flex engine's buckets: a step takes the smallest that holds it (8 and 16 tokens under the
32-token quantum), every bucket a server can meet is enumerated (the most graphs it captures),
the warm-up covers the small ones, and the graphs' memory is estimated from what they keep."""
from __future__ import annotations

import copy
import itertools
import logging

import torch

from verify_server.engines import flex_graphs
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server.engines.flex import FlexEngine
from verify_server.engines.flex_plan import (SMALL_TOKENS, TOKEN_QUANTUM, bucket_tokens,
                                             graphable_shapes, step_shape)


def test_a_step_takes_the_smallest_token_bucket_that_holds_it():
    buckets = sorted({bucket_tokens(n) for n in range(1, 400)})
    assert buckets[:4] == [8, 16, 32, 64] and all(b % TOKEN_QUANTUM == 0 for b in buckets[2:])
    for n in range(1, 400):
        assert bucket_tokens(n) == min(b for b in buckets if b >= n)
    one_verify = step_shape([5])                     # one row, a 4-token draft and its bonus
    assert one_verify.tokens == 8 and one_verify.graphable
    assert [step_shape([5] * n).tokens for n in (2, 3, 4, 16)] == [16, 16, 32, 96]
    assert step_shape([1] * 16).tokens == 16 and step_shape([1] * 17).tokens == 32
    assert step_shape([5, 40]).tokens == 64           # a prefill chunk: past the small buckets


def test_every_bucket_a_step_can_fall_in_is_enumerated():
    """Every step of up to 4 rows of up to 32 entries and 40 tokens, each multiset of widths:
    exactly the enumerated buckets."""
    met = {step_shape(widths)
           for rows in range(1, 5)
           for widths in itertools.combinations_with_replacement(range(1, 33), rows)
           if sum(widths) <= 40}
    assert met == set(graphable_shapes(4, 40))


def test_the_small_buckets_add_few_graphs_to_a_servers_bound():
    """At the server's defaults (64 rows, 2,048 tokens): 229 buckets, 9 more than with the
    32-token quantum alone, which held 220: 12 of 8 or 16 tokens, of up to 16 rows, split
    off the 32-token buckets of their rows and width."""
    shapes = graphable_shapes(64, 2048)
    assert len(shapes) == len(set(shapes)) == 229
    small = [s for s in shapes if s.tokens in SMALL_TOKENS]
    assert len(small) == 12 and all(s.groups[0].rows <= 16 for s in small)


def _engine(tiny_llama) -> FlexEngine:
    model = copy.deepcopy(tiny_llama).to(torch.float32).eval()
    return FlexEngine(model, BlockPool(KVShape.of(model), 48, 8), graphs=True, capture="compile")


def test_the_warm_up_covers_every_small_bucket(models, monkeypatch, caplog):
    """With graphs, the warm-up readies the buckets of verify rows (drafts of up to 7 and up to
    15 tokens) and decode rows at every power of two of rows: the 8- and 16-token ones among
    them; the log says how many graphs it holds (none on a CPU) and the most there can be."""
    engine = _engine(models["llama"])
    warmed = []
    monkeypatch.setattr(engine, "prewarm", warmed.extend)
    with caplog.at_level(logging.INFO, logger="sled.server.flex"):
        engine.warm_up(max_rows=16, max_step_tokens=256)
    for width, rows in itertools.product((1, 5, 9), (1, 2, 4, 8, 16)):
        assert step_shape([width] * rows) in warmed
    assert {8, 16} <= {shape.tokens for shape in warmed if shape.graphable}
    assert "flex engine: 0 step graphs (about 0 MiB) captured; steps of up to 16 rows and 256 " \
           "tokens capture at most 0 step graphs" in caplog.text


@torch.inference_mode()
def test_the_memory_estimate_holds_what_a_bucket_keeps(models):
    """A bucket's estimate covers the logits and argmax its whole step leaves and its plan's
    buffer; an 8-token bucket costs less than the 32-token one it replaces."""
    engine = _engine(models["llama"])
    estimates = {}
    for shape in (step_shape([5]), step_shape([5] * 4)):
        step = engine._empty(shape)
        logits, argmax = engine.whole_step(step)
        kept = logits.nbytes + argmax.nbytes + step.device_buffer.nbytes
        estimate = flex_graphs.estimate(engine.model, [shape], engine.kv_width,
                                        engine.pool.num_blocks)
        assert estimate.graphs == 1 and kept <= estimate.bytes
        estimates[shape.tokens] = estimate.bytes
    assert estimates[8] < estimates[32]
    assert engine.graph_memory() == flex_graphs.GraphMemory(0, 0)    # a CPU captures none
    assert flex_graphs.GraphMemory(3, 5 << 20).to_json() == {"graphs": 3, "graph_mib": 5.0}
    assert flex_graphs.estimate(engine.model, [], 1, 1) == flex_graphs.GraphMemory(0, 0)
