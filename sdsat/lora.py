"""Training a SAT LoRA adapter by self-distillation (`sled sdsat train --mode lora`).

The adapter is the SAT slot embeddings plus peft LoRA deltas on the attention and MLP
projections that act only at SAT slots (`sat_lora.py`). Labels come from the target itself
(`distill.py`): at a cut c inside a generated sequence, slot j must predict x[c + j], the
target's own greedy token there.

What keeps it affordable on two CPU cores:
- the real sequence runs once per step with the adapter disabled and without gradients, into a
  KV cache: nothing before the SATs needs gradients, and the real tokens' outputs are the
  untouched target's by construction;
- many cuts share that one prefix: every cut's m SAT slots are appended after the whole sequence
  with their own position ids and a mask that lets each slot see the real tokens before its cut
  and the earlier slots of its own cut only:

      keys:        x0 x1 x2 x3 x4 x5 | S1 S2 (cut 3) | S1 S2 (cut 5)
      S2 (cut 3):  1  1  1  0  0  0  | 1  1          | 0  0
      S1 (cut 5):  1  1  1  1  1  0  | 0  0          | 1  0

- logits only at SAT slots: Gemma's 262k-wide output head costs as much as the rest of a 270M
  model, per position.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from peft import get_peft_model

from verify_server.sat_lora import from_peft, load_deltas, peft_config
from verify_server.sdsat import SatSpec
from sdsat.distill import DistillSet
from sdsat.train import (Checkpoints, check_checkpoint, initial_adapter,
                         restore_progress, resumed, save_checkpoint)


@dataclass(slots=True)
class LoraTrainConfig:
    slots: int = 4               # m
    rank: int = 8                # LoRA r
    alpha: float = 16.0          # LoRA alpha (the delta is scaled by alpha / r)
    steps: int = 400
    batch: int = 4               # sequences per step
    cuts: int = 24               # cuts per sequence per step
    lr: float = 2e-3             # LoRA deltas
    embedding_lr: float = 1e-2   # slot embeddings
    seed: int = 0
    eval_every: int = 25
    save_every: int = 0

    def __post_init__(self) -> None:
        for name in ("slots", "rank", "steps", "batch", "cuts", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.save_every < 0 or self.lr <= 0 or self.embedding_lr <= 0 or self.alpha <= 0:
            raise ValueError("save_every cannot be negative; lr, embedding_lr and alpha must be > 0")

    def identity(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("steps", "save_every", "eval_every")}


def cut_mask(length: int, cuts: torch.Tensor, slots: int) -> torch.Tensor:
    """[B, 1, K*m, length + K*m] bool: what each cut's slots may attend to (see the docstring).
    cuts: [B, K] cut positions (the first slot sits at position c)."""
    batch, count = cuts.shape
    width = count * slots
    real = torch.arange(length)[None, None, :] < cuts.repeat_interleave(slots, 1)[:, :, None]
    owner = torch.arange(width) // slots
    slot = torch.arange(width) % slots
    own = (owner[:, None] == owner[None, :]) & (slot[None, :] <= slot[:, None])
    return torch.cat([real, own[None].expand(batch, -1, -1)], dim=2)[:, None]


def packed_sat_logits(model, embeddings: torch.Tensor, sequences: torch.Tensor,
                      cuts: torch.Tensor) -> torch.Tensor:
    """Outputs at every cut's SAT slots: [B, K, m, vocab].

    model: the peft LoRA model over the target; embeddings [m, hidden]; sequences [B, N];
    cuts [B, K]. The sequence runs with the adapter off and no gradients; the slots with it on."""
    batch, length = sequences.shape
    slots = embeddings.shape[0]
    count = cuts.shape[1]
    window = getattr(model.get_base_model().config.get_text_config(), "sliding_window", None)
    if window is not None and length + count * slots > window:
        # The cut mask is passed as-is to every layer, so a sliding window must cover it all.
        raise ValueError(f"{length} tokens + {count} cuts x {slots} slots exceed the model's "
                         f"{window}-token sliding window; use shorter sequences or fewer cuts")
    with torch.no_grad(), model.disable_adapter():
        cache = model.get_base_model().get_decoder()(input_ids=sequences, use_cache=True).past_key_values
    dtype = model.get_input_embeddings().weight.dtype
    embeds = embeddings.to(dtype)[None, None].expand(batch, count, -1, -1).reshape(batch, count * slots, -1)
    positions = (cuts[:, :, None] + torch.arange(slots)).reshape(batch, count * slots)
    mask = cut_mask(length, cuts, slots).to(sequences.device)
    logits = model(inputs_embeds=embeds, past_key_values=cache, position_ids=positions.to(sequences.device),
                   attention_mask=mask, use_cache=True).logits
    return logits.reshape(batch, count, slots, -1)


def cut_labels(sequences: torch.Tensor, cuts: torch.Tensor, slots: int) -> torch.Tensor:
    """[B, K, m]: slot j (1-based) of cut c predicts x[c + j]."""
    index = cuts[:, :, None] + torch.arange(1, slots + 1)
    return torch.gather(sequences, 1, index.reshape(len(sequences), -1)).reshape(index.shape)


def draw_cuts(data: DistillSet, rows: torch.Tensor, count: int, slots: int,
              generator: torch.Generator) -> torch.Tensor:
    """[B, K] distinct cuts per row, uniform over P .. P + G - 1 - m (a greedy label after each)."""
    span = data.new_tokens - slots
    if span < 1:
        raise ValueError(f"{data.new_tokens} generated tokens leave no cut for {slots} slots")
    count = min(count, span)
    picks = torch.stack([torch.randperm(span, generator=generator)[:count] for _ in rows])
    return data.prompt_len + picks.sort(dim=1).values


def every_cut(data: DistillSet, slots: int) -> torch.Tensor:
    """Every cut of every row (for held-out evaluation): [B, G - m]."""
    span = torch.arange(data.new_tokens - slots) + data.prompt_len
    return span[None].expand(len(data.sequences), -1)


@torch.no_grad()
def heldout_metrics(model, embeddings: torch.Tensor, data: DistillSet, batch: int = 4) -> dict:
    """Greedy SAT acceptance against the target's own continuation, at every held-out cut:
    slot_accuracy, per_slot, accepted_run (leading slots all right, mean) and loss."""
    slots = embeddings.shape[0]
    hits, losses = [], []
    cuts = every_cut(data, slots)
    for start in range(0, len(data.sequences), batch):
        seqs, rows = data.sequences[start:start + batch], cuts[start:start + batch]
        for part in torch.split(torch.arange(rows.shape[1]), 32):   # bounded logits memory
            logits = packed_sat_logits(model, embeddings, seqs, rows[:, part])
            labels = cut_labels(seqs, rows[:, part], slots)
            hits.append((logits.argmax(-1) == labels).flatten(0, 1))
            losses.append(F.cross_entropy(logits.float().flatten(0, 2), labels.flatten()).item())
    hits = torch.cat(hits).float()
    run = hits.cumprod(dim=1).sum(dim=1)
    return {"slot_accuracy": hits.mean().item(), "per_slot": hits.mean(0).tolist(),
            "accepted_run": run.mean().item(), "loss": sum(losses) / len(losses)}


def check_start(start: SatSpec, config: LoraTrainConfig) -> SatSpec:
    """The adapter a run goes on from, when it matches the run's slots, rank and alpha."""
    if start.lora is None:
        raise ValueError("the starting adapter has no LoRA deltas (an embeddings-only adapter)")
    found = (start.slots, start.lora.rank, start.lora.alpha)
    if found != (config.slots, config.rank, config.alpha):
        raise ValueError(f"the starting adapter has {found[0]} slots, rank {found[1]}, alpha "
                         f"{found[2]:g}; this run has {config.slots}, {config.rank}, "
                         f"{config.alpha:g}")
    return start


