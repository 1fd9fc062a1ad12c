"""Teaching a causal LM semantic adaptive tokens (SATs); `sled sdsat train` runs it.

One training example is a cut c in a token sequence x: the real tokens x[0..c-1], then m SAT slots
at positions c..c+m-1 (position ids continue). With the normal shift the output at slot j
(position c+j-1) must predict x[c+j]; the last real token's output predicts x[c] as usual and is
not trained. SATs come last, so causal masking alone keeps real tokens from attending to them:

    x = [a b c d e f g],  c = 3,  m = 2
    input:   a  b  c  S1 S2
    labels:  -  -  -  e  f         (S1 -> x[4], S2 -> x[5]; c's output -> d is the model's own)

Modes:
- embeddings: the model is frozen; the only trainable tensor is the adapter [m, hidden], the SAT
  input embeddings (initialised to the mean of the model's input embeddings, embedding scale
  included). Standard-token outputs stay bit-identical: the weights never change. The real prefix
  runs once without gradients into a KV cache and only the m SAT positions are differentiated.
- full: every weight trains with the adapter, plus kl_weight * KL(p_original || p_trained) on the
  real positions, against a frozen copy of the original model, so standard tokens keep their
  distribution. Real positions cannot see the SATs, so their outputs in the joint forward are
  exactly those of a forward on the real tokens alone; the KL reads them from there.
- lora: slot embeddings plus LoRA deltas that act only at SAT slots, trained by
  self-distillation on the target's own greedy continuations: `lora.py`.

Each batch shares one cut c (no padding): a (sequence, cut) pair is drawn uniformly among all
valid pairs, and the rest of the batch is drawn from the sequences long enough for that cut.
The model stays in eval mode (no dropout), so a run is a pure function of its seed and resuming
from a checkpoint continues bit-identically.
"""
from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from verify_server.sdsat import ADAPTER_FILE, CONFIG_KEY, SatSpec, sat_inputs, save_adapter

MODES = ("embeddings", "full", "lora")
DEFAULT_LR = {"embeddings": 3e-2, "full": 1e-5}
CHECKPOINT = "train_state.pt"
LOG_FILE = "train_log.jsonl"
PLOT_FILE = "train_log.png"
SUMMARY_FILE = "train_summary.json"


