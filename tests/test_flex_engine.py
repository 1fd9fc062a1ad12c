"""The flex engine (FlexAttention over the block pool in place, static step shapes) against the
paged engine and the target's own generate(): on fragmented block tables, holes a freed session
left, shared prefix blocks, chains, prefill chunks, trees, decode rows and SAT blocks, with a
sliding window and with softcap; no host sync inside its forward; the planner's buckets."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import types

import numpy as np
import pytest
import torch
from torch._inductor.cpu_vec_isa import valid_vec_isa_list
from torch.nn.attention.flex_attention import flex_attention
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import greedy_reference
from verify_server.engines import PagedEngine
from verify_server.engines import flex as flex_module
from verify_server.engines import make_engine
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server.engines.flex import (EAGER_POOL_TOKENS, FlexEngine, FlexStep, compiled_flex,
                                        flex_attention_forward, serving_flex)
from verify_server.engines.flex_check import AttentionShape, CompiledFlexRefused, refuse_if_unsound
from verify_server.engines.flex_plan import group_suffix, step_shape
from verify_server.engines.paged import paged_attention
from verify_server.engines.rows import Row

BT = 8
# The vector codes inductor can compile CPU kernels for here, widest first: every compiled test
# runs under each (an AVX-512 machine checks the AVX2 code too); per width the one inductor picks
VECTOR_CODES = sorted({isa.bit_width(): isa for isa in reversed(valid_vec_isa_list())}.values(),
                      key=lambda isa: -isa.bit_width())


def f32(model):
    return copy.deepcopy(model).to(torch.float32).eval()


def pools_for(model, blocks: int = 96, block_tokens: int = BT):
    """One pool, and a paged and a flex engine over it, each on its own copy of the model."""
    pool = BlockPool(KVShape.of(model), blocks, block_tokens)
    flex = FlexEngine(copy.deepcopy(model), pool)
    paged = PagedEngine(copy.deepcopy(model), pool)
    return pool, paged, flex


def prefill(engine, kv, tokens) -> None:
    engine.forward([Row(kv, tokens, False)])
    kv.commit(len(tokens))


def fragmented_sessions(engine, contexts, prompt):
    """Sessions whose tables interleave (grown a chunk at a time in turn), a freed session's
    holes taken by a later one, and a session on another's published prefix blocks."""
    torch.manual_seed(11)
    kvs = [engine.new_kv() for _ in contexts]
    junk = engine.new_kv()
    for kv, n in zip(kvs, contexts):
        kv.admit([], n + 40, b"t")
    junk.admit([], 40, b"t")
    texts = [torch.randint(3, 300, (n,)).tolist() for n in contexts]
    texts[0] = prompt
    done = [0] * len(kvs)
    while any(d < len(t) for d, t in zip(done, texts)):
        for i, (kv, text) in enumerate(zip(kvs, texts)):
            if done[i] < len(text):
                chunk = text[done[i]:done[i] + 5]
                prefill(engine, kv, chunk)
                done[i] += len(chunk)
        if junk.length == 0:
            prefill(engine, junk, list(range(3, 27)))
    junk.free()                                           # holes in the middle of the pool
    kvs[0].publish(prompt)
    sharer = engine.new_kv()
    bt = engine.pool.block_tokens
    # the prompt's full blocks: a windowed layer group (gemma3's, window 16) still holds those
    # the sharer's next query reads, the last of them
    n = len(prompt) // bt
    found = sharer.admit(prompt[:n * bt] + [9, 8, 7], 60, b"t")
    assert found == n * bt
    for mine, theirs in zip(sharer.tables, kvs[0].tables):
        assert all(m in (0, t) for m, t in zip(mine[:n], theirs[:n])) and mine[n - 1] == theirs[n - 1]
    prefill(engine, sharer, [9, 8, 7])
    return kvs + [sharer]


