"""What a drafter can do beyond propose() and rollback(), declared once on its class.

    class CachebackDrafter:
        capabilities = Capabilities(trees=True, observes=True)

Callers read capabilities_of(drafter) and never probe for methods; a drafter that declares
nothing can do none of these. A drafter around another (sharing it, pacing it, checking its
guesses) derives its own from the inner drafter's with passed_on(): the ones it forwards, plus
its own. A new capability is one field here, declared by the drafters that have it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class Capabilities:
    # propose() takes min_confidence (stop the draft after the first token whose confidence is
    # below it; 0 = never) and with_confidence (fill Proposal.confidence even when not stopping)
    confidence: bool = False
    # propose() takes tree=N: up to N candidates per draft position, returned as a tree
    # (Proposal.parents), at most N * draft_len tokens and draft_len deep. A tree's candidates are
    # deterministic (q None): a drafter that samples with a q drafts a chain instead.
    trees: bool = False
    # observe(context): it learns from committed text (Cacheback); a session shows it its prompt
    # and committed tokens before each draft and its whole output at the end
    observes: bool = False
    # greedy_after(context, tokens): its greedy token after each prefix of a cheaper drafter's
    # guesses, from one evaluation (the model drafter of hier:)
    checks_guesses: bool = False
    # bind_target_tokenizer(tokenizer): it drafts in the target's ids once it has the target's
    # tokenizer (xtok:)
    target_tokenizer: bool = False
    # apropose(...): a proposal awaited on the event loop, not run in a thread (an emulated board)
    awaitable: bool = False

    def __and__(self, other: Capabilities) -> Capabilities:
        """The capabilities both have."""
        return Capabilities(**{f.name: getattr(self, f.name) and getattr(other, f.name)
                               for f in fields(self)})

    def __or__(self, other: Capabilities) -> Capabilities:
        """The capabilities either has."""
        return Capabilities(**{f.name: getattr(self, f.name) or getattr(other, f.name)
                               for f in fields(self)})


NONE = Capabilities()


def capabilities_of(drafter) -> Capabilities:
    """What the drafter declares it can do (its `capabilities`); none when it declares nothing."""
    return getattr(drafter, "capabilities", NONE)


def passed_on(inner, forwards: Capabilities, own: Capabilities = NONE) -> Capabilities:
    """A wrapper's capabilities: those of the inner drafter it forwards, and its own.
    passed_on(cacheback, Capabilities(observes=True)) == Capabilities(observes=True)."""
    return capabilities_of(inner) & forwards | own
