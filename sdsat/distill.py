"""Self-distillation data for SATs: the target's own greedy continuations of corpus prompts.

Self-drafting is verified against the target's greedy continuation, so that, not the text, is
what a SAT slot must learn to predict. A prompt is a window of a corpus document (BOS, then
`prompt_len - 1` tokens starting at a line); the target continues it greedily for `new_tokens`.
Greedy decoding is deterministic, so at every cut c inside the continuation the tokens after c
are exactly the target's greedy continuation from c: one generated sequence gives a label for
every cut in it.

    prompt (text)            continuation (target, greedy)
    [BOS t1 ... t_{P-1}]     [g_P ... g_{P+G-1}]
                              ^ cuts c in P .. P+G-1-m: slot j's label is x[c + j]

Prompts come in two shapes (`at`):
- "lines": the window starts at a line of the document;
- "bodies": the window ends where a function's body begins, right after its docstring, so the
  target writes the body: the shape of a code-completion request (a signature and a docstring).

Generation is batched (every prompt has the same length: no padding) and saved after each batch,
so an interrupted run continues where it stopped.

    spec = DistillSpec(prompt_len=96, new_tokens=96, count=256, seed=0, at="lines")
    data = build_distill_set(model, tokenizer, documents, spec, cache=Path("distill.pt"))
"""
from __future__ import annotations

import ast
import bisect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(slots=True)
class DistillSet:
    sequences: torch.Tensor   # [count, prompt_len + new_tokens] prompt, then greedy continuation
    prompt_len: int

    @property
    def new_tokens(self) -> int:
        return self.sequences.shape[1] - self.prompt_len

    def split(self, heldout: int) -> tuple["DistillSet", "DistillSet"]:
        """(train, held-out): the last `heldout` sequences are held out."""
        if not 0 < heldout < len(self.sequences):
            raise ValueError(f"cannot hold out {heldout} of {len(self.sequences)} sequences")
        return (DistillSet(self.sequences[:-heldout], self.prompt_len),
                DistillSet(self.sequences[-heldout:], self.prompt_len))


def line_starts(ids: list[int], tokenizer) -> list[int]:
    """Token indices that begin a line (the token before ends with a newline)."""
    pieces = tokenizer.convert_ids_to_tokens(ids)
    return [i for i in range(1, len(ids)) if pieces[i - 1].endswith(("\n", "Ċ"))]


PROMPT_SHAPES = ("lines", "bodies")


def body_offsets(text: str) -> list[int]:
    """Character offsets where a documented function's body goes on after its docstring (the
    start of the line after the docstring), for functions with more than the docstring."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    line_offsets = [0]
    for line in text.splitlines(keepends=True):
        line_offsets.append(line_offsets[-1] + len(line))
    offsets = []
    for node in ast.walk(tree):
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(node.body) > 1
                and ast.get_docstring(node, clean=False) is not None
                and node.body[0].end_lineno < len(line_offsets) - 1):
            offsets.append(line_offsets[node.body[0].end_lineno])
    return sorted(offsets)


def prompt_starts(doc: str, tokenizer, width: int, at: str) -> tuple[list[int], list[int]]:
    """(doc's token ids, the indices where a `width`-token window of it may start for the prompt
    shape `at`)."""
    if at not in PROMPT_SHAPES:
        raise ValueError(f"unknown prompt shape {at!r}; choose one of {', '.join(PROMPT_SHAPES)}")
    encoded = tokenizer(doc, add_special_tokens=False, return_offsets_mapping=at == "bodies")
    ids = encoded.input_ids
    if at == "lines":
        return ids, [s for s in [0, *line_starts(ids, tokenizer)] if s + width <= len(ids)]
    # A prompt ends before the first token that starts on the body's line: with tokenizers that
    # join a newline to the next line's indentation, that indentation ends the prompt.
    token_starts = [start for start, _ in encoded.offset_mapping]
    ends = [bisect.bisect_left(token_starts, offset) for offset in body_offsets(doc)]
    return ids, [end - width for end in ends if width <= end < len(ids)]


def draw_prompts(tokenizer, documents: list[str], prompt_len: int, count: int,
                 seed: int, at: str = "lines") -> torch.Tensor:
    """[count, prompt_len] prompts: BOS (when the tokenizer adds one) and a window of a document
    of the shape `at` (see the module docstring), documents drawn in proportion to their
    windows."""
    generator = torch.Generator().manual_seed(seed)
    lead = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    width = prompt_len - len(lead)
    bodies, starts = [], []
    for doc in documents:
        ids, fits = prompt_starts(doc, tokenizer, width, at)
        if fits:
            bodies.append(ids)
            starts.append(fits)
    if not bodies:
        raise ValueError(f"no corpus document has a {prompt_len}-token prompt of shape {at!r}")
    weights = torch.tensor([len(s) for s in starts], dtype=torch.float64)
    prompts = []
    for doc in torch.multinomial(weights, count, replacement=True, generator=generator).tolist():
        start = starts[doc][int(torch.randint(len(starts[doc]), (1,), generator=generator))]
        prompts.append(lead + bodies[doc][start:start + width])
    return torch.tensor(prompts, dtype=torch.long)


@torch.inference_mode()
def greedy_continuations(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int,
                         batch: int = 16, done: torch.Tensor | None = None,
                         on_batch: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """prompts [count, P] -> [count, P + new_tokens]: each prompt and the target's greedy
    continuation (no EOS stop: a fixed length). `done` rows are kept, the rest generated;
    on_batch(all rows so far) runs after each batch (to save progress)."""
    rows = [] if done is None else list(done)
    device = next(model.parameters()).device
    for start in range(len(rows), len(prompts), batch):
        chunk = prompts[start:start + batch].to(device)
        out = model.generate(chunk, attention_mask=torch.ones_like(chunk), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=0, eos_token_id=None)
        rows.extend(out.cpu())
        if on_batch is not None:
            on_batch(torch.stack(rows))
    return torch.stack(rows)


@dataclass(frozen=True, slots=True)
class DistillSpec:
    """What a distill set holds: `count` prompts of prompt_len tokens of the shape `at` drawn
    from the documents with `seed` (draw_prompts), each continued greedily for new_tokens."""
    prompt_len: int
    new_tokens: int
    count: int
    seed: int
    at: str = "lines"


def build_distill_set(model: torch.nn.Module, tokenizer, documents: list[str],
                      spec: DistillSpec, *, cache: Path | None = None,
                      batch: int = 16, on_batch: Callable[[int, int], None] | None = None
                      ) -> DistillSet:
    """The generated set `spec` describes, continued from `cache` when it holds the same
    prompts' first rows. on_batch(rows done, count) follows progress."""
    prompt_len, new_tokens, count = spec.prompt_len, spec.new_tokens, spec.count
    prompts = draw_prompts(tokenizer, documents, prompt_len, count, spec.seed, spec.at)
    done = None
    if cache is not None and cache.is_file():
        saved = torch.load(cache, weights_only=True)
        same = (saved.shape[1] == prompt_len + new_tokens and len(saved) <= count
                and torch.equal(saved[:, :prompt_len], prompts[:len(saved)]))
        done = saved if same else None

    def save(rows: torch.Tensor) -> None:
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save(rows, cache.with_suffix(".tmp"))
            cache.with_suffix(".tmp").replace(cache)
        if on_batch is not None:
            on_batch(len(rows), count)

    sequences = greedy_continuations(model, prompts, new_tokens, batch, done, save)
    return DistillSet(sequences, prompt_len)
