"""Cross-tokenizer drafting: a model drafter with its own tokenizer drafts for a target with
another one, re-tokenized at the text boundary (as universal assisted generation does).

Spec "xtok:MODEL", e.g. "xtok:gguf:smollm2-135m" for a gemma3 target. The drafter drafts in the
target's ids (its tokenizer_fingerprint is None), so a server takes it as it takes the n-gram
drafter; it needs the target's tokenizer, which the device hands it (bind_target_tokenizer)
once the server has sent it. A round:

    context (target ids) -> text -> the drafter's ids (re-encoding only the tail)
    the drafter drafts k+1 of its own tokens -> draft text, say "(n - 1) +"
    target ids of (context tail text + draft text), past the tail's: "(", "n", " -", " 1", ")", " +"
    the last one may be a partial token (" +" could become " +=") unless more than k came: dropped

A context that ends in whitespace is healed first: its trailing whitespace ids are left out of
the drafter's context and drafted again ("...:\\n    " -> the drafter is shown "...:" and drafts
"\\n    for"), since at the end of a text a byte-level BPE cuts whitespace unlike in the middle
of one; a draft that does not write that whitespace again has nothing usable.

A boundary merge (the tail's own ids change when the draft text follows it: a context ending in
"\\n" and a draft starting with "    " may encode as one "\\n    " token) drafts the draft text
encoded on its own, what a target held to that boundary writes. A draft with nothing usable is
one token: the first the draft text encodes to, else the context's last.

The draft goes out with q = one-hot (Proposal.q None), also when the drafter samples: the
drafter's q is over its own vocabulary, and for any draft token x the server's rejection sampling
with q = one-hot(x) is exact (accept with p(x), else draw from p without x).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from drafters.base import Proposal
from drafters.capabilities import Capabilities
from drafters.text_codecs import REPLACEMENT, TargetText, TextCodec, codec_of, text_after
from sled.wire.sampling import Sampling

WINDOW = 8      # ids decoded before new ones, so a decoder sees them mid-text
SETTLE = 16     # drafter ids after an anchor: text appended later cannot merge back past them
EXTRA = 1       # drafter tokens beyond k, for the partial target token dropped at the end
HEAL = 3        # most trailing whitespace ids of a context that are drafted again


class CrossTokenizerDrafter:
    tokenizer_fingerprint = None     # drafts in the target's own ids
    # once it has the target's tokenizer; its own propose() takes no options of the inner one's
    capabilities = Capabilities(target_tokenizer=True)

    def __init__(self, inner, inner_text: TextCodec, target_tokenizer=None) -> None:
        self.inner = inner
        self.inner_text = inner_text
        self.name = f"xtok:{inner.name}"
        if getattr(inner, "alias", None):
            self.alias = f"xtok:{inner.alias}"
        self.target: TargetText | None = None
        self.context_text: DecodedContext | None = None
        self.encoded = EncodedText(inner_text)
        self.merges = 0        # rounds whose draft text merged into the context's last ids
        self.fallbacks = 0     # rounds with nothing usable: a one-token draft
        self.diverged = 0      # rounds whose healed whitespace the drafter did not write again
        if target_tokenizer is not None:
            self.bind_target_tokenizer(target_tokenizer)

    @classmethod
    def around(cls, inner) -> "CrossTokenizerDrafter":
        """Wrapping a loaded model drafter, with its own tokenizer."""
        return cls(inner, codec_of(inner))

    def bind_target_tokenizer(self, tokenizer) -> None:
        """The target's tokenizer (the device fetches it from the server)."""
        self.target = TargetText(tokenizer)
        self.context_text = DecodedContext(self.target.plain_text)

    def propose(self, context: Sequence[int], draft_len: int, sampling: Sampling,
                generator: np.random.Generator | None = None) -> Proposal:
        if self.target is None:
            raise RuntimeError(f"{self.name}: the target's tokenizer is not known yet "
                               "(bind_target_tokenizer)")
        context = list(context)
        text, complete = self._drafted(context, draft_len, sampling, generator)
        ids, merged = target_draft(self.target, context, text)
        self.merges += merged
        draft = settled(ids, draft_len, complete)
        if not draft:
            self.fallbacks += 1
            draft = ids[:1] or context[-1:]
        return Proposal(draft)        # q = one-hot: exact for any draft token

    def rollback(self, length: int) -> None:
        """Left to the next proposal: the drafter reuses the longest cached prefix of its ids."""

    def _drafted(self, context: list[int], draft_len: int, sampling: Sampling,
                 generator: np.random.Generator | None) -> tuple[str, bool]:
        """The text the drafter drafts after the context's, and whether it ended there. The
        context's trailing whitespace ids are drafted again (healed): the drafted text must
        start with their text, which is then left out; "" when it does not."""
        ids = self.encoded.of(self.context_text.of(context))
        healed = trailing_space(self.inner_text, ids)
        kept = self.inner_text.bos + ids[:len(ids) - healed]
        if not kept:                   # no text to go on (a context of special tokens only)
            return "", False
        drafted = self.inner.propose(kept, draft_len + EXTRA + healed, sampling,
                                     generator).token_ids
        text, complete = drafted_text(self.inner_text, kept, drafted)
        again = text_after(self.inner_text.decode, kept[-WINDOW:], ids[len(ids) - healed:])
        if again is None or not text.startswith(again):
            self.diverged += 1         # the drafter would not write the context's end again
            return "", False
        return text[len(again):], complete


