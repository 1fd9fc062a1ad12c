"""The engines and the block pool: exact against generate(), no per-step copies, sharing."""
from __future__ import annotations

import pytest
import torch

from conftest import greedy_reference
from verify_server.engines import make_engine
from verify_server.engines.blocks import BlockPool, KVShape, PoolExhausted, prefix_hashes
from verify_server.engines.rows import Row

BUDGET = 32 << 20


def run_greedy(engine, prompts, new_tokens: int, prefill_chunk: int | None = None):
    """Prefill every prompt (optionally in chunks), then decode all rows together; every token
    fed is kept (committed) after its pass."""
    kvs = []
    for prompt in prompts:
        kv = engine.new_kv()
        kv.admit(prompt[:-1], len(prompt) + new_tokens, b"")
        kvs.append(kv)
    chunk = prefill_chunk or 1 << 30
    while True:
        rows = [Row(kv, p[kv.length:len(p) - 1][:chunk], False)
                for kv, p in zip(kvs, prompts) if kv.length < len(p) - 1]
        if not rows:
            break
        engine.forward(rows)
        for row in rows:
            row.kv.commit(len(row.tokens))
    outputs = [[] for _ in prompts]
    for _ in range(new_tokens):
        last = [o[-1] if o else p[-1] for o, p in zip(outputs, prompts)]
        logits = engine.forward([Row(kv, [t], True) for kv, t in zip(kvs, last)])
        for kv, out, row_logits in zip(kvs, outputs, logits):
            kv.commit(1)
            out.append(int(row_logits[-1].argmax()))
    return outputs, kvs


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", ["paged", "padded"])
def test_engines_match_generate_with_ragged_contexts(models, arch, kind):
    """Prompts of 1..90 tokens in one batch (gemma3's sliding window is 16), chunked prefill."""
    model = models[arch]
    torch.manual_seed(3)
    prompts = [torch.randint(3, 300, (n,)).tolist() for n in (1, 7, 90, 33, 2)]
    engine = make_engine(model, kv_budget_bytes=BUDGET, block_tokens=8, kind=kind)
    assert engine.kind == kind
    outputs, _ = run_greedy(engine, prompts, 12, prefill_chunk=13)
    for prompt, out in zip(prompts, outputs):
        assert out == greedy_reference(model, prompt, 12)


def test_paged_step_writes_only_new_tokens(models):
    """A session's context grows 10x; the KV bytes a step writes or copies stay the same, and
    the pool's storage is never reallocated. The padded fallback fails the same check."""
    model = models["llama"]
    per_step = {}
    for kind in ("paged", "padded"):
        engine = make_engine(model, kv_budget_bytes=BUDGET, block_tokens=16, kind=kind)
        storage = [t.data_ptr() for t in engine.pool.keys]
        kv = engine.new_kv()
        kv.admit([], 700, b"")
        engine.forward([Row(kv, list(range(3, 63)), False)])      # context 60
        kv.commit(60)
        copied = []
        for target in (60, 600):
            if target > kv.length:
                grow = target - kv.length
                engine.forward([Row(kv, [5] * grow, False)])
                kv.commit(grow)
            before = engine.bytes_copied
            engine.forward([Row(kv, [7, 8, 9], True)])               # one verify step
            copied.append(engine.bytes_copied - before)
            assert kv.length == target                                # all rejected: none kept
        per_step[kind] = copied
        assert [t.data_ptr() for t in engine.pool.keys] == storage
    paged_short, paged_long = per_step["paged"]
    assert paged_short == paged_long == 3 * engine.pool.shape.bytes_per_token
    padded_short, padded_long = per_step["padded"]
    assert padded_long > 5 * padded_short


def test_rollback_is_a_length_change(models):
    """A forward writes 20 tokens and leaves the length alone; keeping 9 of them moves no byte."""
    engine = make_engine(models["llama"], kv_budget_bytes=BUDGET, block_tokens=4)
    kv = engine.new_kv()
    kv.admit([], 64, b"")
    engine.forward([Row(kv, list(range(3, 23)), False)])
    assert kv.length == 0
    table, written = list(kv.table), engine.pool.bytes_written
    kv.commit(9)
    assert (kv.length, kv.table, engine.pool.bytes_written) == (9, table, written)
    with pytest.raises(RuntimeError, match="passes the 20 slots"):
        kv.commit(12)


