"""Token trees: several candidates per draft position, verified in one pass with a tree mask.

The greedy oracle holds with tree drafts from every drafter that branches, under concurrency; a
tree whose right branch is not its first moves that branch's KV into place; malformed trees,
sampled trees and trees on a chains-only engine are each refused with INVALID_ARGUMENT or
FAILED_PRECONDITION while another session on the server goes on. Acceptance, greedy and sampled,
walks a tree from its root down its edges only: a node that is no child of the last accepted one
is never taken, whatever token it holds."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import greedy_reference
from drafters.base import KVDrafter, Proposal, unsure_alternatives
from drafters.cacheback import CachebackDrafter
from drafters.capabilities import Capabilities, passed_on
from drafters.hf import HFDrafter
from edge_client.session import RoundSettings, generate
from edge_client.wire import SessionRequest
from sled.v1 import verifier_pb2 as pb
from sled.wire.sampling import Sampling
from sled.wire.tree import Trie, children, cut, depths, tree_problem
from tests.test_bad_input import TARGET_FP, open_msg
from tests.test_lossless import server_stub
from verify_server.acceptance import verify_greedy, verify_greedy_tree, verify_sampling_tree
from verify_server.engines import make_engine
from verify_server.engines.rows import Row

GREEDY = Sampling()


def path_to(parents, node: int) -> list[int]:
    """The nodes from the root's child down to `node` (node i = token i - 1)."""
    path = []
    while node:
        path.append(node)
        node = parents[node - 1]
    return path[::-1]
MAX_NEW = 24
Reason = pb.ErrorDetail.Reason


# --- the tree itself --------------------------------------------------------------------------

def test_depths_children_and_paths_of_a_small_tree():
    parents = [0, 1, 0, 3, 3]           # root -> a -> b; root -> c -> d, c -> e
    assert depths(parents) == [1, 2, 1, 2, 2]
    assert children(parents) == [[1, 3], [2], [], [4, 5], [], []]
    assert path_to(parents, 5) == [3, 5]


@pytest.mark.parametrize("parents,tokens,fault", [
    ([0, 2], 2, "its own parent"),
    ([0, 3, 0], 3, "points at a later token"),
    ([0, 1], 3, "2 parents for 3 draft tokens"),
])
def test_malformed_trees_are_named(parents, tokens, fault):
    assert fault in tree_problem(parents, tokens)


def test_well_formed_trees_pass():
    assert tree_problem([0, 0, 1, 2, 2], 5) is None


def test_cut_drops_deep_tokens_and_keeps_a_valid_prefix():
    tokens, parents = [10, 11, 12, 20, 21], [0, 1, 2, 0, 4]
    assert cut(tokens, parents, max_depth=2, max_nodes=10) == ([10, 11, 20, 21], [0, 1, 0, 3])
    assert cut(tokens, parents, max_depth=2, max_nodes=3) == ([10, 11, 20], [0, 1, 0])
    assert cut(tokens, parents, max_depth=0, max_nodes=10) == ([], [])


def test_a_trie_merges_chains_that_share_a_start():
    trie = Trie()
    trie.add([5, 6, 7])
    trie.add([5, 8])
    assert trie.add([9]) == 5
    assert trie.add([5, 6]) == 2        # already there: nothing added
    assert trie.tokens == [5, 6, 7, 8, 9] and trie.parents == [0, 1, 2, 1, 0]


def one_hot_logits(argmax: list[int], vocab: int = 16) -> torch.Tensor:
    logits = torch.zeros(len(argmax), vocab)
    logits[range(len(argmax)), argmax] = 1.0
    return logits


def test_greedy_tree_takes_the_branch_the_target_agrees_with():
    # root -> 5 -> 9; root -> 7 -> 4. Target: 7 after root, (after 5: 1), (after 9: 1), 4 after 7, 2 after 4
    outcome = verify_greedy_tree(one_hot_logits([7, 1, 1, 4, 2]), [5, 9, 7, 4], [0, 1, 0, 3])
    assert (outcome.accepted, outcome.emitted, outcome.path) == (2, [7, 4, 2], (3, 4))


