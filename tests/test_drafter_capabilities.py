"""Drafter capabilities: declared once on a drafter's class (drafters.capabilities), matching what
its methods take and do; wrappers report their inner drafter's by one rule (passed_on); callers
act on the declaration, never on which methods a drafter happens to have."""
from __future__ import annotations

import ast
import importlib
import inspect
import math
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from drafters import bind_target_tokenizer
from drafters.base import KVDrafter, Proposal
from drafters.cacheback import CachebackDrafter
from drafters.capabilities import NONE, Capabilities, capabilities_of, passed_on
from drafters.cross_tokenizer import CrossTokenizerDrafter
from drafters.hf import HFDrafter
from drafters.hier import HierDrafter
from drafters.ngram import NgramDrafter
from drafters.wrapper import Wrapper
from edge_client.drafting import SharedDrafter
from edge_client.emulation import PacedDrafter
from edge_client.proposer import Proposer
from sled.wire.sampling import Sampling
from sled.wire.tree import tree_problem

ROOT = Path(__file__).resolve().parents[1]
GREEDY = Sampling()
VOCAB = 16
EVERY = Capabilities(**{f.name: True for f in fields(Capabilities)})


class Unsure(KVDrafter):
    """Drafts token (position % VOCAB) with confidence 0.3: unsure everywhere, so it branches."""

    name, tokenizer_fingerprint = "unsure", None

    def _logits(self, position: int) -> np.ndarray:
        logits = np.full(VOCAB, math.log(0.7 / (VOCAB - 1)), dtype=np.float32)
        logits[position % VOCAB] = math.log(0.3)
        return logits

    def _run(self, tokens: list[int]) -> np.ndarray:
        return self._logits(len(self._seen) + len(tokens))

    def _truncate(self, length: int) -> int:
        return length


class Checking(Unsure):
    """Unsure, and checks guesses in one evaluation (as the hf: and gguf: drafters do)."""

    capabilities = KVDrafter.capabilities | Capabilities(checks_guesses=True)

    def _run_tail(self, tokens: list[int], rows: int) -> np.ndarray:
        end = len(self._seen) + len(tokens)
        return np.stack([self._logits(position) for position in range(end - rows + 1, end + 1)])


class Board:
    core_speed = 1.0

    def draft_seconds(self, draft_len: int) -> float:
        return 0.0


class Everything:
    """Has every optional method, and declares what it is built with: what runs is recorded."""

    name, tokenizer_fingerprint = "everything", None

    def __init__(self, capabilities: Capabilities = NONE) -> None:
        self.capabilities = capabilities
        self.calls: list[str] = []

    def propose(self, context, draft_len, sampling, generator=None, **options):
        self.calls.append("propose " + " ".join(sorted(options)))
        return Proposal([1] * draft_len)

    async def apropose(self, context, draft_len, sampling, generator=None, **options):
        self.calls.append("apropose " + " ".join(sorted(options)))
        return Proposal([2] * draft_len)

    def rollback(self, length):
        pass

    def observe(self, context):
        self.calls.append("observe")

    def greedy_after(self, context, tokens):
        self.calls.append("greedy_after")
        return [0] * (len(tokens) + 1)

    def bind_target_tokenizer(self, tokenizer):
        self.calls.append("bind_target_tokenizer")


def learnt(drafter) -> None:
    """Two followers of the leader (5, 6) in the table: a tree branches there."""
    drafter.observe([5, 6, 7, 1, 5, 6, 8, 2, 5, 6])


# --- a drafter's declaration is what it does --------------------------------------------------------

def interface(cls) -> Capabilities:
    """What a drafter class's methods take and have, read off the class."""
    taken = inspect.signature(cls.propose).parameters
    return Capabilities(
        confidence="min_confidence" in taken and "with_confidence" in taken,
        trees="tree" in taken,
        observes=callable(getattr(cls, "observe", None)),
        checks_guesses=callable(getattr(cls, "greedy_after", None))
        and getattr(cls, "_run_tail", None) is not KVDrafter._run_tail,
        target_tokenizer=callable(getattr(cls, "bind_target_tokenizer", None)),
        awaitable=inspect.iscoroutinefunction(getattr(cls, "apropose", None)))


def model_drafter_classes() -> list:
    classes = [HFDrafter]
    for module, name in (("drafters.gguf", "GGUFDrafter"), ("drafters.onnx", "ONNXDrafter")):
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except ImportError:     # the runtime's extra is not installed here
            pass
    return classes


@pytest.mark.parametrize("cls", [NgramDrafter, CachebackDrafter, KVDrafter, Checking,
                                 CrossTokenizerDrafter, *model_drafter_classes()],
                         ids=lambda cls: cls.__name__)
def test_each_drafter_class_declares_exactly_what_its_methods_take(cls):
    assert cls.capabilities == interface(cls)


def test_the_model_drafters_declare_confidence_trees_and_guess_checks():
    for cls in model_drafter_classes():
        assert cls.capabilities.confidence and cls.capabilities.trees, cls
    assert HFDrafter.capabilities.checks_guesses
    assert not NgramDrafter.capabilities.trees and not NgramDrafter.capabilities.confidence


def test_a_drafter_declaring_trees_drafts_trees():
    unsure = Unsure()
    assert unsure.capabilities.trees
    tree = unsure.propose([1, 2], 3, GREEDY, tree=3)
    assert tree.parents is not None and tree_problem(tree.parents, len(tree.token_ids)) is None
    assert len(tree.token_ids) == 3 * 3             # two siblings beside each chain token
    cacheback = CachebackDrafter(leader=2, follower=2)
    assert cacheback.capabilities.trees
    learnt(cacheback)
    assert cacheback.propose([5, 6], 2, GREEDY, tree=2).parents == [0, 1, 0, 3]
    with pytest.raises(TypeError):                  # declares none: takes no tree=N
        NgramDrafter().propose([5, 6], 2, GREEDY, tree=2)