def test_logits_only_where_wanted(models):
    """Prefill rows get no lm_head work: the head sees exactly the verify rows' positions."""
    model = models["llama"]
    engine = make_engine(model, kv_budget_bytes=BUDGET)
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[-2]))
    try:
        kvs = [engine.new_kv() for _ in range(3)]
        for kv in kvs:
            kv.admit([], 64, b"")
        logits = engine.forward([Row(kvs[0], list(range(3, 43)), False),
                                 Row(kvs[1], [5, 6, 7], True), Row(kvs[2], [9], True)])
    finally:
        hook.remove()
    assert seen == [4]
    assert logits[0] is None and logits[1].shape[0] == 3 and logits[2].shape[0] == 1


# --- the block pool --------------------------------------------------------------------------------

def tiny_pool(blocks: int = 9, block_tokens: int = 4) -> BlockPool:
    return BlockPool(KVShape(1, 1, 2, torch.float32), blocks, block_tokens)


def test_prefix_hashes_cover_whole_prefixes():
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, b"")
    b = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4, b"")
    c = prefix_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, b"")
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert c[1] != a[1]      # same second block, different first: not the same prefix


def test_prefix_blocks_are_shared_and_reference_counted():
    from verify_server.engines.kv import SessionKV
    pool = tiny_pool()
    first = SessionKV(pool)
    prompt = list(range(10, 21))                         # 11 tokens: 2 full blocks
    assert first.admit(prompt, 16, b"") == 0
    first.slots(0, len(prompt))
    first.commit(len(prompt))
    first.publish(prompt)
    second = SessionKV(pool)
    assert second.admit(prompt[:9] + [99, 98], 16, b"") == 8  # shares both full blocks
    assert second.table == first.table[:2]
    assert pool.refs[first.table[0]] == 2
    first.free()
    assert pool.refs[second.table[0]] == 1               # still held by the second session
    second.free()
    third = SessionKV(pool)
    assert third.admit(prompt, 16, b"") == 8              # freed but still cached: found again


def test_reservations_bound_admission():
    from verify_server.engines.kv import SessionKV
    pool = tiny_pool(blocks=9)                           # 8 usable blocks, 32 tokens
    a = SessionKV(pool)
    a.admit([1, 2, 3], 20, b"")                           # reserves 5 blocks
    with pytest.raises(PoolExhausted):
        SessionKV(pool).admit([4, 5, 6], 16, b"")         # needs 4, only 3 left
    b = SessionKV(pool)
    b.admit([4, 5, 6], 12, b"")                           # 3 fit
    assert pool.committed_blocks == 8
    a.free()
    SessionKV(pool).admit([7], 20, b"")                   # room again
    with pytest.raises(RuntimeError, match="reservation"):
        b.slots(0, 13)                                   # past what it reserved


def test_cached_blocks_are_reused_least_recent_first():
    from verify_server.engines.kv import SessionKV
    pool = tiny_pool(blocks=3, block_tokens=2)           # 2 usable blocks
    kv = SessionKV(pool)
    kv.admit([1, 2, 3], 4, b"")
    kv.slots(0, 3)
    kv.commit(3)
    kv.publish([1, 2, 3])
    kv.free()
    assert pool.cached_blocks() == 1
    other = SessionKV(pool)
    other.admit([7, 8, 9], 4, b"")
    other.slots(0, 4)                                    # needs both blocks: the cached one goes
    assert pool.cached_blocks() == 0
    other.free()
    assert SessionKV(pool).admit([1, 2, 3], 4, b"") == 0


def test_the_engines_import_one_way():
    """Within verify_server/engines/ no module imports one that imports it back (the package's
    __init__, the factory, imports them all and is imported by none of them)."""
    import ast
    from pathlib import Path

    import verify_server.engines as package

    folder = Path(package.__file__).parent
    imports = {}
    for path in folder.glob("*.py"):
        name = path.stem
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "verify_server.engines":   # a module, or the factory's names
                    found.update(alias.name if (folder / f"{alias.name}.py").exists()
                                 else "__init__" for alias in node.names)
                elif node.module.startswith("verify_server.engines."):
                    found.add(node.module.rsplit(".", 1)[1])
        imports[name] = found - {name}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n)))
                   for n in imports.get(start, ()))

    assert {"paged", "flex", "padded", "base", "visibility"} <= set(imports)
    assert not [name for name in imports if reaches(name, name)]
    assert not [name for name, found in imports.items() if "__init__" in found]
