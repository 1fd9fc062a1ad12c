"""Low-rank deltas that act only at SAT slots: the serving half of a SAT LoRA adapter.

A SAT adapter may carry, beside its slot embeddings, a low-rank delta B·A (scaled by alpha / r)
for linear projections of the target (attention and MLP). The delta is added to a projection's
output only at the positions that are SAT slots, the idea of Activated LoRA: the adapter acts
only where it is invoked. Real tokens never attend to SAT slots, so every real token's hidden
states, KV and logits are exactly the untouched target's, bit for bit:

    packed input:   a  a  a  S1 S2 | b  b  S1 S2        (two rows of one engine step)
    delta applied:  -  -  -  +  +  | -  -  +  +

One forward pass mixes many sessions' real tokens and SAT slots, so the positions come as a
per-token mask set for the duration of that pass (`SatLora.at`). Outside such a pass the hooks do
nothing: `generate()` on the same model object is the plain target.

Training uses peft's LoRA on the same modules (`peft_config`, `from_peft`): the real prefix runs
with the adapter disabled and the SAT slots with it enabled, which is the same function.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

# Gemma, Llama, Qwen, Mistral and most decoders name their projections so.
DEFAULT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PREFIX_A, PREFIX_B = "lora_A.", "lora_B."


@dataclass(slots=True)
class SatLora:
    """Low-rank deltas by module path (e.g. "model.layers.0.self_attn.q_proj"): A [r, in] and
    B [out, r]; each adds (x @ A.T @ B.T) * alpha / r to that module's output at SAT slots."""
    rank: int
    alpha: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    _rows: torch.Tensor | None = field(default=None, repr=False)   # flat SAT positions, this pass
    _handles: list = field(default_factory=list, repr=False)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def tensors(self) -> dict[str, torch.Tensor]:
        """The file form: lora_A.<path> and lora_B.<path>."""
        out = {}
        for path, (a, b) in self.weights.items():
            out[PREFIX_A + path], out[PREFIX_B + path] = a, b
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], rank: int, alpha: float) -> "SatLora":
        paths = sorted(k[len(PREFIX_A):] for k in tensors if k.startswith(PREFIX_A))
        missing = [p for p in paths if PREFIX_B + p not in tensors]
        if missing:
            raise ValueError(f"SAT adapter has lora_A but no lora_B for {missing[0]}")
        return cls(rank, alpha, {p: (tensors[PREFIX_A + p], tensors[PREFIX_B + p]) for p in paths})

    def check(self, model: torch.nn.Module) -> None:
        """Refuse deltas that do not fit this model's modules."""
        modules = dict(model.named_modules())
        for path, (a, b) in self.weights.items():
            module = modules.get(path)
            if not isinstance(module, torch.nn.Linear):
                raise ValueError(f"SAT adapter has a delta for {path}, which this model does not "
                                 "have as a linear layer: it was trained for another model")
            if a.shape != (self.rank, module.in_features) or b.shape != (module.out_features, self.rank):
                raise ValueError(f"SAT adapter delta for {path} is {tuple(b.shape)}x{tuple(a.shape)}, "
                                 f"the layer is {module.out_features}x{module.in_features}")

    def attach(self, model: torch.nn.Module) -> None:
        """Hook every adapted module of `model` (weights moved to its device and dtype). Once."""
        if self._handles:
            return
        self.check(model)
        modules = dict(model.named_modules())
        for path, (a, b) in self.weights.items():
            module = modules[path]
            a = a.to(device=module.weight.device, dtype=module.weight.dtype)
            b = b.to(device=module.weight.device, dtype=module.weight.dtype)
            self.weights[path] = (a, b)
            self._handles.append(module.register_forward_hook(self._hook(a, b)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, a: torch.Tensor, b: torch.Tensor):
        scale = self.scale

        def add_delta(module, inputs, output):
            rows = self._rows
            if rows is None:
                return output
            x = inputs[0].reshape(-1, inputs[0].shape[-1])[rows]
            flat = output.reshape(-1, output.shape[-1])
            flat.index_add_(0, rows, (x @ a.T) @ b.T, alpha=scale)
            return output

        return add_delta

    @contextmanager
    def at(self, rows: torch.Tensor | None):
        """For the pass inside: `rows` are the SAT positions of the flattened [batch * tokens]
        input (None or empty: no delta anywhere)."""
        self._rows = rows if rows is not None and rows.numel() else None
        try:
            yield
        finally:
            self._rows = None


# --- the training half: peft -------------------------------------------------------------------

def peft_config(rank: int, alpha: float, modules: tuple[str, ...] = DEFAULT_MODULES):
    """peft's LoRA config of a SAT adapter (peft loads here: serving never needs it, and it
    takes seconds to import)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(modules),
                      bias="none")


def from_peft(peft_model, rank: int, alpha: float) -> SatLora:
    """The adapter's deltas out of a peft LoRA model, keyed by the base model's module paths."""
    weights: dict[str, list] = {}
    for name, param in peft_model.named_parameters():
        for part, slot in ((".lora_A.default.weight", 0), (".lora_B.default.weight", 1)):
            if name.endswith(part):
                path = name[:-len(part)].removeprefix("base_model.model.")
                weights.setdefault(path, [None, None])[slot] = param.detach().float().cpu().clone()
    return SatLora(rank, alpha, {p: (a, b) for p, (a, b) in weights.items()})


def to_peft(model: torch.nn.Module, lora: SatLora):
    """A peft LoRA model over `model` carrying exactly `lora`'s deltas (the reference forward)."""

    modules = tuple(sorted({p.rsplit(".", 1)[-1] for p in lora.weights}))
    from peft import get_peft_model

    peft_model = get_peft_model(model, peft_config(lora.rank, lora.alpha, modules))
    load_deltas(peft_model, lora)
    return peft_model


def load_deltas(peft_model, lora: SatLora) -> None:
    """Copy `lora`'s deltas into a peft LoRA model's A and B (same rank); a module the model has
    no LoRA layer for is refused, naming it."""
    params = dict(peft_model.named_parameters())
    with torch.no_grad():
        for path, (a, b) in lora.weights.items():
            for part, value in ((".lora_A.default.weight", a), (".lora_B.default.weight", b)):
                target = params.get("base_model.model." + path + part)
                if target is None or target.shape != value.shape:
                    raise ValueError(f"the adapter's delta on {path} does not fit this LoRA model "
                                     f"(rank {lora.rank})")
                target.copy_(value.to(target.dtype))
