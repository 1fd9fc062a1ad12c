"""A pool that knows sliding windows: Gemma 3's windowed layers keep only their window of KV, in
layer groups of their own (verify_server.engines.blocks), and every output stays generate()'s."""
from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import greedy_reference
from verify_server.engines import make_engine
from verify_server.engines.blocks import BlockPool, KVShape, PoolExhausted, layer_groups
from verify_server.engines.kv import DROPPED, SessionKV
from verify_server.synthetic import layer_types

WINDOW = 16     # the tiny gemma3's sliding window (lab.tiny)


def gemma3_windows(layers: int, window: int) -> tuple[int | None, ...]:
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types(layers))


def test_layers_are_grouped_by_kind_into_groups_of_equal_size():
    """Gemma 3 270M: 3 full layers and 15 windowed ones, 6 groups of 3; Gemma 3 4B: 5 and 29,
    a last windowed group of 4; a model without windows: one group of every layer."""
    small = layer_groups(gemma3_windows(18, 512))
    assert [(g.window, g.layers) for g in small[:2]] == [(None, (5, 11, 17)), (512, (0, 1, 2))]
    assert len(small) == 6 and {len(g.layers) for g in small} == {3}
    four_b = layer_groups(gemma3_windows(34, 1024))
    assert [len(g.layers) for g in four_b] == [5, 5, 5, 5, 5, 5, 4]
    assert sorted(layer for g in four_b for layer in g.layers) == list(range(34))
    assert [g.layers for g in layer_groups((None,) * 32)] == [tuple(range(32))]
    assert KVShape(32, 8, 128, torch.bfloat16).group_layers == 32


