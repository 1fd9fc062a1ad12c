"""The attention rules have one home (verify_server.engines.visibility): both engines that build
their own attention follow it, so dropping a rule there breaks both against generate()."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import greedy_reference
from tests.test_engine import run_greedy
from verify_server.engines import visibility
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server.engines.flex import FlexEngine
from verify_server.engines.kv import SessionKV
from verify_server.engines.paged import PagedEngine
from verify_server.engines.rows import Row

ATTENDS = visibility.attends


def no_context(new, width, seen, context_position, entry_position, query_position, window):
    return ATTENDS(new, width, seen, context_position, entry_position, query_position,
                   window) & (new >= 0)


def no_causality(new, width, seen, context_position, entry_position, query_position, window):
    return ATTENDS(new, width, seen | True, context_position, entry_position, query_position,
                   window)


def no_window(new, width, seen, context_position, entry_position, query_position, window):
    return ATTENDS(new, width, seen, context_position, entry_position, query_position, None)


def engine_of(kind: str, model):
    pool = BlockPool(KVShape.of(model), 160, 8)
    made = {"paged": PagedEngine, "flex": FlexEngine}[kind]   # flex: eager on a CPU
    return made(copy.deepcopy(model).float(), pool)


def outputs_of(kind: str, model, prompts):
    outputs, kvs = run_greedy(engine_of(kind, model), prompts, 6, prefill_chunk=11)
    for kv in kvs:
        kv.free()
    return outputs


@pytest.mark.parametrize("kind", ["paged", "flex"])
@pytest.mark.parametrize("arch, rule", [("llama", no_context), ("llama", no_causality),
                                        ("gemma3", no_window)], ids=["context", "causal", "window"])
def test_dropping_a_rule_breaks_each_engine_against_generate(models, monkeypatch, kind, arch,
                                                             rule):
    """Prompts longer than gemma3's 16-token window, prefilled in chunks of several entries."""
    model = copy.deepcopy(models[arch]).float()     # .float() alone would convert the shared one
    torch.manual_seed(5)
    prompts = [torch.randint(3, 300, (n,)).tolist() for n in (30, 9, 41)]
    want = [greedy_reference(model, prompt, 6) for prompt in prompts]
    assert outputs_of(kind, model, prompts) == want
    monkeypatch.setattr(visibility, "attends", rule)
    assert outputs_of(kind, model, prompts) != want


def test_a_tree_and_sat_blocks_see_what_their_rules_say():
    """The tree and SAT rules, stated for one row each."""
    kv = SessionKV(BlockPool(KVShape(1, 1, 4, torch.float32), 4, 8))
    tree = Row(kv, [1, 2, 3, 4, 5], True, parents=(0, 1, 0, 3))   # root -> a -> b, root -> c -> d
    seen = visibility.seen(tree)
    assert seen[2].tolist() == [True, True, True, False, False]    # b: root, a, itself
    assert seen[4].tolist() == [True, False, False, True, True]    # d: root, c, itself
    assert visibility.positions(tree, 10).tolist() == [10, 11, 12, 11, 12]
    sat = Row(kv, [1, 2, 3], True, sat_slots=2, sat_anchors=(1, 3))
    seen = visibility.seen(sat)
    assert seen[3].tolist() == [True, False, False, True, False, False, False]  # block 1: after t
    assert seen[6].tolist() == [True, True, True, False, False, True, True]
    assert visibility.positions(sat, 0).tolist() == [0, 1, 2, 1, 2, 3, 4]
    qpos, planned = visibility.plan([tree, sat], np.array([10, 0]), np.array([5, 7]), 8)
    assert np.array_equal(planned[0, :5, :5], visibility.seen(tree))
    assert not planned[0, 5:].any() and qpos[1, :7].tolist() == [0, 1, 2, 1, 2, 3, 4]
