"""The engines on the device `--device` names (default cpu; lab/gpu/check.sh runs these with
`--device cuda` on a GPU machine): each engine's greedy tokens are the target's own generate()
on that device, and the flex engine's logits (sled's decoder forward and transformers' own, with
CUDA graphs where there is CUDA, and with --flex-splits auto) are the paged engine's; a step
launched ahead of its decision keeps its own argmax. On a GPU float32 (flex's kernels take
no float64), on a CPU float64 as elsewhere in the suite."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

from lab.tiny import make_model
from verify_server.engines import PagedEngine
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server.engines.flex import FlexEngine
from verify_server.engines.rows import Row

BT = 16          # flex's Triton kernels take key tiles of 16 at least
VOCAB = 320
NEW_TOKENS = 10
# the forwards FlexEngine offers (sled's own decoder forward, transformers'), where it has the
# keyword
FORWARDS = (("sled", "transformers") if "forward" in inspect.signature(FlexEngine).parameters
            else (None,))


def dtype_on(device: torch.device) -> torch.dtype:
    return torch.float64 if device.type == "cpu" else torch.float32


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, device):
    """A tiny target of each architecture on the device."""
    return make_model(request.param, VOCAB, dtype=dtype_on(device)).to(device).eval()


# paged, and the flex engine with each forward (CUDA graphs on CUDA), and with its decode
# kernel's rows split for the GPU's multiprocessors (--flex-splits auto), where it has the keyword
SPLITS = "splits" in inspect.signature(FlexEngine).parameters
KINDS = ["paged", *(f"flex:{forward}" for forward in FORWARDS),
         *(["flex:sled:auto"] if SPLITS else [])]


def make(kind: str, model, pool: BlockPool):
    if kind == "paged":
        return PagedEngine(copy.deepcopy(model), pool)
    forward = kind.split(":")[1]
    chosen = {} if forward == "None" else {"forward": forward}
    if kind.endswith(":auto"):
        chosen["splits"] = "auto"
    return FlexEngine(copy.deepcopy(model), pool, graphs=pool.keys[0].device.type == "cuda",
                      **chosen)


def new_pool(model, device) -> BlockPool:
    return BlockPool(KVShape.of(model), 160, BT, device)


def prompts() -> list[list[int]]:
    torch.manual_seed(3)
    return [torch.randint(3, VOCAB, (n,)).tolist() for n in (1, 7, 40, 19)]


def generated(model, prompt: list[int], device) -> list[int]:
    """The oracle on the device: transformers' generate(do_sample=False), generated part only."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def prefilled(engine, prompts_: list[list[int]]):
    """A session for each prompt, all but its last token in its KV, room for NEW_TOKENS more."""
    kvs = []
    for prompt in prompts_:
        kv = engine.new_kv()
        kv.admit([], len(prompt) + NEW_TOKENS, b"")
        if len(prompt) > 1:
            engine.forward([Row(kv, prompt[:-1], False)])
            kv.commit(len(prompt) - 1)
        kvs.append(kv)
    return kvs


def greedy(engine, prompts_: list[list[int]]) -> tuple[list[list[int]], list]:
    """Prefill every prompt, then decode all rows together: (tokens, each decode step's logits)."""
    kvs = prefilled(engine, prompts_)
    outputs, steps = [[] for _ in prompts_], []
    for _ in range(NEW_TOKENS):
        last = [o[-1] if o else p[-1] for o, p in zip(outputs, prompts_)]
        logits = engine.forward([Row(kv, [t], True) for kv, t in zip(kvs, last)])
        steps.append([row[-1].detach().float().cpu() for row in logits])
        for kv, out, row_logits in zip(kvs, outputs, logits):
            kv.commit(1)
            out.append(int(row_logits[-1].argmax()))
    for kv in kvs:
        kv.free()
    return outputs, steps


def test_every_engine_gives_generates_tokens_on_the_device(model, device):
    want = [generated(model, prompt, device) for prompt in prompts()]
    for kind in KINDS:
        got, _ = greedy(make(kind, model, new_pool(model, device)), prompts())
        assert got == want, kind


def test_the_flex_forwards_logits_are_the_paged_engines_on_the_device(model, device):
    _, reference = greedy(make("paged", model, new_pool(model, device)), prompts())
    tolerance = 1e-6 if device.type == "cpu" else 2e-4
    for kind in KINDS[1:]:
        _, steps = greedy(make(kind, model, new_pool(model, device)), prompts())
        for mine, theirs in zip(steps, reference):
            for a, b in zip(mine, theirs):
                assert float((a - b).abs().max()) <= tolerance, kind


def test_a_launched_steps_argmax_survives_the_next_launch_on_the_device(model, device):
    """The overlapping scheduler's order: step t launched, then step t+1 of the same bucket
    (on CUDA its graph replay rewrites step t's buffers), then both decided: each gives the
    argmax the same step gives alone."""
    engine = make(KINDS[1], model, new_pool(model, device))
    kvs = prefilled(engine, prompts())
    first = [Row(kv, [p[-1]], True) for kv, p in zip(kvs[:2], prompts()[:2])]
    second = [Row(kv, [p[-1]], True) for kv, p in zip(kvs[2:], prompts()[2:])]
    alone = [engine.forward(rows).targets() for rows in (first, second)]
    launched = [engine.launch(rows, send_argmax=True) for rows in (first, second)]
    assert [logits.targets() for logits in launched] == alone