def sessions_that_fit(shape: KVShape, budget_bytes: int, tokens: int, row_tokens: int) -> int:
    pool = BlockPool(shape, budget_bytes // (16 * shape.slot_bytes), 16, row_tokens=row_tokens)
    count = 0
    while True:
        try:
            SessionKV(pool).admit([], tokens, b"")
        except PoolExhausted:
            return count
        count += 1


@pytest.mark.parametrize("tokens,least", [(8192, 2.0), (2048, 1.0), (512, 1.0)])
def test_a_windowed_pool_holds_more_long_sessions_and_no_fewer_short_ones(tokens, least):
    """The same bytes, Gemma 3 270M's KV shape, rows of up to 2,048 entries: at 8k more than
    twice the sessions; at 2k and 512 (within the window and a row) as many as before."""
    windows = gemma3_windows(18, 512)
    full, windowed = (KVShape(18, 1, 256, torch.bfloat16, windows=w) for w in ((), windows))
    assert full.bytes_per_token == windowed.bytes_per_token
    budget = 1 << 30
    before = sessions_that_fit(full, budget, tokens, 2048)
    after = sessions_that_fit(windowed, budget, tokens, 2048)
    assert after >= least * before and before > 0


def test_a_session_narrows_to_its_rounds_once_its_prompt_is_in():
    """An 8k prompt in rows of 2,048 needs each windowed group to hold its window and a whole
    row; once the prompt is in, rows of 40 entries need 37 blocks a group, and the rest of what
    it reserved goes back to the pool. 64 rounds later it has never grown past its reservation,
    and freed it holds nothing."""
    shape = KVShape(18, 1, 1, torch.bfloat16, windows=gemma3_windows(18, 512))
    pool = BlockPool(shape, 4096, 16, row_tokens=2048)
    kv = SessionKV(pool)
    kv.admit([], 8192 + 64 + 40, b"")          # the prompt, 64 new tokens, a last row's room
    assert pool.committed_blocks == 519 + 5 * (2560 // 16 + 2)
    for start in range(0, 8192, 2048):          # the KV's bookkeeping of a chunked prefill
        kv.slots(start, start + 2048)
        kv.commit(2048)
    kv.narrow(40)
    assert pool.committed_blocks <= 519 + 5 * pool.blocks_for_window(512, 40) == 519 + 5 * 37
    for _ in range(64):
        kv.slots(kv.length, kv.length + 40)
        kv.commit(1)
    assert all(sum(1 for b in table if b) <= 37 for table in kv.tables[1:])
    kv.free()
    assert pool.committed_blocks == 0


def run_greedy(engine, prompts, new_tokens: int, chunk: int):
    from tests.test_engine import run_greedy as run
    return run(engine, prompts, new_tokens, prefill_chunk=chunk)


@pytest.mark.parametrize("kind", ["paged", "flex"])
def test_windowed_engines_match_generate_and_drop_what_no_query_reads(models, kind):
    """Prompts of up to 90 tokens (the window is 16) prefilled in chunks of 13, then decoded
    together: generate()'s tokens, with the windowed group holding no more than its bound."""
    model = models["gemma3"]
    torch.manual_seed(3)
    prompts = [torch.randint(3, 300, (n,)).tolist() for n in (1, 7, 90, 33, 60)]
    engine = make_engine(model, kv_budget_bytes=8 << 20, block_tokens=4, kind=kind,
                         row_tokens=13)
    pool = engine.pool
    assert pool.windowed and [g.window for g in pool.groups] == [None, WINDOW]
    outputs, kvs = run_greedy(engine, prompts, 12, 13)
    for prompt, out in zip(prompts, outputs):
        assert out == greedy_reference(model, prompt, 12)
    longest = kvs[2]
    assert DROPPED in longest.tables[1] and DROPPED not in longest.tables[0]
    held = [b for b in longest.tables[1] if b != DROPPED]
    assert len(held) <= pool.group_blocks(1, 10_000) < len(longest.tables[0])
    for kv in kvs:
        kv.free()
    assert pool.outstanding == 0 and pool.held_tokens == 0
    assert pool.used_blocks == 0


def test_windowed_engines_match_generate_with_the_pool_off(models):
    """windows=False keeps every layer's tokens (one group): the same tokens."""
    model = models["gemma3"]
    prompt = torch.randint(3, 300, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = make_engine(model, kv_budget_bytes=8 << 20, block_tokens=4, kind="paged",
                         windows=False)
    assert not engine.pool.windowed and len(engine.pool.groups) == 1
    outputs, _ = run_greedy(engine, [prompt], 10, 16)
    assert outputs[0] == greedy_reference(model, prompt, 10)


def test_a_windowed_prefix_is_shared_where_its_window_is_still_held(models):
    """A second session of the same prompt finds every full block of it, the windowed group's
    last ones included, and decodes generate()'s tokens from them; its blocks freed, the pool
    holds nothing but what is published."""
    model = models["gemma3"]
    prompt = torch.randint(3, 300, (61,), generator=torch.Generator().manual_seed(7)).tolist()
    engine = make_engine(model, kv_budget_bytes=8 << 20, block_tokens=4, kind="paged",
                         row_tokens=16)
    first = engine.new_kv()
    first.admit(prompt[:-1], len(prompt) + 8, b"t")
    for start in range(0, len(prompt) - 1, 16):
        chunk = prompt[start:len(prompt) - 1][:16]
        engine.forward([_row(first, chunk, False)])
        first.commit(len(chunk))
        first.publish(prompt[:-1])
    second = engine.new_kv()
    found = second.admit(prompt[:-1], len(prompt) + 8, b"t")
    assert found == (len(prompt) - 1) // 4 * 4 == 60
    assert second.tables[0] == first.tables[0][:15]
    # the windowed group: the blocks a query at 60 reads (positions 45..59), nothing before
    assert second.tables[1] == [DROPPED] * 11 + first.tables[1][11:15]
    rest = prompt[found:-1]
    if rest:
        engine.forward([_row(second, rest, False)])
        second.commit(len(rest))
    out, last = [], prompt[-1]
    for _ in range(8):
        logits = engine.forward([_row(second, [last], True)])
        second.commit(1)
        last = int(logits[0][-1].argmax())
        out.append(last)
    assert out == greedy_reference(model, prompt, 8)
    first.free()
    second.free()
    assert engine.pool.outstanding == 0 and engine.pool.used_blocks == 0


def _row(kv, tokens, want_logits):
    from verify_server.engines.rows import Row
    return Row(kv, tokens, want_logits)


async def test_a_windowed_server_matches_generate_for_sessions_past_the_window(
        serve, models, drafter_models, tokenizer):
    """Eight sessions of 40-120 tokens through the server (a noisy drafter, rows of up to 24
    entries): generate()'s tokens, and the pool's windowed group bounded by the server's rows."""
    from drafters.hf import HFDrafter
    from edge_client.session import RoundSettings, generate
    from edge_client.wire import SessionRequest
    from tests.test_lossless import server_stub

    model = models["gemma3"]
    server = await serve(model, max_step_tokens=24, max_draft_tokens=8, kv_block_tokens=4)
    pool = server.scheduler.engine.pool
    assert pool.windowed and pool.row_tokens == 24
    torch.manual_seed(9)
    prompts = [torch.randint(3, 300, (n,)).tolist() for n in (40, 55, 70, 85, 100, 110, 120, 64)]
    results = await asyncio.gather(*(
        generate(server_stub(server),
                 HFDrafter(drafter_models["gemma3"], tokenizer, name="hf:noisy"),
                 SessionRequest(prompt, max_new_tokens=16), settings=RoundSettings(draft_len=4))
        for prompt in prompts))
    for result, prompt in zip(results, prompts):
        assert result.token_ids == greedy_reference(model, prompt, 16)


def test_the_simulator_charges_a_windowed_pool_as_the_server_keeps_it():
    """A Gemma 3 4B profile's simulated pool keeps only the windows (of the same memory), so
    more 8k sessions fit it than with --no-kv-windows; a Llama profile's has no windows."""
    from lab.sim.engine import bookkeeping_pool
    from lab.sim.server import kv_windows
    from verify_server.settings import ServerSettings
    from verify_server.step_costs import load_profile

    gemma, llama = load_profile("h200-gemma3-4b-sled-forward"), load_profile("h200-llama8b-flex-graph")
    on, off = ServerSettings(), ServerSettings(kv_windows=False)
    windows = kv_windows(gemma, on)
    assert len(windows) == 34 and windows.count(None) == 5 and set(windows) == {None, 1024}
    assert kv_windows(gemma, off) == () == kv_windows(llama, on)

    def sessions(windows):
        pool = bookkeeping_pool(100_000, 16, windows, 2048)
        count = 0
        while True:
            kv = SessionKV(pool)
            try:
                kv.admit([], 8192, b"")
            except PoolExhausted:
                return count
            kv.narrow(40)            # its prompt in: what the server gives back
            count += 1

    assert sessions(()) == 12           # 100,000 tokens of every layer's KV, 8,192 a session
    assert sessions(windows) >= 2.5 * sessions(())



def test_the_bench_counts_sessions_with_and_without_windows(capsys):
    """`sled bench kv-windows` on an H200's memory with Gemma 3 4B: at 8k more than three times
    the sessions; a model without windows is one line and exit 2."""
    from conftest import run_main

    code, out, _ = run_main(capsys, "bench", "kv-windows", "--contexts", "8192")
    row = next(line for line in out.splitlines() if "8192" in line)
    before, after = (int(cell) for cell in row.replace("│", " ").split()[1:3])
    assert code == 0 and (before, after) == (111, 418)
    code, _, err = run_main(capsys, "bench", "kv-windows", "--profile", "h200-llama8b-flex-graph")
    assert code == 2 and "no sliding-window layers" in err and len(err.strip().splitlines()) == 1