def test_greedy_tree_with_a_chain_decides_as_a_chain_does():
    logits = one_hot_logits([5, 9, 3, 2])
    chain = verify_greedy(logits, [5, 9, 4])
    tree = verify_greedy_tree(logits, [5, 9, 4], [0, 1, 2])
    assert (tree.accepted, tree.emitted, tree.path) == (chain.accepted, chain.emitted, (1, 2))


# Acceptance walks a tree from the root down its edges only. Small vocabularies make the target's
# token often sit on a node that is no child of where the walk stands (a sibling, a cousin, a
# grandchild): that node is never taken.
PROPERTY = settings(max_examples=300, deadline=None, derandomize=True, database=None)
VOCAB_SMALL = 4


@st.composite
def token_trees(draw) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a tree of 1-8 nodes over VOCAB_SMALL ids, siblings may repeat."""
    n = draw(st.integers(1, 8))
    parents = [draw(st.integers(0, i)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, VOCAB_SMALL - 1), min_size=n, max_size=n))
    return tokens, parents


def assert_a_walk_of_children(outcome, tokens: list[int], parents: list[int]) -> None:
    """The accepted path goes root -> child -> child ..., and the emitted tokens spell it, then
    the target's one."""
    kids = children(parents)
    for above, node in zip((0, *outcome.path), outcome.path):
        assert node in kids[above], (outcome.path, parents)
    assert outcome.accepted == len(outcome.path) and len(outcome.emitted) == outcome.accepted + 1
    assert outcome.emitted[:-1] == [tokens[node - 1] for node in outcome.path]


@PROPERTY
@given(tree=token_trees(), data=st.data())
def test_a_greedy_tree_accepts_the_longest_walk_of_children_the_target_agrees_with(tree, data):
    tokens, parents = tree
    targets = data.draw(st.lists(st.integers(0, VOCAB_SMALL - 1), min_size=len(tokens) + 1,
                                 max_size=len(tokens) + 1))     # argmax p after the root, each node
    outcome = verify_greedy_tree(one_hot_logits(targets, VOCAB_SMALL), tokens, parents)
    assert_a_walk_of_children(outcome, tokens, parents)
    last = outcome.path[-1] if outcome.path else 0
    for above, node in zip((0, *outcome.path), outcome.path):
        assert tokens[node - 1] == targets[above]               # each step is the target's token
    assert all(tokens[c - 1] != targets[last] for c in children(parents)[last])   # the longest
    assert outcome.emitted[-1] == targets[last]