@dataclass(slots=True)
class SatTrainConfig:
    slots: int = 4                 # m
    mode: str = "embeddings"
    steps: int = 300
    batch: int = 4
    lr: float | None = None        # default: DEFAULT_LR[mode]
    kl_weight: float = 1.0         # full mode only
    seed: int = 0
    eval_every: int = 25           # held-out acceptance every this many steps (and at 0 and the end)
    eval_samples: int = 64
    save_every: int = 0            # checkpoint every this many steps (0: never)

    def __post_init__(self) -> None:
        if self.mode == "lora":
            raise ValueError("mode lora trains with sdsat.lora.train_sat_lora (LoraTrainConfig)")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose embeddings, full or lora")
        for name in ("slots", "steps", "batch", "eval_every", "eval_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.save_every < 0 or self.kl_weight < 0:
            raise ValueError("save_every and kl_weight cannot be negative")
        if self.lr is None:
            self.lr = DEFAULT_LR[self.mode]

    def identity(self) -> dict:
        """What a checkpoint must agree on to be resumed: all that shapes the run and its log."""
        return {k: v for k, v in asdict(self).items() if k not in ("steps", "save_every", "eval_every")}


@dataclass(frozen=True, slots=True)
class Checkpoints:
    """A run's checkpoints: the folder it saves one in every save_every steps of its config
    (None: it saves none), whether it goes on from the one there (`resume`), and
    on_checkpoint(step, adapter, log), run after each is saved (the adapter: train_sat's
    tensor, train_sat_lora's SatSpec)."""
    folder: str | Path | None = None
    resume: bool = False
    on_checkpoint: Callable[[int, torch.Tensor | SatSpec, list[dict]], None] | None = None


@dataclass(slots=True)
class SatBatch:
    prefix: torch.Tensor    # [B, c] real tokens x[0..c-1]
    targets: torch.Tensor   # [B, m] x[c+1..c+m]: what slots 1..m must predict


def _cut_weights(lengths: list[int], slots: int) -> torch.Tensor:
    """Valid cuts per sequence: c in 1..n-m-1 (one real token before, x[c+m] after)."""
    return torch.tensor([max(0, n - slots - 1) for n in lengths], dtype=torch.float64)


def draw_batch(sequences: list[list[int]], slots: int, batch: int,
               generator: torch.Generator) -> SatBatch:
    """One batch sharing a cut: a (sequence, cut) pair uniform among all valid pairs, then
    batch - 1 more sequences long enough for that cut."""
    lengths = [len(s) for s in sequences]
    weights = _cut_weights(lengths, slots)
    if weights.sum() == 0:
        raise ValueError(f"no sequence has the {slots + 2} tokens one example with {slots} slots needs")
    first = int(torch.multinomial(weights, 1, generator=generator))
    cut = 1 + int(torch.randint(int(weights[first]), (1,), generator=generator))
    eligible = [i for i, n in enumerate(lengths) if n >= cut + slots + 1]
    picks = torch.randint(len(eligible), (batch - 1,), generator=generator).tolist()
    rows = [sequences[first]] + [sequences[eligible[i]] for i in picks]
    window = torch.tensor([row[:cut + slots + 1] for row in rows])
    return SatBatch(prefix=window[:, :cut], targets=window[:, cut + 1:])


def heldout_batches(sequences: list[list[int]], slots: int, samples: int, seed: int,
                    batch: int = 8) -> list[SatBatch]:
    """A fixed evaluation set: `samples` examples in batches drawn like training batches."""
    generator = torch.Generator().manual_seed(seed)
    sizes = [min(batch, samples - start) for start in range(0, samples, batch)]
    return [draw_batch(sequences, slots, size, generator) for size in sizes]


def initial_adapter(model: torch.nn.Module, slots: int) -> torch.Tensor:
    """[m, hidden] float32: every slot starts at the mean input embedding (scale included)."""
    embedding = model.get_input_embeddings()
    vocab = embedding.weight.shape[0]
    total = torch.zeros(embedding.weight.shape[1], dtype=torch.float64)
    with torch.no_grad():
        for start in range(0, vocab, 8192):
            ids = torch.arange(start, min(start + 8192, vocab), device=embedding.weight.device)
            total += embedding(ids[None])[0].to(torch.float64).sum(0).cpu()
    return (total / vocab).to(torch.float32)[None].repeat(slots, 1)


def sat_logits(model: torch.nn.Module, sat_embeds: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """Outputs at the SAT slots, the prefix run without gradients into a KV cache first.

    sat_embeds: [m, hidden]; prefix: [B, c] -> [B, m, vocab]. Only the slots are differentiated
    (through sat_embeds), which is all a frozen model needs.
    """
    batch, cut = prefix.shape
    slots = sat_embeds.shape[0]
    with torch.no_grad():  # the decoder alone: the prefix needs no logits
        cache = model.get_decoder()(input_ids=prefix, use_cache=True).past_key_values
    dtype = model.get_input_embeddings().weight.dtype
    embeds = sat_embeds.to(dtype)[None].expand(batch, -1, -1)
    positions = torch.arange(cut, cut + slots, device=prefix.device)[None].expand(batch, -1)
    return model(inputs_embeds=embeds, past_key_values=cache, position_ids=positions,
                 use_cache=True).logits


def _slot_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # logits [B, m, vocab], targets [B, m]: mean cross-entropy over every slot
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def heldout_metrics(model: torch.nn.Module, sat_embeds: torch.Tensor,
                    batches: list[SatBatch]) -> dict:
    """Greedy SAT acceptance against the text: slot_accuracy (fraction of slots j whose argmax is
    x[c+j]), per_slot accuracy, accepted_run (mean count of leading slots all correct), loss."""
    correct, losses = [], []
    for batch in batches:
        logits = sat_logits(model, sat_embeds, batch.prefix)
        correct.append(logits.argmax(-1) == batch.targets)
        losses.append(_slot_loss(logits, batch.targets).item())
    hits = torch.cat(correct).float()                       # [samples, m]
    run = hits.cumprod(dim=1).sum(dim=1)
    return {"slot_accuracy": hits.mean().item(), "per_slot": hits.mean(0).tolist(),
            "accepted_run": run.mean().item(), "loss": sum(losses) / len(losses)}


def sat_acceptance(model: torch.nn.Module, spec: SatSpec, sequences: list[list[int]],
                   slots: int | None = None, samples: int = 64, seed: int = 0) -> dict:
    """Held-out SAT acceptance of a model + SAT spec on `samples` cuts drawn from sequences."""
    slots = slots or spec.slots
    batches = heldout_batches(sequences, slots, samples, seed)
    return heldout_metrics(model, spec.slot_embeddings(model, slots), batches)


class _Run:
    """One training run's mutable state: adapter, optimizer, batch RNG, step and log."""

    def __init__(self, model, config: SatTrainConfig, adapter: torch.Tensor | None,
                 sequences: list[list[int]]):
        self.model, self.config = model, config
        self.data = hashlib.sha256(json.dumps(sequences).encode()).hexdigest()
        device = model.get_input_embeddings().weight.device
        init = initial_adapter(model, config.slots) if adapter is None else adapter.float()
        self.adapter = torch.nn.Parameter(init.detach().clone().to(device))
        self.reference = None
        if config.mode == "full":
            if config.kl_weight > 0:
                self.reference = copy.deepcopy(model).eval().requires_grad_(False)
            params = [self.adapter, *model.parameters()]
        else:
            params = [self.adapter]
        self.optimizer = torch.optim.Adam(params, lr=config.lr)
        self.params = params
        self.generator = torch.Generator().manual_seed(config.seed)
        self.step = 0
        self.log: list[dict] = []
        self.pending: list[dict] = []   # step losses since the last log entry
        self.elapsed = 0.0              # seconds trained before this process (resume)

    def loss(self, batch: SatBatch) -> tuple[torch.Tensor, dict]:
        """The step's loss and its parts."""
        if self.config.mode == "embeddings":
            sat = _slot_loss(sat_logits(self.model, self.adapter, batch.prefix), batch.targets)
            return sat, {"sat_loss": sat.item()}
        slots, cut = self.config.slots, batch.prefix.shape[1]
        spec = SatSpec(slots=slots, embeddings=self.adapter)
        logits = self.model(inputs_embeds=sat_inputs(self.model, spec, batch.prefix, slots)).logits
        sat = _slot_loss(logits[:, cut:], batch.targets)
        if self.reference is None:
            return sat, {"sat_loss": sat.item()}
        with torch.no_grad():
            original = self.reference(input_ids=batch.prefix).logits.float().log_softmax(-1)
        trained = logits[:, :cut].float().log_softmax(-1)
        kl = F.kl_div(trained.flatten(0, 1), original.flatten(0, 1), log_target=True,
                      reduction="batchmean")
        return sat + self.config.kl_weight * kl, {"sat_loss": sat.item(), "kl": kl.item()}

    def train_step(self, sequences: list[list[int]]) -> dict:
        batch = draw_batch(sequences, self.config.slots, self.config.batch, self.generator)
        loss, parts = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.step += 1
        return {"loss": loss.item(), **parts}

    def state(self, elapsed: float) -> dict:
        state = {"step": self.step, "elapsed_s": elapsed, "adapter": self.adapter.detach().cpu(),
                 "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                 "log": self.log, "pending": self.pending, "config": self.config.identity(),
                 "data": self.data}
        if self.config.mode == "full":
            state["model"] = self.model.state_dict()
        return state

    def restore(self, state: dict) -> None:
        check_checkpoint(state, self.config.identity(), self.data, "token sequences; resume with "
                         "the same corpus, --seq-len, --heldout and tokenizer")
        with torch.no_grad():
            self.adapter.copy_(state["adapter"])
            if "model" in state:
                self.model.load_state_dict(state["model"])
        restore_progress(self, state)


def check_checkpoint(state: dict, identity: dict, data: str, other_data: str) -> None:
    """Refuse a checkpoint of another run: other settings, or other data (`other_data` says
    which and what to resume with)."""
    if state["config"] != identity:
        raise ValueError(f"the checkpoint was trained with {state['config']}, this run asks for "
                         f"{identity}; resume with the same settings")
    if state["data"] != data:
        raise ValueError(f"the checkpoint was trained on other {other_data}")


def resumed(run, checkpoints: Checkpoints) -> Path | None:
    """The run's checkpoint folder; with `resume`, the run restored from its checkpoint there."""
    checkpoint_dir = Path(checkpoints.folder) if checkpoints.folder is not None else None
    if checkpoints.resume:
        if checkpoint_dir is None:
            raise ValueError("resume needs a checkpoint directory")
        run.restore(load_checkpoint(checkpoint_dir))
    return checkpoint_dir


def restore_progress(run, state: dict) -> None:
    """A run's optimizer, batch RNG, step, log and time so far, from its checkpoint."""
    run.optimizer.load_state_dict(state["optimizer"])
    run.generator.set_state(state["generator"])
    run.step, run.log, run.pending = state["step"], list(state["log"]), list(state["pending"])
    run.elapsed = state["elapsed_s"]


def save_checkpoint(folder: Path, state: dict) -> Path:
    """Atomically: a crash while writing leaves the previous checkpoint intact."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (CHECKPOINT + ".tmp")
    torch.save(state, tmp)
    return tmp.replace(folder / CHECKPOINT)


def load_checkpoint(folder: Path) -> dict:
    path = folder / CHECKPOINT
    if not path.is_file():
        raise ValueError(f"--resume: no checkpoint at {path}")
    return torch.load(path, weights_only=False)


def train_sat(model: torch.nn.Module, sequences: list[list[int]], config: SatTrainConfig,
              heldout: list[list[int]] | None = None, adapter: torch.Tensor | None = None,
              checkpoints: Checkpoints = Checkpoints(),
              on_step: Callable[[int, dict, dict | None], None] | None = None,
              ) -> tuple[SatSpec, list[dict]]:
    """Train SATs into `model` on token sequences; returns the SAT spec and the log.

    The log has one entry at step 0 (the untrained adapter), every eval_every steps and at the end:
    {"step", "loss" (mean training loss since the previous entry), "sat_loss", ["kl"], "heldout":
    heldout_metrics(...), "elapsed_s"}. heldout defaults to the training sequences.
    on_step(step, parts, heldout or None) follows progress; checkpoints.on_checkpoint(step, adapter,
    log) runs at each checkpoint. In embeddings mode the model's weights are left exactly as they
    were.
    """
    run = _Run(model, config, adapter, sequences)
    checkpoint_dir = resumed(run, checkpoints)
    batches = heldout_batches(heldout or sequences, config.slots, config.eval_samples,
                              config.seed + 1)
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    model.eval().requires_grad_(config.mode == "full")
    start = time.perf_counter()

    def elapsed() -> float:
        return round(run.elapsed + time.perf_counter() - start, 3)

    try:
        if not run.log:
            run.log.append({"step": 0, "heldout": heldout_metrics(model, run.adapter, batches),
                            "elapsed_s": 0.0})
        while run.step < config.steps:
            parts = run.train_step(sequences)
            run.pending.append(parts)
            held = None
            if run.step % config.eval_every == 0 or run.step == config.steps:
                held = heldout_metrics(model, run.adapter.detach(), batches)
                entry = {"step": run.step}
                for key in parts:
                    entry[key] = sum(p[key] for p in run.pending) / len(run.pending)
                entry["heldout"] = held
                entry["elapsed_s"] = elapsed()
                run.log.append(entry)
                run.pending = []
            if on_step is not None:
                on_step(run.step, parts, held)
            if checkpoint_dir is not None and config.save_every and run.step % config.save_every == 0:
                save_checkpoint(checkpoint_dir, run.state(elapsed()))
                if checkpoints.on_checkpoint is not None:
                    checkpoints.on_checkpoint(run.step, run.adapter.detach().cpu(), run.log)
    finally:
        for name, param in model.named_parameters():
            param.requires_grad_(trainable[name])
    spec = SatSpec(slots=config.slots, embeddings=run.adapter.detach().cpu().clone(), source="trained")
    return spec, run.log


# --- a training run's folder --------------------------------------------------------------------

def write_log(folder: Path, log: list[dict]) -> Path:
    path = folder / LOG_FILE
    path.write_text("".join(json.dumps(entry) + "\n" for entry in log))
    return path


@dataclass(slots=True)
class TrainingFolder:
    """What a run writes under `out`: the adapter (with `metadata`), the log and a summary, and
    in full mode the tuned model beside them. At a checkpoint, the adapter and log so far."""
    out: Path
    metadata: dict

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)

    def on_checkpoint(self, step: int, adapter: torch.Tensor | SatSpec, log: list[dict]) -> None:
        spec = adapter if isinstance(adapter, SatSpec) else SatSpec(len(adapter), embeddings=adapter)
        save_adapter(self.out / ADAPTER_FILE, spec.embeddings, {**self.metadata, "steps": step},
                     spec.lora)
        write_log(self.out, log)

    def save(self, spec: SatSpec, log: list[dict], config: SatTrainConfig, sequences: dict,
             model: torch.nn.Module, tokenizer) -> Path:
        """The finished run; sequences: {"train": count, "heldout": count}. Returns the adapter."""
        self.metadata["steps"] = config.steps
        adapter = save_adapter(self.out / ADAPTER_FILE, spec.embeddings, self.metadata, spec.lora)
        write_log(self.out, log)
        if getattr(config, "mode", "lora") == "full":
            setattr(model.config, CONFIG_KEY, {"slots": config.slots, "adapter": ADAPTER_FILE})
            model.save_pretrained(self.out, safe_serialization=True)
            tokenizer.save_pretrained(self.out)
        summary = {"metadata": self.metadata, "config": asdict(config), "sequences": sequences,
                   "untrained": log[0]["heldout"], "trained": log[-1]["heldout"],
                   "elapsed_s": log[-1]["elapsed_s"]}
        (self.out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        return adapter