# -- target ids -> text -> drafter ids, incrementally ----------------------------------------------

class DecodedContext:
    """The text of a context of target ids, decoded incrementally: a context that extends the last
    one decodes only its new ids (after WINDOW before them); any other is decoded whole."""

    def __init__(self, decode) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""

    def of(self, ids: list[int]) -> str:
        n = len(self.ids)
        new = text_after(self.decode, self.ids[-WINDOW:], ids[n:]) \
            if n and ids[:n] == self.ids else None
        text = self.text + new if new is not None else self.decode(ids)
        if not text.endswith(REPLACEMENT):   # a character cut in two is decoded again next time
            self.ids, self.text = ids, text
        return text


class EncodedText:
    """The drafter's ids of a growing text, re-encoding only the tail past an anchor: a token
    boundary SETTLE ids before the end of an earlier text, whose text encoded on its own gave the
    same ids (checked when the anchor is set). Text that changes before the anchor is encoded
    whole.

    Example: "def f(x):\\n    return" encoded as 9 ids, anchor after id 3 at "def f(x" (offset
    7): appending " x + 1" encodes "):\\n    return x + 1" only, after the first 3 ids."""

    def __init__(self, codec: TextCodec, settle: int = SETTLE) -> None:
        self.codec = codec
        self.settle = settle
        self.text = ""
        self.ids: list[int] = []
        self.anchor = (0, 0)       # (offset in text, ids before it)
        self.encoded_chars = 0     # characters encoded so far (what the anchor saves)

    def of(self, text: str) -> list[int]:
        offset, count = self.anchor
        if not offset or text[:offset] != self.text[:offset]:
            offset, count = 0, 0
        tail = text[offset:]
        ids = self.ids[:count] + self.codec.encode(tail)
        self.encoded_chars += len(tail)
        self.text, self.ids, self.anchor = text, ids, (offset, count)
        self.anchor = self._next_anchor() or self.anchor
        return ids

    def _next_anchor(self) -> tuple[int, int] | None:
        """The boundary `settle` ids before the end, when its text encodes on its own to the same
        ids (a boundary inside a word or a run of spaces may not)."""
        cut = len(self.ids) - self.settle
        if cut <= self.anchor[1]:
            return None
        tail = text_after(self.codec.decode, self.ids[max(0, cut - WINDOW):cut], self.ids[cut:])
        if tail is None or not tail or not self.text.endswith(tail) or \
                self.codec.encode(tail) != self.ids[cut:]:
            return None
        return len(self.text) - len(tail), cut


# -- drafter ids -> text -> target ids -------------------------------------------------------------

def trailing_space(codec: TextCodec, ids: list[int]) -> int:
    """How many of the context's last ids to draft again: its whitespace-only ids at the end (at
    most HEAL), else the last one when its text ends in whitespace. A byte-level BPE cuts a run of
    whitespace at the end of a text unlike in the middle of one ("\\n    " at the end, "\\n   "
    then " for" inside), and a drafter shown the end-of-text cut drafts as if no indentation
    came."""
    def tail(n: int) -> str:
        return text_after(codec.decode, ids[-n - WINDOW:-n], ids[-n:]) or ""

    spaces = 0
    while spaces < min(HEAL, len(ids)) and tail(spaces + 1).isspace():
        spaces += 1
    return spaces or int(bool(ids) and tail(1)[-1:].isspace())


def drafted_text(codec: TextCodec, context: Sequence[int],
                 drafted: Sequence[int]) -> tuple[str, bool]:
    """The text the drafter drafted and whether it is complete: it ended the generation (an EOS:
    the text stops there, so its last target token is whole). A character cut in two at the end
    is left out."""
    ends = next((i for i, token in enumerate(drafted) if codec.ends(token)), None)
    kept = list(drafted[:ends]) if ends is not None else list(drafted)
    text = text_after(codec.decode, context[-WINDOW:], kept) or ""
    whole = text.rstrip(REPLACEMENT)
    return whole, ends is not None and whole == text


def target_draft(target: TargetText, context: Sequence[int], text: str) -> tuple[list[int], bool]:
    """The target ids of `text` after the context, and whether it merged into the context's own
    ids. Encoded after the text of the context's last WINDOW ids: the ids past that tail's own.

    Example (gemma3): context ... "    if", text " n < 2:" -> [" n", " <", " ", "2", ":"], no
    merge; context ... "\\n", text "    return" -> "\\n    " would swallow the "\\n": a merge, the
    text is encoded on its own -> ["    ", "return"]."""
    if not text:
        return [], False
    tail_text = text_after(target.decode, context[-2 * WINDOW:-WINDOW], context[-WINDOW:])
    if tail_text is not None:
        base = target.encode(tail_text)
        joint = target.encode(tail_text + text)
        if joint[:len(base)] == base:
            return joint[len(base):], False
    alone = target.encode(text)
    return (alone if target.decode(alone) == text else []), True


def settled(ids: list[int], draft_len: int, complete: bool) -> list[int]:
    """The draft: at most draft_len ids, none that the text after it could still change. The
    last id of an incomplete text may be a partial token ("hel" of "hello"): dropped, unless
    more than draft_len came (then the draft_len-th is followed by text already)."""
    if len(ids) > draft_len:
        return ids[:draft_len]
    return ids if complete else ids[:-1]