def step_rows(kvs):
    return [
        Row(kvs[0], [11, 12, 13, 14, 15], True),                              # verify, k=4
        Row(kvs[1], list(range(100, 140)), True),                             # prefill chunk: long
        Row(kvs[2], [21, 22, 23, 24, 25, 26, 27], True, parents=(0, 1, 0, 3, 3, 5)),   # a tree
        Row(kvs[3], [31], True),                                              # decode
        Row(kvs[4], [51, 52, 53, 54], True),                                  # on shared blocks
    ]


def assert_logits_agree(got, want) -> None:
    for mine, theirs in zip(got, want):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert float((mine - theirs).abs().max()) <= 1e-5
            assert torch.equal(mine.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_flex_logits_equal_the_paged_engines_on_a_fragmented_pool(models, prompts, arch):
    """fp32; gemma3's 16-token sliding window is passed by every context here."""
    model = f32(models[arch])
    pool, paged, flex = pools_for(model)
    kvs = fragmented_sessions(paged, [37, 20, 45, 18, 0][:4], (prompts[0] * 4)[:33])
    rows = step_rows(kvs)
    before = [t.clone() for t in (*pool.keys, *pool.values)]
    want = paged.forward(rows)
    written = [t.clone() for t in (*pool.keys, *pool.values)]
    for tensor, kept in zip((*pool.keys, *pool.values), before):
        tensor.copy_(kept)
    got = flex.forward(rows)
    assert_logits_agree(got, want)
    for tensor, paged_wrote in zip((*pool.keys, *pool.values), written):   # the same KV writes
        # (block 0 aside: flex writes its padding there, the paged engine reads it as padding)
        torch.testing.assert_close(tensor[BT:], paged_wrote[BT:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (None, 30.0), (24, 30.0)])
def test_sat_blocks_window_and_softcap_at_the_attention_level(window, softcap):
    """Random queries and keys through the two attention functions, on one step of every row
    kind, SAT blocks after every cut among them."""
    torch.manual_seed(2)
    shape = KVShape(layers=1, kv_heads=2, head_dim=16, dtype=torch.float32)
    pool = BlockPool(shape, 48, BT)
    for tensor in (*pool.keys, *pool.values):
        tensor[BT:] = torch.randn(tensor[BT:].shape)
    kvs = []
    for n in (29, 40, 17, 9):
        kv = _Session(pool, n)
        kvs.append(kv)
    rows = [Row(kvs[0], [1, 2, 3], True, sat_slots=2, sat_anchors=(1, 2, 3)),
            Row(kvs[1], [4, 5, 6, 7], True, parents=(0, 1, 1)),
            Row(kvs[2], list(range(40)), False),
            Row(kvs[3], [8, 9], True, sat_slots=3)]
    tokens = sum(row.width for row in rows)
    q = torch.randn(1, 8, tokens, 16)
    k, v = torch.randn(1, 2, tokens, 16), torch.randn(1, 2, tokens, 16)
    module = types.SimpleNamespace(layer_idx=0)
    engine = PagedEngine.__new__(PagedEngine)
    engine.pool, engine.device, engine.sat = pool, torch.device("cpu"), None
    before = [t.clone() for t in (*pool.keys, *pool.values)]
    step = engine._plan(rows)[0]
    want, _ = paged_attention(module, q, k, v, None, scaling=0.25, sliding_window=window,
                              softcap=softcap, sled_step=step)
    for tensor, kept in zip((*pool.keys, *pool.values), before):
        tensor.copy_(kept)
    flex = FlexEngine.__new__(FlexEngine)
    flex.pool, flex.device, flex.flex, flex.kv_width, flex.steps, flex.bytes_copied = (
        pool, torch.device("cpu"), torch.nn.attention.flex_attention.flex_attention,
        pool.num_blocks, {}, 0)
    flex.full_blocks, flex.long_flex, flex.splits = True, flex.flex, "torch"
    plan = flex.step(rows)
    padded = [torch.cat([x, x.new_zeros(1, x.shape[1], plan.tokens - tokens, 16)], 2)
              for x in (q, k, v)]
    got, _ = flex_attention_forward(module, *padded, None, scaling=0.25, sliding_window=window,
                                    softcap=softcap, sled_flex=plan)
    assert float((got[0, :tokens] - want[0]).abs().max()) <= 1e-5
    assert not got.isnan().any()


class _Session:
    """A session's KV with a committed context of n tokens, without a model."""

    def __new__(cls, pool, n):
        from verify_server.engines.kv import SessionKV

        kv = SessionKV(pool)
        kv.admit([], n + 48, b"")
        kv.slots(0, n)
        kv.commit(n)
        return kv


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_flex_engine_matches_generate_with_ragged_contexts_and_long_prefill(models, arch):
    """Prompts of 1..90 tokens in one batch, prefilled whole (a long group beside short rows),
    then decoded together: generate()'s tokens."""
    from tests.test_engine import run_greedy

    model = models[arch]
    torch.manual_seed(3)
    prompts = [torch.randint(3, 300, (n,)).tolist() for n in (1, 7, 90, 33, 2)]
    engine = make_engine(model, kv_budget_bytes=BT * 160 * KVShape.of(model).bytes_per_token,
                         block_tokens=BT, kind="flex")
    assert engine.kind == "flex"
    outputs, _ = run_greedy(engine, prompts, 12)
    for prompt, out in zip(prompts, outputs):
        assert out == greedy_reference(model, prompt, 12)


async def test_eight_sessions_over_grpc_match_generate_on_the_flex_engine(serve, models,
                                                                         drafter_models, tokenizer,
                                                                         prompts):
    """The greedy oracle through the server, with a noisy drafter that is sometimes rejected."""
    from drafters.hf import HFDrafter
    from edge_client.session import RoundSettings, generate
    from edge_client.wire import SessionRequest
    from tests.test_lossless import server_stub

    model = models["llama"]
    server = await serve(model, engine="flex", kv_budget=2 << 20)
    assert server.scheduler.engine.kind == "flex"
    results = await asyncio.gather(*(
        generate(server_stub(server),
                 HFDrafter(drafter_models["llama"], tokenizer, name="hf:noisy"),
                 SessionRequest(prompt, max_new_tokens=16), settings=RoundSettings(draft_len=4))
        for prompt in prompts))
    for result, prompt in zip(results, prompts):
        assert result.token_ids == greedy_reference(model, prompt, 16)
    assert 0 < sum(r.accepted_tokens for r in results) < sum(r.draft_tokens for r in results)


# --- no host sync inside the forward ----------------------------------------------------------

SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
         torch.ops.aten.masked_select.default, torch.ops.aten.is_nonzero.default}