def test_a_drafter_declaring_confidence_reports_it_and_stops_on_it():
    drafter = Unsure()
    scored = drafter.propose([1, 2], 3, GREEDY, with_confidence=True)
    assert scored.confidence == pytest.approx([0.3] * 3)
    assert drafter.propose([1, 2], 3, GREEDY, min_confidence=0.5).token_ids == [2]
    with pytest.raises(TypeError):
        NgramDrafter().propose([1, 2], 3, GREEDY, with_confidence=True)


def test_a_drafter_declaring_observes_learns_and_one_declaring_checks_guesses_checks():
    cacheback = CachebackDrafter(leader=2, follower=2)
    assert cacheback.propose([5, 6], 2, GREEDY).token_ids == [6, 6]    # nothing learnt yet
    learnt(cacheback)
    assert cacheback.propose([5, 6], 2, GREEDY).token_ids == [8, 2]    # the latest follower
    checking = Checking()
    assert checking.greedy_after([1, 2], [2, 9]) == [2, 3, 4]


# --- wrappers report their inner drafter's --------------------------------------------------------

def test_a_wrapper_reports_its_inner_drafters_capabilities():
    assert SharedDrafter(CachebackDrafter()).capabilities == Capabilities(trees=True, observes=True)
    assert SharedDrafter(Checking()).capabilities == Capabilities(confidence=True, trees=True)
    assert SharedDrafter(NgramDrafter()).capabilities == NONE
    paced = PacedDrafter(CachebackDrafter(), Board())
    assert paced.capabilities == Capabilities(trees=True, observes=True, awaitable=True)
    assert SharedDrafter(PacedDrafter(Unsure(), Board())).capabilities == \
        Capabilities(confidence=True, trees=True, awaitable=True)
    assert HierDrafter(CachebackDrafter(), Checking()).capabilities == Capabilities(observes=True)
    assert HierDrafter(NgramDrafter(), Checking()).capabilities == NONE


def test_every_capability_passes_through_a_wrapper_by_one_rule():
    """Over every field of Capabilities, so a new one needs no wrapper of its own to change."""
    inner = Everything(EVERY)
    assert Wrapper(inner).capabilities == Wrapper.FORWARDS
    assert PacedDrafter(inner, Board()).capabilities == Wrapper.FORWARDS | Capabilities(awaitable=True)
    assert SharedDrafter(Everything()).capabilities == NONE
    for name in (f.name for f in fields(Capabilities)):
        one = Capabilities(**{name: True})
        assert passed_on(Everything(one), EVERY) == one
        assert passed_on(Everything(one), NONE) == NONE
        assert passed_on(Everything(), NONE, one) == one
    assert capabilities_of(object()) == NONE        # declares nothing: can do none of them


async def test_what_a_wrapper_reports_works_through_it():
    cacheback = CachebackDrafter(leader=2, follower=2)
    shared = SharedDrafter(PacedDrafter(cacheback, Board()))
    learnt(shared)                                   # observe() reached the inner table
    assert cacheback.propose([5, 6], 2, GREEDY).token_ids == [8, 2]
    tree = await shared.apropose([5, 6], 2, GREEDY, tree=2)
    assert tree.parents == [0, 1, 0, 3]
    hier = HierDrafter(cacheback, Checking())
    hier.observe([9, 9, 9, 3, 9, 9])
    assert cacheback.propose([9, 9], 2, GREEDY).token_ids == [3, 9]


def test_hier_takes_a_checking_drafter_by_its_declaration():
    with pytest.raises(ValueError, match="cannot check guesses"):
        HierDrafter(NgramDrafter(), Unsure())       # has greedy_after(), declares no checks


# --- callers act on the declaration -------------------------------------------------------------

async def test_callers_act_on_the_declaration_not_on_the_methods_a_drafter_has():
    silent = Everything()
    proposer = Proposer(silent, GREEDY, min_confidence=0.5, tree=3)
    assert (await proposer.propose([1], 2, branch=True)).token_ids == [1, 1]   # in a thread
    proposer.observe([1, 2])
    bind_target_tokenizer(silent, object())
    assert silent.calls == ["propose "]             # no options, no apropose, observe or bind

    declared = Everything(EVERY)
    proposer = Proposer(declared, GREEDY, min_confidence=0.5, tree=3)
    assert (await proposer.propose([1], 2, branch=True)).token_ids == [2, 2]   # awaited
    proposer.observe([1, 2])
    bind_target_tokenizer(declared, object())
    assert declared.calls == ["apropose min_confidence tree", "observe", "bind_target_tokenizer"]


CAPABILITY_NAMES = {"observe", "apropose", "greedy_after", "bind_target_tokenizer",
                    "reports_confidence", "drafts_trees", "checks_guesses", "capabilities"}


def probes(source: str) -> list[int]:
    """The lines of getattr/hasattr calls in source that look for a capability by name."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and node.args[1].value in CAPABILITY_NAMES]


def test_no_caller_probes_a_drafter_for_a_capability():
    reader = ROOT / "drafters" / "capabilities.py"       # capabilities_of: the one reader
    found = [f"{path.relative_to(ROOT)}:{line}" for package in ("drafters", "edge_client")
             for path in sorted((ROOT / package).rglob("*.py")) if path != reader
             for line in probes(path.read_text())]
    assert len(probes(reader.read_text())) == 1 and found == []


def test_the_check_sees_a_probe():
    assert probes("def f(d):\n    return hasattr(d, 'observe') or getattr(d, 'name')\n") == [2]

