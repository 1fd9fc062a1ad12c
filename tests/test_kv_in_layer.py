"""The KV write, the query gather and the output scatter inside sled's layer functions
(`decoder.AroundAttention`) against the engines' attention functions doing them around
attention: the pool bit-identical after every step (chains, prefill chunks, trees, decode rows,
shared prefix blocks, SAT rows, Gemma 3's sliding window), the logits transformers' own, and the
compiled layer functions compiled once per group count, not per step."""
from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from test_decoder import ENGINES, tiny
from test_flex_engine import assert_logits_agree, fragmented_sessions, step_rows
from verify_server.engines import decoder
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server.engines.rows import Row
from verify_server.sdsat import SatSpec

PROMPT = list(range(40, 61))


def sat_rows(kvs):
    return [Row(kvs[0], [1, 2, 3], True, sat_slots=2, sat_anchors=(1, 2, 3)),
            Row(kvs[1], [4, 5], True, sat_slots=3),
            Row(kvs[2], [6], True)]


def run(engine, monkeypatch, around: bool):
    """Every row kind through `engine`, the KV written inside the layer functions or (`around`
    false) by the engine's attention function: the logits of the last two steps, and how many
    times the attention function wrote the pool."""
    writes = []
    write = BlockPool.write
    with monkeypatch.context() as patch:
        patch.setattr(BlockPool, "write", lambda pool, *args: (writes.append(1),
                                                               write(pool, *args)))
        if not around:
            patch.setattr(decoder, "grouped_step", lambda step: None)
        kvs = fragmented_sessions(engine, [21, 9, 30, 14], PROMPT)
        logits = list(engine.forward(step_rows(kvs))) + list(engine.forward(sat_rows(kvs)))
    return logits, len(writes)


def engine_pair(kind: str, arch: str):
    """Two engines of `kind` on copies of one model, each over its own pool."""
    model = tiny(arch)
    sat = SatSpec(slots=3, token_ids=[7, 8, 9])
    return [ENGINES[kind](copy.deepcopy(model), BlockPool(KVShape.of(model), 96, 8), sat=sat)
            for _ in range(2)]


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_kv_written_inside_the_layer_is_the_attention_functions_bit_for_bit(
        monkeypatch, kind, arch):
    inside, around = engine_pair(kind, arch)
    got, got_writes = run(inside, monkeypatch, around=True)
    want, want_writes = run(around, monkeypatch, around=False)
    assert got_writes == 0 and want_writes > 0      # the first engine's layers wrote the KV
    for mine, theirs in zip((*inside.pool.keys, *inside.pool.values),
                            (*around.pool.keys, *around.pool.values)):
        assert torch.equal(mine, theirs)
    assert_logits_agree(got, want)
    assert inside.pool.bytes_written == around.pool.bytes_written


@pytest.mark.parametrize("kind", ENGINES)
def test_a_layer_step_gives_transformers_logits_and_pool(kind):
    """The same steps through transformers' forward (the attention function writes the KV):
    logits within 1e-5, argmax the same, the pool within float32 rounding."""
    model = tiny("gemma3")
    engines = [ENGINES[kind](copy.deepcopy(model), BlockPool(KVShape.of(model), 96, 8),
                             forward=forward) for forward in ("sled", "transformers")]
    outputs = []
    for engine in engines:
        kvs = fragmented_sessions(engine, [21, 9, 30, 14], PROMPT)
        outputs.append(list(engine.forward(step_rows(kvs))))
    assert_logits_agree(*outputs)
    mine, theirs = (engine.pool for engine in engines)
    for a, b in zip((*mine.keys, *mine.values), (*theirs.keys, *theirs.values)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compiled_grouped_layers_compile_per_group_count_not_per_step():
    """The flex engine with its layer functions compiled (inductor's CPU backend, as on CUDA):
    buckets of other rows, widths and tokens compile nothing new, a step with a prefill chunk
    (two groups) compiles each function once more; logits those of the eager layers."""
    compiled, eager = engine_pair("flex", "llama")
    compiled.compile_layers = True
    torch._dynamo.reset()
    graphs, outputs = [], {id(compiled): [], id(eager): []}
    for engine in (compiled, eager):
        kvs = [engine.new_kv() for _ in range(4)]
        for kv in kvs:
            kv.admit([], 120, b"")
        steps = [[Row(kv, [5, 6, 7], True) for kv in kvs[:3]],             # 4 rows x 8
                 [Row(kvs[0], [8, 9], True), Row(kvs[3], list(range(3, 20)), True)],   # 2 x 32
                 [Row(kvs[1], list(range(3, 50)), True), Row(kvs[2], [4], True)],  # two groups
                 [Row(kv, [10, 11, 12, 13, 14], True) for kv in kvs],         # 4 x 8 again
                 [Row(kvs[3], list(range(3, 70)), True), Row(kvs[0], [4, 5], True)]]
        for rows in steps:
            outputs[id(engine)].extend(engine.forward(rows))
            for row in rows:
                row.kv.commit(row.width)
            if engine is compiled:
                graphs.append(compiles())
    assert_logits_agree(outputs[id(compiled)], outputs[id(eager)])
    assert graphs[0] == graphs[1] == (1, 1) and graphs[2] == graphs[-1] == (2, 2), graphs


def compiles() -> tuple[int, int]:
    """The compiled variants dynamo holds of each grouped layer function."""
    return tuple(len(_debug_get_cache_entry_list(f.__code__))
                 for f in (decoder.before_grouped, decoder.after_grouped))