class SyncCensus(TorchDispatchMode):
    """Counts the ops that make a host wait for the device: a scalar read (.item(), .tolist()),
    nonzero, and boolean-mask indexing."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if func in SYNCS:
            self.count += 1
        elif func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default):
            indices = args[1] if len(args) > 1 else ()
            self.count += any(i is not None and i.dtype == torch.bool for i in indices)
        return func(*args, **kwargs)


def test_neither_the_flex_nor_the_paged_forward_makes_a_host_sync(models):
    """The flex engine's forward, through transformers' forward and its attention function, and
    the paged engine's through sled's (its output scatter in the layer functions, by index)."""
    model = f32(models["llama"])
    pool, paged, flex = pools_for(model)
    kvs = fragmented_sessions(paged, [20, 12, 30, 9], list(range(3, 40)))
    rows = [row for row in step_rows(kvs) if row.width <= 32]
    step = flex.step(rows)
    inputs = dict(input_ids=step.fields["ids"].long()[None],
                  position_ids=step.fields["positions"].long()[None],
                  attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool), use_cache=False)
    torch.nn.attention.flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        with torch.inference_mode(), SyncCensus() as census:
            flex.model(**inputs, sled_flex=step)
    finally:
        torch.nn.attention.flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = False
    assert census.count == 0
    with torch.inference_mode(), SyncCensus() as census:
        paged.forward(rows)
    assert census.count == 0
    with SyncCensus() as census:     # what the census sees: boolean indexing, a scalar read
        x = torch.arange(4.0)
        x[x > 1].sum().item()
    assert census.count == 2


# --- buckets ----------------------------------------------------------------------------------

def test_steps_of_one_bucket_share_shapes_and_buffers(models):
    a, b = step_shape([5, 1, 7]), step_shape([2, 3])
    assert (a.tokens, [(g.rows, g.width) for g in a.groups]) == (16, [(4, 8)])
    assert (b.tokens, [(g.rows, g.width) for g in b.groups]) == (8, [(2, 8)])
    mixed = step_shape([5, 40, 300])
    assert [(g.rows, g.width) for g in mixed.groups] == [(1, 8), (2, 512)]
    assert mixed.tokens == 352 and not mixed.graphable and a.graphable
    model = f32(models["llama"])
    pool, paged, flex = pools_for(model)
    kvs = fragmented_sessions(paged, [20, 12, 30, 9], list(range(3, 40)))
    first = flex.step([Row(kvs[0], [1, 2, 3], True), Row(kvs[1], [4], True)])
    second = flex.step([Row(kvs[2], [5, 6], True), Row(kvs[3], [7, 8, 9, 10, 11], True,
                                                        parents=(0, 1, 1, 2))])
    assert first is second and isinstance(first, FlexStep) and len(flex.steps) == 1
    assert first.fields["ids"].data_ptr() == second.fields["ids"].data_ptr()


@contextlib.contextmanager
def compiled_for(code):
    """Inductor compiling CPU kernels for the vector code `code` (its width in bits), with no
    compiled function left from another code."""
    torch._dynamo.reset()
    with torch._inductor.config.patch({"cpp.simdlen": code.bit_width()}):
        yield
    torch._dynamo.reset()


def unchecked(monkeypatch):
    """The flex engine without its probe of a compiled flex: what it would serve if unchecked."""
    monkeypatch.setattr(flex_module, "refuse_if_unsound", lambda *args: None)


def assert_refused_truly(refusal, code, monkeypatch, build, rows, want) -> None:
    """A refusal is one line naming the vector code and the engine to use instead, and the
    refused compiled flex does disagree with the paged engine on the engine's own step."""
    message = str(refusal)
    assert "\n" not in message and str(code) in message and "--engine paged" in message
    unchecked(monkeypatch)
    got = build().forward(rows)
    assert max(float((g - w).abs().max()) for g, w in zip(got, want)) > 1e-5