class LoraRun:
    """One run's state: the peft model, slot embeddings, optimizer, RNG, step and log."""

    def __init__(self, model, config: LoraTrainConfig, data: DistillSet,
                 start: SatSpec | None = None):
        """start: an adapter to go on training (its slots, rank and alpha must be the config's);
        None: mean-embedding slots and peft's initial deltas."""
        torch.manual_seed(config.seed)                    # peft's lora_A initialisation
        self.config, self.data = config, data
        self.fingerprint = hashlib.sha256(data.sequences.numpy().tobytes()).hexdigest()
        self.model = get_peft_model(model, peft_config(config.rank, config.alpha)).eval()
        if start is None:
            init = initial_adapter(model, config.slots)
        else:
            init = check_start(start, config).embeddings.float()
            load_deltas(self.model, start.lora)
        self.embeddings = torch.nn.Parameter(init.detach().clone())
        self.deltas = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam([{"params": self.deltas, "lr": config.lr},
                                           {"params": [self.embeddings], "lr": config.embedding_lr}])
        self.generator = torch.Generator().manual_seed(config.seed)
        self.step, self.log, self.pending, self.elapsed = 0, [], [], 0.0

    def train_step(self) -> dict:
        config = self.config
        rows = torch.randint(len(self.data.sequences), (config.batch,), generator=self.generator)
        sequences = self.data.sequences[rows]
        cuts = draw_cuts(self.data, rows, config.cuts, config.slots, self.generator)
        logits = packed_sat_logits(self.model, self.embeddings, sequences, cuts)
        labels = cut_labels(sequences, cuts, config.slots)
        loss = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*self.deltas, self.embeddings], 1.0)
        self.optimizer.step()
        self.step += 1
        return {"loss": loss.item(), "sat_loss": loss.item()}

    def spec(self) -> SatSpec:
        lora = from_peft(self.model, self.config.rank, self.config.alpha)
        return SatSpec(slots=self.config.slots, embeddings=self.embeddings.detach().cpu().clone(),
                       source="trained", lora=lora)

    def state(self, elapsed: float) -> dict:
        return {"step": self.step, "elapsed_s": elapsed, "adapter": self.embeddings.detach().clone(),
                "deltas": [p.detach().clone() for p in self.deltas],
                "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                "log": self.log, "pending": self.pending, "config": self.config.identity(),
                "data": self.fingerprint}

    def restore(self, state: dict) -> None:
        check_checkpoint(state, self.config.identity(), self.fingerprint, "generated sequences; "
                         "resume with the same corpus, counts and seed")
        with torch.no_grad():
            self.embeddings.copy_(state["adapter"])
            for param, saved in zip(self.deltas, state["deltas"]):
                param.copy_(saved)
        restore_progress(self, state)

    def unload(self) -> None:
        """Give the target back without the peft layers."""
        self.model.unload()


