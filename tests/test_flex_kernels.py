"""How flex's kernels walk a group (verify_server.engines.flex_kernels): torch's split count and
full blocks where rows fill the GPU, or "auto"'s splits cut from each row's own blocks; either
choice gives the paged engine's logits (the split count is passed to flex on a CPU too, where
it orders nothing, so the full-block choice each makes is what is checked here)."""
from __future__ import annotations

import pytest

from tests.test_flex_engine import (assert_logits_agree, f32, fragmented_sessions, pools_for,
                                    step_rows)
from verify_server.engines import flex as flex_module
from verify_server.engines import make_engine
from verify_server.engines.flex_kernels import MAX_SPLITS, PROGRAMS_PER_SM, group_kernel

H200_SMS = 132


def test_off_cuda_flex_keeps_its_defaults_and_full_blocks():
    kernel = group_kernel(0, 16, 8, 16, short=True, splits="auto")
    assert kernel == group_kernel(0, 16, 8, 16, short=True, splits="torch")
    assert kernel.options is None and kernel.full_blocks


@pytest.mark.parametrize("rows,torch_full", [(1, False), (16, False), (64, True), (128, True)])
def test_torch_splits_keep_full_blocks_where_rows_fill_the_gpu(rows, torch_full):
    kernel = group_kernel(H200_SMS, rows, 8, 16, short=True, splits="torch")
    assert kernel.full_blocks is torch_full
    assert kernel.options == {"BLOCK_N": 16}          # the split count: torch's own


@pytest.mark.parametrize("rows,split", [(1, MAX_SPLITS), (16, 5), (64, 2), (66, 1), (128, 1)])
def test_auto_splits_give_every_multiprocessor_four_programs(rows, split):
    kernel = group_kernel(H200_SMS, rows, 8, 16, short=True, splits="auto")
    assert kernel.options == {"BLOCK_N": 16, "SPLIT_KV": split}
    # a split row reads its own blocks (full blocks would put them all in one split)
    assert kernel.full_blocks is (split == 1)
    if split < MAX_SPLITS:
        assert rows * 8 * split >= PROGRAMS_PER_SM * H200_SMS


def test_a_long_group_runs_flex_main_kernel_whatever_the_splits():
    auto = group_kernel(H200_SMS, 2, 8, 128, short=False, splits="auto")
    assert auto == group_kernel(H200_SMS, 2, 8, 128, short=False, splits="torch")
    assert auto.options == {"BLOCK_N": 64} and not auto.full_blocks


def test_unknown_splits_are_refused(models):
    with pytest.raises(ValueError, match="unknown flex splits 'many': use torch or auto"):
        group_kernel(H200_SMS, 1, 8, 16, short=True, splits="many")
    with pytest.raises(ValueError, match="unknown flex splits"):
        make_engine(models["llama"], kv_budget_bytes=1 << 20, kind="flex", flex_splits="many")


SMALL_GPU_SMS = 4      # the tiny targets' few rows x KV heads fill it: both branches of each choice


@pytest.mark.parametrize("splits,full,split", [("torch", True, None), ("auto", False, 2)])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_each_split_choice_gives_the_paged_engines_logits(models, prompts, monkeypatch, arch,
                                                          splits, full, split):
    """Groups built as on a GPU of 4 multiprocessors (the kernel options passed to flex, full
    blocks chosen as there) over a fragmented pool: every row kind gives the paged engine's
    logits, with full blocks (torch's choice) and with the rows split instead (auto's)."""
    monkeypatch.setattr(flex_module, "group_kernel",
                        lambda sms, *args, **kwargs: group_kernel(SMALL_GPU_SMS, *args, **kwargs))
    model = f32(models[arch])
    pool, paged, flex = pools_for(model)
    flex.splits = splits
    kvs = fragmented_sessions(paged, [37, 20, 45, 18], (prompts[0] * 4)[:33])
    rows = step_rows(kvs)
    assert_logits_agree(flex.forward(rows), paged.forward(rows))
    (step,) = flex.steps.values()
    short = next(group for group in step.groups if not group.long)
    assert short.full is full and short.kernel.options.get("SPLIT_KV") == split