@pytest.mark.parametrize("code", VECTOR_CODES, ids=str)
def test_a_second_step_of_the_bucket_compiles_nothing_new(models, code, monkeypatch):
    """Under each vector code: the compiled flex function (one per bucket and window) serves a
    later step of other rows, lengths and trees in the same bucket without a recompile; or,
    where torch compiles it wrong (8-token blocks, head_dim 16, AVX2 code in torch 2.13), the
    engine refuses it at start and the refusal is true."""
    import torch._dynamo.utils as dynamo_utils

    with compiled_for(code):
        model = f32(models["llama"])
        pool = BlockPool(KVShape.of(model), 64, BT)
        compiled = torch.compile(flex_attention, dynamic=False)
        paged = PagedEngine(copy.deepcopy(model), pool)
        kvs = fragmented_sessions(paged, [20, 12, 30, 9], list(range(3, 40)))
        first = [Row(kvs[0], [1, 2, 3], True), Row(kvs[1], [4], True)]
        want = paged.forward(first)
        build = lambda: FlexEngine(copy.deepcopy(model), pool, flex=compiled)
        try:
            flex = build()
        except CompiledFlexRefused as refusal:
            assert_refused_truly(refusal, code, monkeypatch, build, first, want)
            return
        assert_logits_agree(flex.forward(first), want)
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        flex.forward([Row(kvs[2], [5, 6], True), Row(kvs[3], [7, 8, 9, 10, 11], True,
                                                     parents=(0, 1, 1, 2))])
        assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


