"""Semantic adaptive tokens (SATs): what a target needs to draft for itself.

Appending m SAT slots after the last real token makes the target's outputs at those slots a
guess of the next m tokens, in the same forward pass. Slot j sits at the position right after
slot j - 1 and, with the normal shift, its output predicts the token after the one it stands for:

    positions:  ... c-1        c      c+1    ...  c+m-1
    input:      ... x[c-1]     S1     S2     ...  Sm
    output:         -> x[c]    ->x[c+1]  ->x[c+2] ... -> x[c+m]

A target carries SATs in one of two ways:
- **token ids** in its config (`"sled_sat": {"slots": m, "token_ids": [...]}`), the published
  SDSAT convention: one existing id reused for every slot (CodeLlama: 32011), or new added tokens;
- **an adapter** (`sat_adapter.safetensors` beside the model, or a path given to the server):
  one trained input embedding per slot, already in the model's embedding space (after any
  embedding scale). The model's own weights are untouched, so every standard-token output stays
  bit-identical: training in `embeddings` mode produces exactly this. In `lora` mode the adapter
  also carries low-rank deltas of the attention and MLP projections that act only at SAT slots
  (`sat_lora.py`), so standard-token outputs stay bit-identical there too. `full` mode tunes the
  weights themselves and saves them with the adapter beside them (config: `{"slots": m,
  "adapter": FILE}`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from verify_server.sat_lora import SatLora

ADAPTER_FILE = "sat_adapter.safetensors"
CONFIG_KEY = "sled_sat"


@dataclass(slots=True)
class SatSpec:
    slots: int                                # m, the slots the model was trained for
    token_ids: list[int] | None = None        # [m] SAT id per slot (None: adapter embeddings)
    embeddings: torch.Tensor | None = None    # [m, hidden] input embeddings per slot
    source: str = ""
    lora: SatLora | None = None               # deltas acting only at SAT slots (adapter only)

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"a SAT spec needs at least one slot, got {self.slots}")
        if (self.token_ids is None) == (self.embeddings is None):
            raise ValueError("a SAT spec has either token ids or adapter embeddings, not both")
        if self.token_ids is not None and len(self.token_ids) != self.slots:
            raise ValueError(f"{len(self.token_ids)} SAT token ids for {self.slots} slots")
        if self.embeddings is not None and self.embeddings.shape[0] != self.slots:
            raise ValueError(f"{self.embeddings.shape[0]} SAT embeddings for {self.slots} slots")

    def check(self, model: torch.nn.Module) -> None:
        """Refuse a spec that cannot belong to this model (wrong width, ids out of range)."""
        weight = model.get_input_embeddings().weight
        if self.embeddings is not None and self.embeddings.shape[1] != weight.shape[1]:
            raise ValueError(f"SAT adapter {self.source or ''} has {self.embeddings.shape[1]}-wide "
                             f"embeddings, the model's are {weight.shape[1]}: it was trained for "
                             "another model")
        if self.token_ids is not None and max(self.token_ids) >= weight.shape[0]:
            raise ValueError(f"SAT token id {max(self.token_ids)} is outside the model's "
                             f"{weight.shape[0]} embeddings")
        if self.lora is not None:
            self.lora.check(model)

    @property
    def kind(self) -> str:
        """What carries the SATs: "lora" (embeddings + SAT-only deltas), "embeddings" or "token ids"."""
        if self.lora is not None:
            return "lora"
        return "embeddings" if self.embeddings is not None else "token ids"

    def slot_embeddings(self, model: torch.nn.Module, count: int) -> torch.Tensor:
        """Input embeddings of the first `count` slots: [count, hidden], model dtype/device."""
        if count > self.slots:
            raise ValueError(f"{count} SAT slots asked for, the model was trained for {self.slots}")
        weight = model.get_input_embeddings().weight
        if self.embeddings is not None:
            return self.embeddings[:count].to(device=weight.device, dtype=weight.dtype)
        ids = torch.tensor(self.token_ids[:count], device=weight.device)
        return model.get_input_embeddings()(ids[None])[0]


def save_adapter(path: str | Path, embeddings: torch.Tensor, metadata: dict[str, str | int],
                 lora: SatLora | None = None) -> Path:
    """Write a SAT adapter: the [m, hidden] slot embeddings (float32), any SAT-only LoRA deltas
    (float16: they are small corrections) and what they were trained on."""

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {key: str(value) for key, value in metadata.items()}
    meta["slots"] = str(embeddings.shape[0])
    tensors = {"embeddings": embeddings.detach().to(torch.float32).contiguous().cpu()}
    if lora is not None:
        meta.update(lora_rank=str(lora.rank), lora_alpha=str(lora.alpha))
        tensors.update({name: t.detach().to(torch.float16).contiguous().cpu()
                        for name, t in lora.tensors().items()})
    save_file(tensors, str(path), metadata=meta)
    return path


def load_adapter(path: str | Path) -> SatSpec:

    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        meta = handle.metadata() or {}
    embeddings = tensors.pop("embeddings")
    lora = None
    if "lora_rank" in meta:
        lora = SatLora.from_tensors({k: t.float() for k, t in tensors.items()},
                                    int(meta["lora_rank"]), float(meta["lora_alpha"]))
    return SatSpec(slots=int(meta.get("slots", embeddings.shape[0])), embeddings=embeddings,
                   source=str(path), lora=lora)


def adapter_metadata(path: str | Path) -> dict[str, str]:

    with safe_open(str(path), framework="pt") as handle:
        return dict(handle.metadata() or {})


def sat_spec_of(model: torch.nn.Module, model_dir: str | Path | None = None,
                adapter: str | Path | None = None) -> SatSpec | None:
    """The target's SATs: an explicit adapter, else an adapter file beside the model, else the
    config's token ids; None when the model has no SATs."""
    if adapter is not None:
        return load_adapter(adapter)
    if model_dir is not None and (Path(model_dir) / ADAPTER_FILE).is_file():
        return load_adapter(Path(model_dir) / ADAPTER_FILE)
    meta = getattr(model.config, CONFIG_KEY, None)
    if isinstance(meta, str):
        meta = json.loads(meta)
    if meta:
        if "token_ids" not in meta:  # weights trained together with an adapter file
            raise ValueError(f"the model's {CONFIG_KEY} config uses the adapter file "
                             f"{meta.get('adapter', ADAPTER_FILE)!r}; give the model's folder "
                             "(model_dir) or the adapter path")
        ids = [int(t) for t in meta["token_ids"]]
        return SatSpec(slots=int(meta.get("slots", len(ids))), token_ids=ids, source="config")
    return None


def slots_under_load(slots: int, live_sessions: int, off_above: int) -> int:
    """SAT slots a self-drafting pass carries at this load: none while more than `off_above`
    sessions are live (0 = never off). A large batch makes the target's step compute-bound,
    where the wider verify costs nearly what the accepted drafts save, so serving engines switch
    speculation off there (vLLM's dynamic schedule, TensorRT-LLM's batch threshold)."""
    return 0 if off_above and live_sessions > off_above else slots


def sat_inputs(model: torch.nn.Module, spec: SatSpec, prefix_ids: torch.Tensor,
               slots: int) -> torch.Tensor:
    """Input embeddings of real tokens followed by `slots` SATs.

    prefix_ids: [batch, n] real token ids -> [batch, n + slots, hidden]
    """
    real = model.get_input_embeddings()(prefix_ids)
    sats = spec.slot_embeddings(model, slots).to(real.dtype)
    return torch.cat([real, sats[None].expand(real.shape[0], -1, -1)], dim=1)