@PROPERTY
@given(tree=token_trees(), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_a_sampled_tree_accepts_a_walk_of_children_the_target_gives_mass_to(tree, data, seed):
    tokens, parents = tree
    weights = data.draw(st.lists(st.lists(st.integers(0, 3), min_size=VOCAB_SMALL,
                                          max_size=VOCAB_SMALL).filter(any),
                                 min_size=len(tokens) + 1, max_size=len(tokens) + 1))
    p = torch.tensor(weights, dtype=torch.float64)
    p = p / p.sum(dim=-1, keepdim=True)                         # [len(tokens) + 1, vocab]
    outcome = verify_sampling_tree(p, tokens, parents, torch.Generator().manual_seed(seed))
    assert_a_walk_of_children(outcome, tokens, parents)
    for above, node in zip((0, *outcome.path), outcome.path):
        assert p[above, tokens[node - 1]] > 0
    assert p[outcome.path[-1] if outcome.path else 0, outcome.emitted[-1]] > 0


@pytest.mark.parametrize("after_root, after_first", [(7, 9), (9, 7)])
def test_a_node_that_is_no_child_is_never_taken_though_it_holds_the_targets_token(after_root,
                                                                                  after_first):
    """root -> 7, root -> 5 -> 9. The target wants 7 then 9 (9 sits under 5, not under 7), or
    9 at once (a grandchild): the walk stops where the children end, greedy and sampled."""
    tokens, parents = [7, 5, 9], [0, 0, 2]
    targets = [after_root, after_first, 0, 0]                  # after the root, 7, 5, 9
    want_path = (1,) if after_root == 7 else ()
    want = [7, 9] if after_root == 7 else [9]
    greedy = verify_greedy_tree(one_hot_logits(targets), tokens, parents)
    assert (greedy.path, greedy.emitted) == (want_path, want)
    p = one_hot_logits(targets).double()                       # every target token certain
    for seed in range(20):
        sampled = verify_sampling_tree(p, tokens, parents, torch.Generator().manual_seed(seed))
        assert (sampled.path, sampled.emitted) == (want_path, want)


# --- the engine -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", ["paged", "flex"])
def test_each_tree_token_sees_only_its_ancestors(models, arch, kind):
    """A tree row's logits at every token equal those of the chain from the root to it; gemma3's
    sliding window (16) is applied by position, with a context longer than it."""
    model = models[arch]
    torch.manual_seed(5)
    context = torch.randint(3, 300, (40,)).tolist()
    tokens, parents = [11, 12, 13, 21, 22, 31], [0, 1, 2, 0, 4, 1]
    engine = make_engine(model, kv_budget_bytes=4 << 20, block_tokens=8, kind=kind)

    def prefilled():
        kv = engine.new_kv()
        kv.admit(context[:-1], 80, b"")
        engine.forward([Row(kv, context[:-1], False)])
        kv.commit(len(context) - 1)
        return kv

    tree_logits = engine.forward([Row(prefilled(), [context[-1], *tokens], True,
                                      parents=tuple(parents))])[0]
    for node in range(1, len(tokens) + 1):
        path = [tokens[n - 1] for n in path_to(parents, node)]
        chain_logits = engine.forward([Row(prefilled(), [context[-1], *path], True)])[0]
        torch.testing.assert_close(tree_logits[node], chain_logits[-1])
    torch.testing.assert_close(tree_logits[0], chain_logits[0])


@pytest.mark.parametrize("kind", ["paged", "flex"])
def test_the_accepted_branch_moves_into_place_and_decoding_goes_on_exactly(models, kind):
    """The target's own tokens sit in the second branch: after the verify, the session's KV
    holds the root and that branch in order, so the next tokens are generate()'s."""
    model = models["llama"]
    prompt = [3, 17, 42, 9, 77]
    reference = greedy_reference(model, prompt, 6)
    engine = make_engine(model, kv_budget_bytes=4 << 20, block_tokens=4, kind=kind)
    kv = engine.new_kv()
    kv.admit(prompt[:-1], 20, b"")
    engine.forward([Row(kv, prompt[:-1], False)])
    kv.commit(len(prompt) - 1)
    wrong = [(reference[0] + 1) % 300 + 3, 8]
    draft = [*wrong, *reference[:3]]
    parents = [0, 1, 0, 3, 4]
    logits = engine.forward([Row(kv, [prompt[-1], *draft], True, parents=tuple(parents))])[0]
    outcome = verify_greedy_tree(logits, draft, parents)
    assert outcome.path == (3, 4, 5) and outcome.emitted == reference[:4]
    kv.keep_path(outcome.path)
    kv.commit(1 + outcome.accepted)
    logits = engine.forward([Row(kv, [reference[3], reference[4]], True)])[0]
    assert logits.argmax(-1).tolist() == reference[4:6]


# --- drafters that branch -----------------------------------------------------------------------

def test_cacheback_branches_on_each_recent_follower_and_merges_shared_starts():
    drafter = CachebackDrafter(leader=1, follower=2)
    drafter.observe([5, 6, 7, 1, 5, 8, 9, 2, 5, 6, 4])
    proposal = drafter.propose([3, 5], 3, GREEDY, tree=3)
    # followers of (5,), most recent first: (6, 4), (8, 9), (6, 7) -> 6 4 ..., 8 9 ..., 6 7 ...
    trie_paths = {tuple(proposal.token_ids[n - 1] for n in path_to(proposal.parents, leaf))
                  for leaf in range(1, len(proposal.token_ids) + 1)
                  if leaf not in proposal.parents}
    assert {p[:2] for p in trie_paths} == {(6, 4), (8, 9), (6, 7)}
    assert proposal.token_ids.count(6) == 1            # the shared start is one node
    assert drafter.propose([3, 5], 3, GREEDY, tree=1).parents is None


def test_cacheback_tree_of_one_follower_is_sent_as_a_chain():
    drafter = CachebackDrafter(leader=1, follower=2)
    drafter.observe([5, 6, 7, 1])
    proposal = drafter.propose([3, 5], 2, GREEDY, tree=2)
    assert proposal.token_ids == [6, 7] and proposal.parents is None


def test_a_model_drafter_adds_siblings_only_where_it_is_unsure():
    sure = np.array([10.0, 0.0, 0.0, 0.0])
    unsure = np.array([1.0, 0.9, 0.8, 0.0])
    assert unsure_alternatives(sure, 1) == []
    assert unsure_alternatives(unsure, 2) == [1, 2]

    class Scripted(KVDrafter):
        def __init__(self, steps):
            super().__init__()
            self.steps = iter(steps)

        def _run(self, tokens):
            return next(self.steps)

        def _truncate(self, length):
            return length

    proposal = Scripted([sure, unsure, sure]).propose([1, 2], 3, GREEDY, tree=2)
    # chain 0 0 0; the second position is unsure: its runner-up 1 joins beside it (parent node 1)
    assert proposal.token_ids == [0, 0, 0, 1] and proposal.parents == [0, 1, 2, 1]
    assert Scripted([sure, unsure, sure]).propose([1, 2], 3, Sampling(temperature=1.0, seed=1),
                                                  tree=2).parents is None


# --- the greedy oracle with trees, over gRPC -----------------------------------------------------

class Recording:
    """A drafter wrapper that counts the tree drafts it proposed."""

    def __init__(self, inner):
        self.inner, self.trees = inner, 0
        self.name, self.tokenizer_fingerprint = inner.name, inner.tokenizer_fingerprint
        self.capabilities = passed_on(inner, Capabilities(trees=True, observes=True))

    def observe(self, context):
        self.inner.observe(context)

    def propose(self, context, draft_len, sampling, generator=None, **options):
        proposal = self.inner.propose(context, draft_len, sampling, generator, **options)
        self.trees += proposal.parents is not None
        return proposal

    def rollback(self, length):
        self.inner.rollback(length)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", ["hf", "cacheback"])
@pytest.mark.parametrize("k", [1, 3, 6])
async def test_tree_drafts_match_generate_under_concurrency(serve, models, drafter_models, tokenizer,
                                                            prompts, arch, kind, k):
    server = await serve(models[arch])
    shared = Recording(CachebackDrafter(leader=1, follower=2))

    def drafter():
        if kind == "cacheback":
            return shared
        return Recording(HFDrafter(drafter_models[arch], tokenizer, name="hf:noisy"))

    drafters = [drafter() for _ in prompts]
    results = await asyncio.gather(*(
        generate(server_stub(server), d, SessionRequest(prompt, max_new_tokens=MAX_NEW),
                 settings=RoundSettings(draft_len=k, tree=3))
        for d, prompt in zip(drafters, prompts)))
    for result, prompt in zip(results, prompts):
        assert result.token_ids == greedy_reference(models[arch], prompt, MAX_NEW)
    assert sum(d.trees for d in {id(d): d for d in drafters}.values()) > 0   # trees were sent


class Oracle:
    """Drafts a tree whose first branch is wrong and whose second is the target's own text."""
    name, tokenizer_fingerprint, capabilities = "oracle-tree", None, Capabilities(trees=True)

    def __init__(self, prompt, reference):
        self.full = list(prompt) + list(reference)

    def propose(self, context, draft_len, sampling, generator=None, tree=1):
        right = self.full[len(context):len(context) + draft_len] or [0]
        wrong = [(right[0] + 1) % 250 + 3]
        return Proposal(wrong + right, parents=[0] + [0] + list(range(2, len(right) + 1)))

    def rollback(self, length):
        pass


async def test_the_second_branch_is_accepted_whole_every_round(serve, models, prompts):
    model = models["gemma3"]
    server = await serve(model)
    prompt = prompts[0]
    reference = greedy_reference(model, prompt, MAX_NEW)
    result = await generate(server_stub(server), Oracle(prompt, reference),
                            SessionRequest(prompt, max_new_tokens=MAX_NEW),
                            settings=RoundSettings(draft_len=4, tree=2))
    assert result.token_ids == reference
    # each round takes its whole 4-token second branch and a bonus, until the length limit cuts
    assert [s.accepted for s in result.round_stats][:4] == [4] * 4


# --- refusals ------------------------------------------------------------------------------------

def tree_draft(round: int, tokens, parents, lookahead: int = 0) -> pb.DeviceMessage:
    return pb.DeviceMessage(draft=pb.Draft(round=round, token_ids=list(tokens), parents=list(parents),
                                           lookahead=lookahead))


async def refusal(server, messages) -> tuple[grpc.StatusCode, pb.ErrorDetail, str]:
    stub = server_stub(server)
    call = stub.Generate(iter(messages))
    detail = None
    try:
        async for reply in call:
            if reply.HasField("error"):
                detail = reply.error
    except grpc.aio.AioRpcError as error:
        return error.code(), detail, error.details()
    raise AssertionError("the stream was not refused")


@pytest.mark.parametrize("tokens,parents,fault", [
    ([5, 6], [0, 2], "its own parent"),
    ([5, 6, 7], [0, 3, 0], "points at a later token"),
    ([5, 6, 7], [0, 1], "2 parents for 3 draft tokens"),
])
async def test_malformed_trees_are_invalid_argument_and_others_go_on(serve, models, prompts,
                                                                     tokens, parents, fault):
    model = models["llama"]
    server = await serve(model)
    other = asyncio.create_task(generate(server_stub(server), CachebackDrafter(),
                                         SessionRequest(prompts[1], max_new_tokens=MAX_NEW),
                                         settings=RoundSettings(tree=2)))
    code, detail, message = await refusal(server, [open_msg(prompts[0]),
                                                   tree_draft(0, tokens, parents)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and detail.reason == Reason.REASON_BAD_TREE
    assert fault in message and "bad tree draft" in message
    assert (await other).token_ids == greedy_reference(model, prompts[1], MAX_NEW)


async def test_too_many_tree_tokens_is_draft_too_long(serve, models, prompts):
    server = await serve(models["llama"], max_draft_tokens=4)
    code, detail, _ = await refusal(server, [open_msg(prompts[0]),
                                             tree_draft(0, [5] * 5, [0, 0, 0, 0, 0])])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and detail.reason == Reason.REASON_DRAFT_TOO_LONG


async def test_a_sampled_tree_with_q_is_refused(serve, models, prompts):
    """A tree's candidates are verified as deterministic ones: a q with them is refused."""
    server = await serve(models["llama"])
    draft = tree_draft(0, [5, 6], [0, 0])
    draft.draft.q.extend([pb.SparseDistribution(ids=[5], probs=[1.0]),
                          pb.SparseDistribution(ids=[6], probs=[1.0])])
    code, detail, message = await refusal(server, [open_msg(prompts[0], temperature=0.8), draft])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and detail.reason == Reason.REASON_BAD_TREE
    assert "sampled tree draft with q" in message and "without q" in message


def test_recursive_rejection_sampling_emits_each_token_with_its_target_probability():
    """At the root: candidates 1 and 2 (siblings), 2 has a child 3. Over many draws the first
    token follows p at the root exactly, and a chain decides as verify_sampling does."""
    from verify_server.acceptance import verify_sampling, verify_sampling_tree

    p = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.25] * 4, [0.5, 0.1, 0.1, 0.3], [0.25] * 4])
    generator = torch.Generator().manual_seed(0)
    firsts = [verify_sampling_tree(p, [1, 2, 3], [0, 0, 2], generator).emitted[0]
              for _ in range(20000)]
    frequencies = torch.bincount(torch.tensor(firsts), minlength=4).double() / len(firsts)
    torch.testing.assert_close(frequencies, p[0].double(), atol=0.01, rtol=0)
    chain_p = p[[0, 2, 3]]
    for seed in range(50):
        tree = verify_sampling_tree(chain_p, [2, 3], [0, 1], torch.Generator().manual_seed(seed))
        chain = verify_sampling(chain_p, [2, 3], None, torch.Generator().manual_seed(seed))
        assert (tree.accepted, tree.emitted) == (chain.accepted, chain.emitted)