def test_after_warm_up_prefill_of_every_length_and_verify_rows_compile_nothing(models):
    """The flex engine a server runs on a CPU (serving_flex), warmed up as `sled serve` warms it:
    prefill chunks of 40 to 300 tokens (long groups of 64 to 512 queries), alone and several in
    a step, verify steps of 1 to 3 rows and a step mixing both run without one compile, and
    agree with the paged engine."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    model = f32(models["llama"])
    pool = BlockPool(KVShape.of(model), 160, 16)
    try:
        flex = FlexEngine(copy.deepcopy(model), pool, flex=serving_flex(pool))
    except CompiledFlexRefused:
        pytest.skip(f"compiled flex is refused on this CPU ({flex_module.vector_code()})")
    paged = PagedEngine(copy.deepcopy(model), pool)
    flex.warm_up(max_rows=4, max_step_tokens=512)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    torch.manual_seed(5)
    kvs = []

    def run(rows, commit):
        want = paged.forward(rows)
        assert_logits_agree(flex.forward(rows), want)
        for row, n in zip(rows, commit):
            row.kv.commit(n)

    def new_rows(lengths):
        rows = []
        for n in lengths:
            kvs.append(flex.new_kv())
            kvs[-1].admit([], n + 16, b"t")
            rows.append(Row(kvs[-1], torch.randint(3, 300, (n,)).tolist(), True))
        return rows

    for lengths in ([40], [70], [150], [300], [40, 70, 130]):
        rows = new_rows(lengths)
        run(rows, lengths)
    for count in (1, 3):
        run([Row(kv, [5, 6, 7, 8, 9], True) for kv in kvs[:count]], [1] * count)
    run([Row(kvs[3], [5, 6, 7, 8, 9], True), *new_rows([50])], [1, 50])
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_planner_fills_what_the_paged_engine_plans(models, arch):
    """Write slots (each layer group's: gemma3's windowed pool has two) and positions of a
    mixed step, against PagedEngine._plan's."""
    model = f32(models[arch])
    pool, paged, flex = pools_for(model)
    assert len(pool.groups) == (2 if arch == "gemma3" else 1)
    kvs = fragmented_sessions(paged, [37, 20, 45, 18], (list(range(3, 40))))
    rows = step_rows(kvs)
    step, ids, positions, _ = paged._plan(rows)
    plan = flex.step(rows)
    tokens = step.tokens
    for k, write_slots in enumerate(step.write_slots):
        planned = plan.fields[f"write_slots{group_suffix(k)}"]
        assert np.array_equal(planned[:tokens].numpy(), write_slots.numpy())
        assert (planned[tokens:] == 0).all()      # padding: the trash slot
    assert np.array_equal(plan.fields["positions"][:tokens].numpy(), positions.numpy())
    assert np.array_equal(plan.fields["ids"][:tokens].numpy(), ids.numpy())


# --- the whole step, graphs, and engines sharing a model -------------------------------------

def argmax_of(step) -> list[list[int]]:
    """Each row's argmax tokens, from one copy of the step's argmax ([] for a row without
    logits)."""
    targets = step.targets()
    return [[] if span is None else targets[span] for span in step.spans]


def test_a_steps_argmax_gives_each_rows_and_graphs_need_cuda(models):
    model = f32(models["llama"])
    pool, paged, flex = pools_for(model)
    kvs = fragmented_sessions(paged, [20, 12, 30, 9], list(range(3, 40)))
    rows = [Row(kvs[0], [1, 2, 3], True), Row(kvs[1], [4], False), Row(kvs[2], [5, 6], True)]
    want = [[] if logits is None else logits.argmax(-1).tolist() for logits in paged.forward(rows)]
    assert argmax_of(flex.forward(rows)) == want and want[1] == [] and len(want[0]) == 3
    assert not flex.replayable(rows)                  # no CUDA here: no graph to replay
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        FlexEngine(copy.deepcopy(model), pool, graphs=True)


