"""`sled sdsat train`: train SATs into a causal LM (sdsat.train), then write the
adapter, log, plot and summary."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from transformers import AutoModelForCausalLM, AutoTokenizer

from lab.bench.report import save_figure, subplots
from sdsat.corpus import load_documents, split_heldout, tokenize_documents
from sdsat.train import LOG_FILE, PLOT_FILE, Checkpoints, SatTrainConfig, TrainingFolder, train_sat
from sled.flags import (builtin_aliases, fraction, non_negative_float, non_negative_int,
                            positive_float, positive_int)
from sled.models import resolve_model
from sled.progress import plain_line
from sled.wire.fingerprint import fingerprint_tokenizer
from verify_server.target import DTYPES


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True,
                        help=f"built-in alias ({builtin_aliases()}) or checkpoint path")
    parser.add_argument("--corpus", required=True,
                        help="humaneval[:N], a .jsonl (text, or prompt + completion), a text "
                             "file, or a directory of .py files")
    parser.add_argument("--out", required=True,
                        help="folder for the adapter, log, plot (full: model)")
    parser.add_argument("--mode", default="embeddings", choices=["embeddings", "full", "lora"],
                        help="embeddings: model frozen, only the SAT embeddings train (standard "
                             "tokens bit-identical); lora: SAT embeddings + LoRA deltas acting "
                             "only at SAT slots, by self-distillation (standard tokens "
                             "bit-identical); full: all weights + a KL term on standard tokens")
    parser.add_argument("--slots", type=positive_int, default=4,
                        help="SAT slots m (tokens drafted per pass)")
    parser.add_argument("--steps", type=positive_int, default=300, help="optimizer steps")
    parser.add_argument("--batch", type=positive_int, default=4,
                        help="examples per step (they share one cut)")
    parser.add_argument("--seq-len", type=positive_int, default=256, help="longest token sequence")
    parser.add_argument("--lr", type=positive_float, default=None,
                        help="Adam lr (default: 3e-2 embeddings, 1e-5 full)")
    parser.add_argument("--kl-weight", type=non_negative_float, default=1.0,
                        help="full mode: weight of the KL term")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="training seed")
    parser.add_argument("--heldout", type=fraction, default=0.1,
                        help="fraction of sequences held out")
    parser.add_argument("--eval-every", type=positive_int, default=None, help="default: steps / 20")
    parser.add_argument("--eval-samples", type=positive_int, default=64,
                        help="held-out cuts per evaluation")
    parser.add_argument("--save-every", type=non_negative_int, default=0,
                        help="checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    parser.add_argument("--checkpoint-dir", default=None, help="default: OUT/checkpoint")
    parser.add_argument("--keep-checkpoint", action="store_true",
                        help="keep the checkpoint after a finished run (default: removed)")
    parser.add_argument("--dtype", default="float32", help="float32, float64, bfloat16, float16")
    lora = parser.add_argument_group("--mode lora (self-distillation)")
    lora.add_argument("--prompts", type=positive_int, default=256,
                      help="corpus prompts the target continues greedily (the training set)")
    lora.add_argument("--prompt-len", type=positive_int, default=96, help="tokens per prompt")
    lora.add_argument("--prompts-at", default="lines", choices=["lines", "bodies"],
                      help="lines: windows starting at a line; bodies: windows ending where a "
                           "documented function's body begins (the target writes the body)")
    lora.add_argument("--init-adapter", default=None, metavar="FILE",
                      help="go on training this LoRA SAT adapter (same slots, rank, alpha) "
                           "instead of starting from scratch")
    lora.add_argument("--new-tokens", type=positive_int, default=96,
                      help="greedy tokens generated per prompt (the cuts lie in them)")
    lora.add_argument("--rank", type=positive_int, default=8, help="LoRA rank r")
    lora.add_argument("--alpha", type=positive_float, default=16.0, help="LoRA alpha")
    lora.add_argument("--cuts", type=positive_int, default=24,
                      help="cuts per sequence per step (they share one prefix pass)")
    lora.add_argument("--embedding-lr", type=positive_float, default=1e-2,
                      help="Adam lr of the slot embeddings (--lr is the deltas', default 2e-3)")


def run(args) -> int:
    console = Console(stderr=True)
    try:
        return _train(args, console)
    except ValueError as exc:   # bad settings, corpus or checkpoint
        console.print(f"[red]error:[/] {exc}")
        return 2


def _train(args, console) -> int:
    """Load, tokenize, train, then write the run's folder and plot."""
    if args.mode == "lora":
        # a cycle: sled_cli.sdsat_lora imports this module
        from sled_cli.sdsat_lora import train_lora

        return train_lora(args, console)
    config = _config(args)
    documents = load_documents(args.corpus)
    model, tokenizer = load(args.model, args.dtype)
    sequences = tokenize_documents(tokenizer, documents, args.seq_len, min_len=config.slots + 2)
    train, heldout = split_heldout(sequences, args.heldout)
    console.print(f"{args.model}: {len(documents)} documents -> {len(train)} training and "
                  f"{len(heldout)} held-out sequences of <= {args.seq_len} tokens; mode "
                  f"{config.mode}, {config.slots} slots, lr {config.lr}")
    folder = TrainingFolder(Path(args.out), {
        "base_model": args.model, "mode": config.mode, "slots": config.slots, "corpus": args.corpus,
        "seed": config.seed, "seq_len": args.seq_len, "batch": config.batch, "lr": config.lr,
        "tokenizer": fingerprint_tokenizer(tokenizer)})
    checkpoint_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else folder.out / "checkpoint"
    with progress_bar("SAT training") as progress:
        spec, log = train_sat(model, train, config, heldout,
                              checkpoints=Checkpoints(checkpoint_dir, args.resume,
                                                      folder.on_checkpoint),
                              on_step=on_step(progress, config.steps))
    adapter = folder.save(spec, log, config, {"train": len(train), "heldout": len(heldout)},
                          model, tokenizer)
    plot = plot_log(folder.out / PLOT_FILE, log, f"SAT training: {args.model}, {config.mode}, "
                    f"{config.slots} slots, {args.corpus}")
    return finish(args, console, checkpoint_dir, log, config.slots, [adapter, folder.out / LOG_FILE, plot])