class SiblingsAlways:
    """A deterministic tree drafter for sampling sessions: the noisy model's greedy chain with its
    runner-ups beside every token (the tiny model is never sure)."""
    name, tokenizer_fingerprint, capabilities = "siblings", None, Capabilities(trees=True)

    def __init__(self, drafter):
        self.drafter = drafter

    def propose(self, context, k, sampling, generator=None, tree=1):
        return self.drafter.propose(context, k, Sampling(), None, tree=tree)

    def rollback(self, length):
        self.drafter.rollback(length)


async def test_sampled_trees_converge_to_the_target_distribution(serve, models, drafter_models,
                                                                 tokenizer, prompts):
    import math

    from test_sampling_e2e import COUNTS, SAMPLING, exact_distributions, total_variation

    model = models["llama"]
    prompt = prompts[0]
    p1, p2 = exact_distributions(model, prompt, SAMPLING)
    server = await serve(model, max_batch_sessions=64)
    gate = asyncio.Semaphore(64)

    async def one(seed: int):
        async with gate:
            drafter = SiblingsAlways(HFDrafter(drafter_models["llama"], tokenizer))
            result = await generate(server_stub(server), drafter,
                                    SessionRequest(prompt, max_new_tokens=2, ignore_eos=True,
                                                   sampling=Sampling(SAMPLING.temperature,
                                                                     SAMPLING.top_k, seed=seed)),
                                    settings=RoundSettings(draft_len=2, tree=3))
            return result.token_ids

    pairs = await asyncio.gather(*(one(seed) for seed in range(COUNTS[-1])))
    accepted = server.metrics.value("sled_accepted_tokens_total")
    assert 0 < accepted < server.metrics.value("sled_draft_tokens_total")
    for position, p in ((0, p1), (1, p2)):
        distances = [total_variation([pair[position] for pair in pairs[:n]], p) for n in COUNTS]
        bound = 0.8 * math.sqrt(int((p > 1e-4).sum()) / COUNTS[-1])
        assert distances[-1] < bound and distances[-1] < distances[0], (position, distances, bound)