@pytest.mark.parametrize("code", VECTOR_CODES, ids=str)
def test_a_step_captured_by_compile_matches_and_its_bucket_compiles_once(models, code):
    """Under each vector code, at 16-token blocks: capture="compile" (the whole step through
    torch.compile; on CPU without a graph) gives the paged engine's argmax and logits, and a
    later step of other rows in the same bucket runs the same compiled step."""
    import torch._dynamo.utils as dynamo_utils

    with compiled_for(code):
        model = f32(models["llama"])
        pool, paged, _ = pools_for(model, block_tokens=16)
        compiled = FlexEngine(copy.deepcopy(model), pool, graphs=True, capture="compile")
        kvs = fragmented_sessions(paged, [20, 12, 30, 9], list(range(3, 40)))
        first = [Row(kvs[0], [1, 2, 3], True), Row(kvs[1], [4], True),
                 Row(kvs[2], [5, 6], False)]
        want = [[] if logits is None else logits.argmax(-1).tolist()
                for logits in paged.forward(first)]
        assert compiled.replayable(first) and argmax_of(compiled.forward(first)) == want
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        second = [Row(kvs[3], [7, 8, 9, 10, 11], True, parents=(0, 1, 1, 2)),
                  Row(kvs[4], [9], True), Row(kvs[1], [4, 5], True)]
        assert step_shape([r.width for r in second]) == step_shape([r.width for r in first])
        assert_logits_agree(compiled.forward(second), paged.forward(second))
        assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
        assert len(compiled.captured) == 1
    with pytest.raises(ValueError, match="unknown capture 'trees': use graph or compile"):
        FlexEngine(copy.deepcopy(model), pool, capture="trees")


def test_a_compiled_flex_that_disagrees_is_refused_in_one_line():
    """The start-up check refuses any error past the tests' own bound, and NaN; it accepts
    rounding; it names the engine to use, and a block size that avoids torch's AVX2 defect
    where the blocks are shorter."""
    cpu = torch.device("cpu")
    shapes = [AttentionShape(4, 2, 16, torch.float32, 8), AttentionShape(4, 2, 16, torch.float32, 16)]
    refuse_if_unsound(lambda shape: 3e-7, shapes, cpu)
    for error in (2e-5, 1.5, math.nan):
        with pytest.raises(CompiledFlexRefused) as refused:
            refuse_if_unsound(lambda shape: error, shapes, cpu)
        line = str(refused.value)
        assert "\n" not in line and "serve with --engine paged, or with --kv-block-tokens 16" in line
        assert "head_dim 16, 4/2 heads, 8-token KV blocks, float32" in line
    with pytest.raises(CompiledFlexRefused, match=r"16-token KV blocks.*--engine paged$"):
        refuse_if_unsound(lambda shape: 0.0 if shape.block_tokens == 8 else 1.0, shapes, cpu)


def test_the_probe_sees_a_kernel_that_drops_one_key(monkeypatch):
    """The probe step catches a wrong kernel: a flex that never sees the last key of a block."""
    def drops_a_key(q, k, v, block_mask=None, **kwargs):
        k = k.clone()
        k[:, :, 7::8] = 0.0
        return flex_attention(q, k, v, block_mask=block_mask, **kwargs)

    shape = AttentionShape(4, 2, 16, torch.float32, 8)
    assert flex_module.probe_error(flex_attention, shape, torch.device("cpu")) == 0.0
    assert flex_module.probe_error(drops_a_key, shape, torch.device("cpu")) > 1e-3