def train_sat_lora(model, data: DistillSet, heldout: DistillSet, config: LoraTrainConfig,
                   start: SatSpec | None = None, checkpoints: Checkpoints = Checkpoints(),
                   on_step: Callable[[int, dict, dict | None], None] | None = None
                   ) -> tuple[SatSpec, list[dict]]:
    """Train (from `start`, an adapter, when given); returns the SAT spec (embeddings + deltas)
    and the log (train_sat's format). The model is handed back with its own weights and no
    adapter layers."""
    run = LoraRun(model, config, data, start)
    checkpoint_dir = resumed(run, checkpoints)
    start = time.perf_counter()
    try:
        if not run.log:
            run.log.append({"step": 0, "heldout": heldout_metrics(run.model, run.embeddings, heldout),
                            "elapsed_s": 0.0})
        while run.step < config.steps:
            parts = run.train_step()
            run.pending.append(parts)
            held = None
            if run.step % config.eval_every == 0 or run.step == config.steps:
                held = heldout_metrics(run.model, run.embeddings.detach(), heldout)
                entry = {"step": run.step, **{k: sum(p[k] for p in run.pending) / len(run.pending)
                                              for k in parts}}
                run.log.append({**entry, "heldout": held,
                                "elapsed_s": round(run.elapsed + time.perf_counter() - start, 3)})
                run.pending = []
            if on_step is not None:
                on_step(run.step, parts, held)
            if checkpoint_dir is not None and config.save_every and run.step % config.save_every == 0:
                save_checkpoint(checkpoint_dir, run.state(run.elapsed + time.perf_counter() - start))
                if checkpoints.on_checkpoint is not None:
                    checkpoints.on_checkpoint(run.step, run.spec(), run.log)
        return run.spec(), run.log
    finally:
        run.unload()