def finish(args, console, checkpoint_dir: Path, log: list[dict], slots: int, written: list) -> int:
    """Remove the checkpoint (unless kept), say what the run reached and wrote."""
    if not args.keep_checkpoint and checkpoint_dir.exists():
        shutil.rmtree(checkpoint_dir)
    first, last = log[0]["heldout"], log[-1]["heldout"]
    console.print(f"held-out greedy SAT acceptance {first['slot_accuracy']:.3f} -> "
                  f"{last['slot_accuracy']:.3f}, accepted run {first['accepted_run']:.2f} -> "
                  f"{last['accepted_run']:.2f} of {slots}")
    console.print(f"wrote {', '.join(str(w) for w in written)}")
    return 0 if math.isfinite(log[-1].get("loss", 0.0)) else 1


def _config(args):
    """The training settings from the flags (ValueError names the bad one)."""
    config = SatTrainConfig(slots=args.slots, mode=args.mode, steps=args.steps, batch=args.batch,
                            lr=args.lr, kl_weight=args.kl_weight, seed=args.seed,
                            eval_every=args.eval_every or max(1, args.steps // 20),
                            eval_samples=args.eval_samples, save_every=args.save_every)
    if args.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {args.dtype!r}; choose one of {', '.join(DTYPES)}")
    return config


def load(model: str, dtype: str):
    """(model in eval mode, tokenizer) from a built-in alias or a checkpoint path."""
    path = resolve_model(model)
    return (AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval(),
            AutoTokenizer.from_pretrained(path))


def on_step(progress, steps: int):
    """train_sat's on_step: the bar's position, the last loss and held-out acceptance. A resumed
    run's bar starts at its step; away from a terminal each evaluation is also a plain line."""
    task = progress.add_task("train", total=steps, status="")
    status = {"acc": float("nan"), "run": float("nan"), "first": True}

    def on_step(step: int, parts: dict, held: dict | None) -> None:
        if status.pop("first", False):
            progress.reset(task, completed=step - 1)     # the rate counts this run's steps only
        if held is not None:
            status.update(acc=held["slot_accuracy"], run=held["accepted_run"])
        line = f"loss {parts['loss']:.3f}  held-out acc {status['acc']:.3f}  run {status['run']:.2f}"
        progress.update(task, completed=step, status=line)
        if held is not None:
            plain_line(f"step {step} of {steps}: {line}")

    return on_step


def plot_log(path: Path, log: list[dict], title: str) -> Path:
    """Loss, per-slot held-out acceptance and accepted run length against the step."""
    fig, axes = subplots(3, figsize=(15, 4))
    trained = [e for e in log if "loss" in e]
    steps = [e["step"] for e in log]
    axes[0].plot([e["step"] for e in trained], [e["loss"] for e in trained], label="training loss")
    axes[0].plot(steps, [e["heldout"]["loss"] for e in log], label="held-out SAT loss")
    if trained and "kl" in trained[0]:
        axes[0].plot([e["step"] for e in trained], [e["kl"] for e in trained], label="KL to original")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("cross-entropy (nats)")
    axes[1].plot(steps, [e["heldout"]["slot_accuracy"] for e in log], "k-", lw=2, label="all slots")
    for j in range(len(log[0]["heldout"]["per_slot"])):
        axes[1].plot(steps, [e["heldout"]["per_slot"][j] for e in log], lw=1, label=f"slot {j + 1}")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("held-out greedy acceptance")
    axes[2].plot(steps, [e["heldout"]["accepted_run"] for e in log], label="accepted run")
    axes[2].axhline(log[0]["heldout"]["accepted_run"], ls="--", color="gray", label="untrained")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("leading slots all correct (mean)")
    return save_figure(fig, axes, path, title)


def progress_bar(label: str):
    return Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[status]}"))