def test_a_server_runs_compiled_flex_on_a_cpu_and_eager_only_on_a_small_pool():
    """serving_flex: float32 compiled, with shapes dynamic (no graphs to capture per bucket on a
    CPU; checked at start); float64, which torch does not compile
    on a CPU, eager only where scoring the whole pool stays small."""
    def pool(dtype, tokens):
        return BlockPool(KVShape(1, 2, 16, dtype), tokens // 16, 16)

    assert serving_flex(pool(torch.float32, 1 << 20)) is compiled_flex(dynamic=True)
    assert serving_flex(pool(torch.float64, EAGER_POOL_TOKENS)) is flex_attention
    with pytest.raises(ValueError, match=r"runs float64 targets eagerly.*serve with --engine "
                                         r"paged, a float32 target, or a KV pool of at most"):
        serving_flex(pool(torch.float64, 2 * EAGER_POOL_TOKENS))


def test_an_empty_plan_writes_only_the_trash_slot():
    from verify_server.engines.flex_plan import common_shapes

    shapes = common_shapes(64)
    assert [(s.groups[0].rows, s.tokens) for s in shapes] == [
        (1, 8), (2, 16), (4, 32), (8, 64), (16, 96), (32, 160), (64, 320)]
    assert all(s.graphable and s.groups[0].width == 8 for s in shapes)
    pool = BlockPool(KVShape(1, 2, 16, torch.float32), 16, BT)
    step = FlexStep(pool, shapes[3], pool.num_blocks, torch.device("cpu"))
    step.clear(0)
    assert (step.fields["write_slots"] == 0).all() and (step.fields["q_index0"] == 64).all()
    assert (step.fields["table0"] == -1).all() and (step.fields["widths0"] == 0).all()


def test_engines_sharing_one_model_take_turns(models):
    """A benchmark's engines share one model object: each routes its attention there before
    its step, and both give the same logits."""
    model = f32(models["llama"])
    pool = BlockPool(KVShape.of(model), 96, BT)
    flex = FlexEngine(model, pool)
    paged = make_engine(model, kv_budget_bytes=96 * BT * KVShape.of(model).bytes_per_token,
                        block_tokens=BT, kind="paged")
    results = []
    for engine in (paged, flex, paged):
        engine.activate()
        kv = engine.new_kv()
        kv.admit([], 40, b"")
        results.append(engine.forward([Row(kv, list(range(3, 30)), True)])[0])
        kv.free()
    assert_logits_agree(results[1], results[0])
    assert torch.equal(results[2], results[0])


def test_the_engine_bench_runs_every_engine_on_cpu(tmp_path, capsys):
    """The GPU measurement's command, dry-run on tiny shapes: the engines and transformers'
    static-cache baseline, agreement, floor."""
    import json

    from sled_cli.main import main

    out = tmp_path / "engine.json"
    assert main(["bench", "engine", "--shape", "tiny-llama,tiny-gemma3", "--engines",
                 "paged,flex,flex-graph,flex-graph-overlap,transformers-graph", "--sessions",
                 "1,3", "--contexts",
                 "40", "--reps", "1",
                 "--bandwidth", "1e10", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [m["model"] for m in results["models"]] == ["tiny-llama", "tiny-gemma3"]
    for entry in results["models"]:
        assert len(entry["cells"]) == 2
        for cell in entry["cells"]:
            # every session's verdict: its accepted draft tokens and one more
            total = int(cell["paged_emitted_agree"].split("/")[1])
            assert cell["sessions"] <= total <= cell["sessions"] * 5
            agree = f"{total}/{total}"
            assert cell["flex_emitted_agree"] == cell["flex-graph_emitted_agree"] == agree
            # overlapped steps decide what the serial ones do, and move the same KV a step
            assert cell["flex-graph-overlap_emitted_agree"] == agree
            assert cell["flex-graph-overlap_bytes_copied"] == cell["flex-graph_bytes_copied"]
            # the baseline's static cache holds the same contexts (gemma3's window shifted)
            assert cell["transformers-graph_emitted_agree"] == agree
            assert cell["flex_ms_p50"] > 0 and cell["floor_ms"] > 0
            # the step graphs each flex engine holds: none on a CPU, where steps are compiled
            assert cell["flex_graphs"] == cell["flex-graph_graphs"] == 0
            assert cell["flex-graph_graph_mib"] == 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_engine_bench_runs_without_the_rest_of_the_install(tmp_path):
    """`python -m lab.bench.engine` is the GPU box's command: its Python has torch and
    transformers but not the daemon's and the CLI's dependencies, so the bench imports none."""
    import subprocess
    import sys

    script = ("import sys\nfrom lab.bench import engine\n"
              f"code = engine.main(['--plan-only', '--sessions', '2', '--contexts', '64', "
              f"'--reps', '1', '--out', {str(tmp_path / 'plan.json')!r}])\n"
              "print(sorted({m.split('.')[0] for m in sys.modules} & "
              "{'pydantic', 'pydantic_settings', 'dotenv', 'aiomqtt', 'paho', "
              "'cryptography', 'llama_cpp'}))\n"
              "raise SystemExit(code)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "plan.json").stat().st_size > 0


def test_an_unknown_engine_kind_and_a_row_past_the_kv_width_are_refused(models):
    model = f32(models["llama"])
    with pytest.raises(ValueError, match="unknown engine kind 'vllm': use auto, paged, flex, padded"):
        make_engine(model, kv_budget_bytes=1 << 20, kind="vllm")
    pool = BlockPool(KVShape.of(model), 32, BT)
    flex = FlexEngine(copy.deepcopy(model), pool, kv_width=2)      # rows may list 2 blocks
    kv = flex.new_kv()
    kv.admit([], 40, b"")
    with pytest.raises(ValueError, match="a row of 3 blocks passes the step's 2"):
        flex.forward([Row(kv, list(range(3, 23)), False)])


@pytest.mark.parametrize("full_blocks", [True, False])
def test_a_rows_committed_context_blocks_are_full_blocks(models, full_blocks):
    """Blocks wholly before a row's new entries skip the mask (full blocks); the block of the new
    entries, and every block with full blocks off, are decided by the mask_mod."""
    model = f32(models["llama"])
    pool = BlockPool(KVShape.of(model), 64, BT)
    engine = FlexEngine(model, pool, full_blocks=full_blocks)
    kvs = [engine.new_kv() for _ in range(2)]
    for kv, n in zip(kvs, (21, 9)):
        kv.admit([], n + 20, b"t")
        prefill(engine, kv, list(range(3, 3 + n)))
    step = engine.step([Row(kvs[0], [5, 6, 7], True), Row(kvs[1], [8], True)])
    mask = step.groups[0].block_mask(0, None, 2)
    blocks = mask.kv_num_blocks.view(-1)[:2].tolist()
    if full_blocks:      # 21 committed: 2 whole blocks of 8, then the block the draft lands in
        assert mask.full_kv_num_blocks.view(-1)[:2].tolist() == [2, 1]
        assert blocks == [1, 1]
        assert mask.full_kv_indices[0, 0, 0, :2].tolist() == kvs[0].table[:2]
        assert mask.kv_indices[0, 0, 0, 0].item() == kvs[0].table[2]
    else:
        assert mask.full_kv_num_blocks is None and blocks == [3, 2]


# --- the small token buckets ----------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_step_in_each_small_token_bucket_gives_the_paged_engines_logits(models, arch):
    """fp32, fragmented tables: one verify row (the 8-token bucket), two verify rows and a tree
    with a decode row (16), and four rows of every kind (32) give the paged engine's logits and
    argmax, their padding read by nothing."""
    model = f32(models[arch])
    pool, paged, flex = pools_for(model)
    kvs = fragmented_sessions(paged, [37, 20, 45, 18], (list(range(3, 40)) * 2)[:33])
    steps = {
        8: [Row(kvs[0], [11, 12, 13, 14, 15], True)],
        16: [Row(kvs[1], [21, 22, 23, 24, 25], True), Row(kvs[2], [31, 32, 33, 34, 35], True)],
        32: [Row(kvs[0], [11, 12, 13, 14, 15], True), Row(kvs[3], [41], True),
             Row(kvs[2], [21, 22, 23, 24, 25, 26, 27], True, parents=(0, 1, 0, 3, 3, 5)),
             Row(kvs[4], [51, 52, 53, 54], True)],
    }
    for tokens, rows in steps.items():
        assert step_shape([row.width for row in rows]).tokens == tokens
        assert_logits_agree(flex.forward(rows), paged.forward(rows))
    assert sorted(shape.tokens for shape in flex.steps) == [8, 16, 32]