async def test_a_chains_only_engine_says_so(serve, models, prompts):
    server = await serve(models["llama"], engine="padded")
    info = await server_stub(server).GetModelInfo(pb.GetModelInfoRequest())
    assert not info.limits.tree_drafts
    code, detail, message = await refusal(server, [open_msg(prompts[0]), tree_draft(0, [5, 6], [0, 0])])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and detail.reason == Reason.REASON_BAD_TREE
    assert "chains only" in message


async def test_the_paged_server_says_it_takes_trees(serve, models):
    server = await serve(models["llama"])
    info = await server_stub(server).GetModelInfo(pb.GetModelInfoRequest())
    assert info.limits.tree_drafts and TARGET_FP == info.tokenizer_fingerprint


# --- what the device keeps within the server's rules ---------------------------------------------

async def test_a_wide_tree_is_cut_to_the_servers_draft_limit(serve, models, prompts):
    """Cacheback at k = 8 and 4 candidates per position could draft 32 tokens; a server that
    verifies at most 8 gets trees of at most 8, and the output is still generate()'s."""
    model = models["llama"]
    server = await serve(model, max_draft_tokens=8)
    shared = Recording(CachebackDrafter(leader=1, follower=1))
    for prompt in prompts[:4]:
        result = await generate(server_stub(server), shared,
                                SessionRequest(prompt, max_new_tokens=MAX_NEW),
                                settings=RoundSettings(draft_len=8, tree=4, max_draft_tokens=8))
        assert result.token_ids == greedy_reference(model, prompt, MAX_NEW)
        assert max(s.verified for s in result.round_stats) <= 8
    assert shared.trees > 0


async def test_a_branched_draft_asks_for_no_sat_hints(serve, models, tokenizer, prompts):
    """Hints follow chains only: with lookahead on a SAT target, a tree round sends lookahead 0
    (the server would refuse a tree with lookahead) and the output is still the target's."""
    from test_sdsat_serving import adapter_spec

    model = models["llama"]
    server = await serve(model, sat=adapter_spec(model))
    shared = Recording(CachebackDrafter(leader=1, follower=1))
    for prompt in prompts[:3]:
        result = await generate(server_stub(server), shared,
                                SessionRequest(prompt, max_new_tokens=MAX_NEW),
                                settings=RoundSettings(draft_len=3, tree=2, lookahead=2,
                                                       hints="always"))
        assert result.token_ids == greedy_reference(model, prompt, MAX_NEW)
    assert shared.trees > 0
